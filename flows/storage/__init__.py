"""One storage layer (local + S3) and what is stored: hive logs, the label store, anchors, publications."""

# The backends register their URI schemes with `Storage.for_uri` (`objects.register_backend`) on import: the
# package imports them once, so the factory in objects.py needs no import of its subclasses.
from flows.storage import local, s3  # noqa: E402,F401  (registration)

# A process that touches storage waits for Arrow's thread pools at exit: a pool task holding a Python
# object must not outlive the interpreter (SIGABRT, exit 134; see flows.storage.arrow_threads).
from flows.storage.arrow_threads import install_exit_wait  # noqa: E402

install_exit_wait()
