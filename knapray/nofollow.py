"""Writing inside a run directory or a corpus without following a planted symbolic link.

Anyone who can write into a run directory can replace ``metrics.jsonl`` by a link to any
file, or ``ledger/`` by a link to any directory; a resume that then truncated, appended to
or created files there would change files outside it. knapray never creates a link in a
run directory or a corpus, so:

- ``refuse_links(root)`` (pre-flight, before anything is written) refuses a tree that holds
  one, naming it in one line;
- ``open_nofollow`` / ``truncate_nofollow`` open the file itself with ``O_NOFOLLOW``, so a
  link planted after the check is refused too, and its target is never opened.

``refuse_links`` looks below ``root``, not at it: a folder above a run directory may be a link
(a user's ``runs -> /scratch/runs``), the run directory itself may not
(``knapray.driver.run_dir.refuse_run_links``: the target of ``runs/r -> /elsewhere`` is not
the run's).

A file ``open_nofollow`` opened says what failed and where: an error of the file system
(opening it, or any read or write through it: a full disk when the buffer is flushed) is
a ``FileError`` naming the operation and the path (``appending to <path>: No space left
on device``), of the kind the caller catches (``FileExistsError`` stays one).
"""

from __future__ import annotations

import io
import os
from typing import IO

from knapray.file_errors import file_op


class PlantedLink(ValueError):
    """A symbolic link where knapray writes; the message names it, in one line."""

    def __init__(self, path: str, what: str = "a run directory") -> None:
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        super().__init__(f"{path} is a symbolic link (to {target}); knapray never follows links in {what}: "
                         "remove it (or restore the file it replaced)")
        self.path = path


def refuse_links(root: str, what: str = "a run directory") -> None:
    """Raise ``PlantedLink`` for the first symbolic link (to a file or a directory) below
    ``root``; a missing ``root`` holds none. Directories reached through a link are not
    entered (the link itself is what is refused)."""
    if not os.path.isdir(root):
        return
    for directory, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            if os.path.islink(path):
                raise PlantedLink(path, what)


_MODES = {
    "r": os.O_RDONLY, "rb": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


_OPS = {"r": "reading", "w": "writing", "a": "appending to", "x": "creating"}
"""What a mode does to its file, as an error message says it."""


class _NamedFile(io.FileIO):
    """A raw file whose failing reads and writes say which file and what was being done
    (every buffered flush reaches the file system through ``write``)."""

    def __init__(self, fd: int, mode: str, path: str) -> None:
        super().__init__(fd, mode[0], closefd=True)
        self._path, self._op = path, _OPS[mode[0]]

    def write(self, data) -> int | None:
        with file_op(self._op, self._path):
            return super().write(data)

    def readinto(self, buffer) -> int | None:
        with file_op("reading", self._path):
            return super().readinto(buffer)

    def readall(self) -> bytes:
        with file_op("reading", self._path):
            return super().readall()


def open_nofollow(path: str, mode: str = "r", what: str = "a run directory", encoding: str | None = None) -> IO:
    """``open(path, mode)`` (r, w, a, x, with b) that refuses a symbolic link at ``path``
    (``PlantedLink``) instead of opening its target; what the file system refuses, then or
    later through the file, is a ``FileError`` naming the operation and ``path``."""
    if mode not in _MODES:
        raise ValueError(f"open_nofollow: mode {mode!r} is not one of {sorted(_MODES)}")
    try:
        fd = os.open(path, _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise PlantedLink(path, what) from None
        with file_op(_OPS[mode[0]], path):
            raise e
    try:
        raw = _NamedFile(fd, mode, str(path))
    except BaseException:
        os.close(fd)
        raise
    f = io.BufferedReader(raw) if mode[0] == "r" else io.BufferedWriter(raw)
    return f if "b" in mode else io.TextIOWrapper(f, encoding=encoding or "utf-8")


def truncate_nofollow(path: str, size: int, what: str = "a run directory") -> None:
    """``os.truncate(path, size)`` that refuses a symbolic link at ``path``."""
    with open_nofollow(path, "ab", what) as f:  # O_APPEND does not move ftruncate's cut
        os.ftruncate(f.fileno(), size)
