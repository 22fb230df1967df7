"""Reading a small file whole, but never more than a bound: a file far larger than any file
of its kind is not one, and is not read into memory.

``read_text`` gives the file's UTF-8 text, ``read_json`` the JSON object it holds. Each
raises the caller's error class (``error``) with one line that names the file (``what``:
"run file", "checkpoint file"...) and what is wrong with it. Files are opened as ``open``
does, or with ``follow_links=False`` without following a symbolic link at ``path`` (a run
directory's files: a link there is one line naming it, its target never opened; pre-flight
refuses any link below a run directory before anything is read, ``knapray.nofollow``).
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

_ERROR = object()


def size_text(n: int) -> str:
    """``n`` bytes in words: "16 MiB", "64 KiB", "1000 bytes"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _read(path: str, limit: int, what: str, error: type[Exception], missing: Any,
          follow_links: bool = True) -> bytes | None:
    """At most ``limit`` bytes of ``path``; None if there is no file and ``missing`` is given."""
    try:
        f = open(path, "rb") if follow_links else os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
        with f:
            raw = f.read(limit + 1)
    except OSError as e:
        if not follow_links and e.errno == errno.ELOOP and os.path.islink(path):
            raise error(f"{what} {path} is a symbolic link; knapray never follows a link there: remove it "
                        "(or restore the file it replaced)") from None
        if isinstance(e, FileNotFoundError):
            if missing is not _ERROR:
                return None
            raise error(f"{what} {path} cannot be read ({e.strerror})") from None
        raise error(f"{what} {path} cannot be read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise error(f"{what} {path} is over {size_text(limit)}, more than any {what} knapray reads")
    return raw


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
    return f"byte 0x{raw[e.start]:02x} at offset {e.start}"


def read_text(path: str, limit: int, what: str, error: type[Exception] = ValueError, *,
              advice: str = "", missing: Any = _ERROR, follow_links: bool = True) -> Any:
    """The text of the file ``path``: at most ``limit`` bytes of UTF-8. ``missing``: what to
    return when there is no file there (default: ``error`` saying so). ``advice`` ends the
    line of a file that is there but is not text. ``follow_links=False``: a symbolic link
    at ``path`` is ``error`` (its target is never opened)."""
    raw = _read(path, limit, what, error, missing, follow_links)
    if raw is None:
        return missing
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        then = f": {advice}" if advice else ""
        raise error(f"{what} {path} is not UTF-8 text ({_not_utf8(raw, e)}){then}") from None


def read_json(path: str, limit: int, what: str, error: type[Exception] = ValueError, *,
              advice: str = "", missing: Any = _ERROR, follow_links: bool = True) -> Any:
    """The JSON object (a dict) in the file ``path``, at most ``limit`` bytes of UTF-8; a file
    that holds no JSON, or JSON that is not an object, is ``error`` too (``missing``,
    ``advice`` and ``follow_links`` as for ``read_text``). The parser's message names a
    place in the file, never its text."""
    raw = _read(path, limit, what, error, missing, follow_links)
    if raw is None:
        return missing
    then = f": {advice}" if advice else ""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not JSON (not UTF-8: {_not_utf8(raw, e)}){then}") from None
    except ValueError as e:
        raise error(f"{what} {path} is not JSON ({e}){then}") from None
    except RecursionError:
        raise error(f"{what} {path} is not JSON (nested too deeply){then}") from None
    if not isinstance(doc, dict):
        raise error(f"{what} {path} holds a {type(doc).__name__}, not a JSON object{then}")
    return doc
