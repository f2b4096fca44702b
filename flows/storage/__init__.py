"""One storage layer (local + S3) and what is stored: hive logs, the label store, anchors, publications."""

# The backends register their URI schemes with `Storage.for_uri` (`objects.register_backend`) on import: the
# package imports them once, so the factory in objects.py needs no import of its subclasses.
from flows.storage import local, s3  # noqa: E402,F401  (registration)
