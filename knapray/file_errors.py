"""A file-system error that says what knapray was doing, and to which file, in one line.

``os.write``, ``os.fsync`` and a file object's ``flush`` raise ``OSError`` without a file
name (``[Errno 28] No space left on device``): a full disk under a run's ledger journal
reached the user as that alone. ``file_op(op, path)`` turns any ``OSError`` raised inside it
into a ``FileError`` whose text is ``<op> <path>: <reason>``, e.g. ``appending to the ledger
journal /r/ledger/journal-000000000000.bin: No space left on device``. The kinds a caller
may catch (``FileNotFoundError``, ``FileExistsError``, ``PermissionError``,
``IsADirectoryError``, ``NotADirectoryError``) stay catchable as such. A ``FileError``
pickles whole (the operation too), so it crosses from a Ray actor or worker to the driver.
"""

from __future__ import annotations

import contextlib
import errno as errnos
from collections.abc import Iterator


class FileError(OSError):
    """An ``OSError`` that names the operation (``op``) and the file (``filename``)."""

    op: str = "using"

    def __str__(self) -> str:
        reason = self.strerror or (errnos.errorcode.get(self.errno, "") if self.errno else "") or "failed"
        return f"{self.op} {self.filename}: {reason}"


class FileNotFound(FileError, FileNotFoundError):
    pass


class FileExists(FileError, FileExistsError):
    pass


class FilePermission(FileError, PermissionError):
    pass


class FileIsADirectory(FileError, IsADirectoryError):
    pass


class FileNotADirectory(FileError, NotADirectoryError):
    pass


_KINDS: tuple[tuple[type[OSError], type[FileError]], ...] = (
    (FileNotFoundError, FileNotFound), (FileExistsError, FileExists), (PermissionError, FilePermission),
    (IsADirectoryError, FileIsADirectory), (NotADirectoryError, FileNotADirectory),
)


def file_error(op: str, path: str, error: OSError) -> FileError:
    """``error`` as a ``FileError`` naming ``op`` and ``path`` (of the same kind, for the kinds
    callers catch)."""
    if isinstance(error, FileError):
        return error
    cls = next((mine for kind, mine in _KINDS if isinstance(error, kind)), FileError)
    out = cls(error.errno, error.strerror or str(error) or type(error).__name__, str(path))
    out.op = op
    return out


@contextlib.contextmanager
def file_op(op: str, path: str) -> Iterator[None]:
    """Inside: an ``OSError`` is re-raised as ``file_error(op, path, it)`` (``op``: what is done
    to ``path``, as a phrase that reads before it: "appending to", "writing the snapshot")."""
    try:
        yield
    except FileError:
        raise
    except OSError as e:
        raise file_error(op, path, e) from e
