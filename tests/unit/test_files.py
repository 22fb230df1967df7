"""The bounded file readers (knapray/files.py): every way a file can be wrong is the caller's
error class, in one line naming the file."""

from __future__ import annotations

import pytest

from knapray.files import read_json, read_text, size_text


class Bad(ValueError):
    pass


@pytest.mark.parametrize("content, needle", [
    (b'{"a": 1}' + b" " * 100, "is over 100 bytes, more than any run file knapray reads"),
    (b"\xff\xfe{}", "is not JSON (not UTF-8: byte 0xff at offset 0): restore it"),
    (b"{nope", "is not JSON (Expecting property name"),
    (b"[1, 2]", "holds a list, not a JSON object: restore it"),
    (b"[" * 100_000 + b"]" * 100_000, "is not JSON"),
])
def test_a_file_that_is_not_a_bounded_json_object_is_one_line(content, needle, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(Bad) as e:
        read_json(str(path), 200_001 if content.startswith(b"[[") else 100, "run file", Bad, advice="restore it")
    message = str(e.value)
    assert message.startswith(f"run file {path} ") and needle in message and "\n" not in message


def test_a_missing_file_is_an_error_or_the_value_asked_for(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(Bad, match=r"^state file .*nope\.json cannot be read \(No such file or directory\)$"):
        read_json(missing, 100, "state file", Bad)
    assert read_json(missing, 100, "state file", Bad, missing=None) is None
    with pytest.raises(Bad, match="cannot be read"):
        read_text(str(tmp_path), 100, "config file", Bad)  # a folder


def test_text_and_json_within_the_bound_read_back(tmp_path):
    path = tmp_path / "f"
    path.write_bytes('{"é": [1]}'.encode())
    assert read_json(str(path), 11, "file") == {"é": [1]}  # 11 bytes: exactly the bound
    assert read_text(str(path), 11, "file") == '{"é": [1]}'
    path.write_bytes(b"\xc3")
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 0xc3 at offset 0\): is it a run config\?$"):
        read_text(str(path), 11, "config file", advice="is it a run config?")
    assert [size_text(n) for n in (1 << 20, 16 << 20, 3 << 10, 1000, 1 << 28)] == [
        "1 MiB", "16 MiB", "3 KiB", "1000 bytes", "256 MiB"]
