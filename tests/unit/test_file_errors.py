"""A file-system error names the file and the operation, in one line (issue 43, item 3): a
full disk under the ledger journal was ``[Errno 28] No space left on device`` alone under
Ray. The real errors come from ``/dev/full`` (every write to it is ENOSPC) where a path can
be given; the journal's writes are refused by a stand-in ``os.write``."""

from __future__ import annotations

import errno
import os
import pickle

import pytest

from knapray.coordinator.store import COMMIT, Record, StateStore
from knapray.nofollow import open_nofollow
from knapray.worker.ledger_files import LocalLedger

FULL = "/dev/full"


def _one_line(error: BaseException, *needles: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def _refusing_write(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_the_ledger_journal_names_the_journal_and_the_operation(tmp_path, monkeypatch):
    from knapray.coordinator import store

    st = StateStore(str(tmp_path))
    st.open_segment(0)
    journal = str(tmp_path / "journal-000000000000.bin")
    monkeypatch.setattr(store.os, "write", _refusing_write)
    with pytest.raises(OSError) as e:
        st.append(Record(COMMIT, step=0, through=0))
    assert e.value.errno == errno.ENOSPC
    _one_line(e.value, f"appending to the ledger journal {journal}: No space left on device")
    # What a Ray worker hands the driver: the same line after a pickle round trip.
    _one_line(pickle.loads(pickle.dumps(e.value)), f"appending to the ledger journal {journal}")
    st.close()


def test_the_journal_of_a_run_without_a_coordinator_names_it_too(tmp_path, monkeypatch):
    """The torchrun launcher's ledger (rank 0 writes the journal itself)."""
    from knapray.coordinator import store

    ledger = LocalLedger.open(str(tmp_path), None)
    ledger.append(0, 0, [1, 2], [0, 1])
    monkeypatch.setattr(store.os, "write", _refusing_write)
    with pytest.raises(OSError) as e:
        ledger.append(1, 0, [3, 4], [0, 1])
    _one_line(e.value, "appending to the ledger journal ", str(tmp_path / "ledger"), "No space left on device")


@pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full here")
@pytest.mark.parametrize("mode, op", [("w", "writing"), ("a", "appending to"), ("wb", "writing")])
def test_a_write_through_open_nofollow_names_the_file_and_the_operation(mode, op):
    """metrics.jsonl, summary.json, the quarantine files, config.json: every run file is
    written through ``open_nofollow``; the error comes when the buffer is flushed."""
    with pytest.raises(OSError) as e:
        with open_nofollow(FULL, mode) as f:
            f.write(b"x" * 10 if "b" in mode else "x" * 10)
    assert e.value.errno == errno.ENOSPC
    _one_line(e.value, f"{op} {FULL}: No space left on device")


def test_the_kinds_callers_catch_stay_what_they_are(tmp_path):
    path = tmp_path / "there"
    path.write_text("x")
    with pytest.raises(FileExistsError) as e:
        open_nofollow(str(path), "x")
    _one_line(e.value, f"creating {path}")
    with pytest.raises(FileNotFoundError) as e:
        open_nofollow(str(tmp_path / "missing"), "r")
    _one_line(e.value, f"reading {tmp_path / 'missing'}")
    with open_nofollow(str(path), "a") as f:  # a file that takes writes is untouched by it all
        f.write("y")
    assert path.read_text() == "xy"
