"""Local folders as object storage (atomic writes, create-only puts, stale temp-file cleanup)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs


from cje_engine.errors import CJEInputError

from flows.storage.objects import (STALE_TMP_SECONDS, TMP_PREFIX, NotFoundError, ObjectInfo, Storage, StorageConfig,
                                   StorageError, check_key, register_backend, short_error)

log = logging.getLogger(__name__)

#: Attempts at a temporary file whose folder a concurrent `LocalStorage.delete` removed as it was created.
FOLDER_RACE_TRIES = 5

_T = TypeVar("_T")


def _iso_mtime(ns: int) -> str:
    return "mtime:" + datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class LocalStorage(Storage):
    """A local folder; writes are atomic (temporary file + rename / hard link)."""

    def __init__(self, root: Path, config: StorageConfig | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.config = config or StorageConfig()
        self.uri = str(self.root)

    def __reduce__(self):
        return (LocalStorage, (self.root, self.config))

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def url(self, key: str = "") -> str:
        """Local path of ``key`` (the root for an empty key); see `Storage.url`."""
        if not key:
            return str(self.root)
        return str(self.root.joinpath(*check_key(key, allow_empty=True).rstrip("/").split("/")))

    def _fail(self, op: str, key: str, exc: BaseException) -> StorageError:
        cls = NotFoundError if isinstance(exc, FileNotFoundError) else StorageError
        what = "does not exist" if cls is NotFoundError else short_error(exc, self.config)
        return cls(f"{op} {self.url(key)} failed: {what}", key=key, operation=op)

    def read_bytes(self, key: str) -> bytes:
        """The bytes of ``key``; see `Storage.read_bytes`."""
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise self._fail("read", key, exc) from None

    @staticmethod
    def sweep_stale_tmp(folder: Path, older_than: float = STALE_TMP_SECONDS) -> int:
        """Remove ``.cje-tmp-*`` files of killed writers (untouched for ``older_than`` seconds)
        from ``folder``; returns how many were removed."""
        removed = 0
        cutoff = time.time() - older_than
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed += 1
        if removed:
            log.info("removed %d stale temporary file(s) of killed writers in %s", removed, folder)
        return removed

    def _open_tmp(self, path: Path, opener: Callable[[Path], _T]) -> tuple[Path, _T]:
        """Create the folder of ``path`` and a new temporary file beside it, opened for writing by ``opener``
        (``opener(tmp)``: the open file); the temporary file's path and the open file. The one place a write
        creates its folder and its temporary file (`_tmp_file`, `open_output`): a folder removed between its
        creation and the file's (`delete` removes the folders it leaves empty, and another thread or process may
        delete the last object of a folder this write creates) is created again, up to `FOLDER_RACE_TRIES`
        attempts, the last one's `FileNotFoundError` propagating. Once the temporary file exists, its folder is
        not empty and no `delete` removes it. On any failure no temporary file is left."""
        attempt = 1
        while True:
            tmp = path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.sweep_stale_tmp(path.parent)
                return tmp, opener(tmp)
            except FileNotFoundError:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                if attempt >= FOLDER_RACE_TRIES:
                    raise
                log.info("folder %s removed by a concurrent delete while writing %s: creating it again "
                         "(attempt %d of %d)", path.parent, path.name, attempt + 1, FOLDER_RACE_TRIES)
                attempt += 1
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

    def _tmp_file(self, path: Path, data: bytes) -> Path:
        """``data`` in a new temporary file beside ``path`` (`_open_tmp`: its folder created, again if a
        concurrent `delete` removed it); on any failure (a full disk, ...) the partial temporary file is removed
        before the error propagates."""
        tmp, fh = self._open_tmp(path, lambda t: open(t, "wb"))
        try:
            with fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return tmp

    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` through a temporary file and an atomic rename; see `Storage.write_bytes`."""
        path = self._path(key)
        tmp = None
        try:
            tmp = self._tmp_file(path, bytes(data))
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            raise self._fail("write", key, exc) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent (a hard link of a complete temporary file); see `Storage.put_if_absent`."""
        path = self._path(key)
        tmp = None
        try:
            tmp = self._tmp_file(path, bytes(data))
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # No hard links on this filesystem: exclusive create (content appears progressively).
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                try:
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(bytes(data))
                        fh.flush()
                        os.fsync(fh.fileno())
                except BaseException:
                    with contextlib.suppress(OSError):
                        path.unlink()  # ours (O_EXCL): never leave a partial object under the key
                    raise
                return True
        except OSError as exc:
            raise self._fail("create", key, exc) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def info(self, key: str) -> ObjectInfo:
        """Size and modification time of the file ``key``; see `Storage.info`."""
        try:
            st = self._path(key).stat()
        except OSError as exc:
            raise self._fail("stat", key, exc) from None
        if not os.path.isfile(self._path(key)):
            raise NotFoundError(f"stat {self.url(key)} failed: not a file", key=key, operation="stat")
        return ObjectInfo(key, st.st_size, _iso_mtime(st.st_mtime_ns), st.st_mtime_ns / 1e9)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Files under ``prefix``, sorted by key (an unreadable folder raises); see `Storage.list`."""
        check_key(prefix, allow_empty=True) if prefix else None
        # Walk the deepest existing folder that covers the prefix.
        folder_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*folder_part.split("/")) if folder_part else self.root
        out: list[ObjectInfo] = []
        if not start.is_dir():
            self._check_no_dangling_folder(start)
            return out
        def unlistable(exc: OSError) -> None:  # os.walk would silently skip a folder it cannot read
            if not isinstance(exc, FileNotFoundError):  # (a folder deleted while listing is gone)
                raise CJEInputError(f"folder cannot be listed ({exc.strerror or exc}); its objects would be "
                                    "missed", source=str(exc.filename or start)) from None

        try:
            for dirpath, dirnames, filenames in os.walk(start, onerror=unlistable):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, self.root)
                for name in filenames:
                    if name.startswith(TMP_PREFIX):
                        continue
                    key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                    if not key.startswith(prefix):
                        continue
                    st = self._stat_listed(os.path.join(dirpath, name))
                    if st is not None:
                        out.append(ObjectInfo(key, st.st_size, _iso_mtime(st.st_mtime_ns), st.st_mtime_ns / 1e9))
        except CJEInputError:
            raise
        except OSError as exc:
            raise self._fail("list", prefix or ".", exc) from None
        out.sort(key=lambda o: o.key)
        return out

    def _check_no_dangling_folder(self, folder: Path) -> None:
        """Raise `CJEInputError` naming ``folder`` (or the folder above it, up to the root) when it is a
        symbolic link whose target is gone: a day folder ``dt=...`` linked to a folder moved away is never
        listed as an empty day."""
        for path in (folder, *folder.parents):
            if path == self.root or self.root not in path.parents:
                return
            if os.path.islink(path) and not os.path.exists(path):
                raise CJEInputError("is a symbolic link whose target does not exist; the objects under it "
                                    "cannot be listed (remove it or fix the link)", source=str(path))

    @staticmethod
    def _stat_listed(path: str) -> os.stat_result | None:
        """``os.stat`` of a listed file; None only if it was really deleted while listing.

        A symbolic link whose target is missing (or loops) is still there: it raises
        `CJEInputError` naming it, so a day's only file is never silently dropped.
        """
        try:
            return os.stat(path)
        except OSError as exc:
            if os.path.islink(path):
                what = ("a symbolic link whose target does not exist" if isinstance(exc, FileNotFoundError)
                        else f"a symbolic link that cannot be followed ({exc.strerror or exc})")
                raise CJEInputError(f"is {what}; the object cannot be read (remove it or fix the link)",
                                    source=path) from None
            if isinstance(exc, FileNotFoundError):
                return None  # deleted while listing
            raise CJEInputError(f"cannot be read ({exc.strerror or exc})", source=path) from None

    def delete(self, key: str) -> None:
        """Delete ``key`` and the folders it leaves empty (never the root); see `Storage.delete`."""
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail("delete", key, exc) from None
        # Remove folders left empty (never the root).
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    @property
    def arrow_fs(self) -> tuple[pafs.FileSystem, str]:
        """pyarrow's local filesystem and the root folder; see `Storage.arrow_fs`."""
        return pafs.LocalFileSystem(), str(self.root)

    @contextlib.contextmanager
    def open_output(self, key: str) -> Iterator[Any]:
        """Write ``key`` through a temporary file renamed into place on success (its folder created, again if a
        concurrent `delete` removed it: `_open_tmp`); see `Storage.open_output`."""
        path = self._path(key)
        fs = pafs.LocalFileSystem()
        try:
            tmp, stream = self._open_tmp(path, lambda t: fs.open_output_stream(str(t)))
        except OSError as exc:
            raise self._fail("write", key, exc) from None
        try:
            try:
                yield stream
            finally:
                stream.close()
            os.replace(tmp, path)
        except OSError as exc:
            raise self._fail("write", key, exc) from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


@register_backend("", "file")
def open_local(uri: str, config: StorageConfig) -> LocalStorage:
    """The `Storage.for_uri` backend of plain paths and ``file://`` URIs: a `LocalStorage` of the folder."""
    return LocalStorage(Path(urlparse(uri).path if uri.startswith("file://") else uri), config)
