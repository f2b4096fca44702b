"""moto's S3 server with atomic object writes: what the tests run as their S3 server (`tests.s3server`).

moto (5.x, ``moto/s3/responses.py``) checks ``If-Match`` / ``If-None-Match`` of a ``PutObject`` and then
stores the object in two steps without a lock, so two racing conditional writes can both pass the check
on its threaded server. AWS S3 and Ceph radosgw decide a conditional write atomically (the radosgw tier
races them for real: tests/integration/test_radosgw.py). Under load the default tier saw moto's window:
the latest-pointer race ended on an older publication once in 30 rounds, and racing budget reservations
stored 60 labels' worth against a budget of 50. The tests test our compare-and-swap, not moto's, so this
server takes one lock around every ``PutObject`` (check and store together), as the real servers behave.

    python -m atomic_moto -H 127.0.0.1 -p PORT     # from the tests folder, as `tests.s3server` runs it
"""
from __future__ import annotations

import threading

from moto import server
from moto.s3.responses import S3Response

_LOCK = threading.Lock()
_put_object = S3Response.put_object


def _atomic_put_object(self: S3Response):  # noqa: ANN202 - moto's own return type
    """``PutObject`` with its precondition check and its store under one lock."""
    with _LOCK:
        return _put_object(self)


S3Response.put_object = _atomic_put_object

if __name__ == "__main__":
    server.main()
