"""Planted checkpoint files: every known shape of pickle payload is refused in one line
naming the file, and nothing it names ever runs (a marker file it would create stays
absent). The payloads are written into a real checkpoint's ``.metadata``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_md

from knapray.worker.checkpoint import CheckpointError, Checkpointer, JsonState, TensorsPart, check_checkpoint, training_parts
from knapray.worker.safe_dcp import MAX_METADATA_BYTES, read_metadata

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE of ``text``."""
    b = text.encode()
    return (b"\x8c" + bytes([len(b)]) if len(b) < 256 else b"X" + len(b).to_bytes(4, "little")) + b


def _global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"  # STACK_GLOBAL


def _call(module: str, name: str, *args: str) -> bytes:
    """module.name(*args) as pickle opcodes (REDUCE)."""
    return _global(module, name) + b"(" + b"".join(_s(a) for a in args) + b"tR"


def _program(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint directory (model + AdamW + an EMA dict), saved once."""
    root = tmp_path_factory.mktemp("ck")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    parts = training_parts(model, opt, ema=TensorsPart({"w": torch.zeros(3, dtype=torch.bfloat16)}))
    path = Checkpointer(str(root), rank=0, group=None, parts=parts,
                        state=JsonState({"epoch": 0, "world_size": 1, "topology": "g1n1", "ledger": None}),
                        ).save(3, barrier=lambda: None)
    return path


@pytest.fixture
def planted(checkpoint, tmp_path):
    """A copy of the checkpoint, the path of a marker file, and a way to plant a .metadata."""
    path = str(tmp_path / "step-000000003")
    shutil.copytree(checkpoint, path)
    marker = str(tmp_path / "marker")

    def plant(data: bytes) -> str:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(data)
        return path

    return path, marker, plant


def _refused(path: str, marker: str, *needles: str) -> str:
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(path)
    msg = str(err.value)
    assert "\n" not in msg and os.path.join(path, ".metadata") in msg, msg
    assert not os.path.exists(marker), "the planted payload ran"
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_the_real_metadata_reads(checkpoint):
    md = read_metadata(os.path.join(checkpoint, ".metadata"))
    assert {"model.0.weight", "ema.w"} <= set(md.state_dict_metadata)
    assert check_checkpoint(checkpoint)["step"] == 3


# Each payload creates the marker file (io.FileIO(path, "w") creates it; os.system runs a
# shell) if anything it names is called. FileIO is a class reachable by a dotted name from
# DCP's own modules, which an allowlist of "classes under torch.distributed.checkpoint"
# admitted.
PAYLOADS = {
    "dotted name walking from an allowed module": lambda m: _call(_FS, "io.FileIO", m, "w"),
    "dotted name to a function": lambda m: _call(_MD, "torch.os.system", f"touch {m}"),
    "plain global": lambda m: _call("posix", "system", f"touch {m}"),
    "builtins eval": lambda m: _call("builtins", "eval", f"open({m!r}, 'w')"),
    "global nested in an allowed class's arguments": lambda m: (
        _global(_MD, "Metadata") + b"(" + _call(_FS, "io.FileIO", m, "w") + b"tR"),
    "allowed class's module attribute": lambda m: _call(_MD, "os.system", f"touch {m}"),
    "BUILD installing __setstate__ on an allowed object": lambda m: (
        _global(_MD, "StorageMeta") + b")\x81"  # NEWOBJ: StorageMeta.__new__(StorageMeta)
        + b"}" + _s("__setstate__") + _global(_FS, "io.FileIO") + b"sb"  # BUILD: obj.__dict__ |= {...}
        + _s(m) + b"b"),  # BUILD again: obj.__setstate__(m)
    "persistent id": lambda m: _s(m) + b"Q",
    "extension code": lambda m: b"\x82\x01",
}


@pytest.mark.parametrize("shape", list(PAYLOADS))
def test_planted_payload_never_runs(planted, shape):
    path, marker, plant = planted
    plant(_program(PAYLOADS[shape](marker)))
    _refused(path, marker, "refused")


def test_the_dotted_payload_would_run_unguarded(tmp_path):
    """The payloads are live: plain pickle runs them (so the tests above test something)."""
    marker = str(tmp_path / "marker")
    pickle.loads(_program(PAYLOADS["dotted name walking from an allowed module"](marker)))
    assert os.path.exists(marker)


def _metadata(path: str):
    return read_metadata(os.path.join(path, ".metadata"))


def _mutated(planted, change) -> str:
    path, marker, plant = planted
    md = _metadata(path)
    change(md)
    plant(pickle.dumps(md, protocol=4))
    return _refused(path, marker)


def test_an_extra_attribute_on_an_allowed_object_is_refused(planted):
    # Refused as it is being set (BUILD), before the object exists to be checked as data.
    assert "it sets Metadata's ['__setstate__']" in _mutated(planted, lambda md: setattr(md, "__setstate__", 1))


def test_an_extra_field_on_an_allowed_object_is_refused_as_data(planted):
    assert "has attributes ['extra']" in _mutated(planted, lambda md: setattr(md, "extra", 1))


def test_storage_outside_the_checkpoint_directory_is_refused(planted):
    def escape(md):
        info = next(iter(md.storage_data.values()))
        info.relative_path = "../../etc/passwd"

    assert "not a file of the checkpoint directory" in _mutated(planted, escape)


def test_a_byte_range_past_the_end_of_its_file_is_refused(planted):
    def past(md):
        next(iter(md.storage_data.values())).length = 1 << 40

    assert "length" in _mutated(planted, past)


def test_a_huge_tensor_size_is_refused_before_anything_is_allocated(planted):
    def huge(md):
        md.state_dict_metadata["model.0.weight"].size = torch.Size([1 << 30, 1 << 30, 1 << 30])

    assert "elements" in _mutated(planted, huge)


def test_a_chunk_outside_its_tensor_is_refused(planted):
    def outside(md):
        chunk = md.state_dict_metadata["model.0.weight"].chunks[0]
        chunk.offsets = torch.Size([3, 0])

    assert "lies outside" in _mutated(planted, outside)


def test_an_oversized_metadata_file_is_refused_unread(planted):
    path, marker, _ = planted
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk used
    assert "bytes" in _refused(path, marker)


def test_garbage_and_a_truncated_pickle_are_one_line(planted, checkpoint):
    path, marker, plant = planted
    plant(b"\x00garbage")
    _refused(path, marker, "not readable")
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        real = f.read()
    plant(real[: len(real) // 2])
    _refused(path, marker, "not readable")


def test_a_planted_trainer_json_is_one_line(planted):
    path, marker, _ = planted
    with open(os.path.join(path, "trainer.json"), "w") as f:
        f.write('{"step": "3"}')
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(path)
    assert "\n" not in str(err.value) and "trainer.json" in str(err.value) and "step" in str(err.value)


TRAINER_BASE = {"step": 9, "epoch": 2, "world_size": 4, "topology": "g1n4", "ledger": None}


def _read_back(path: str, key: str, good, bad, refusal: str) -> None:
    """trainer.json with each of ``good`` as ``key`` reads back as written; each of ``bad``
    is one line matching ``refusal``."""
    from knapray.worker.checkpoint import RUN_STATE, read_trainer_state

    for value in (*good, *bad):
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump({**TRAINER_BASE, key: value}, f)
        if any(value is g for g in good):
            assert read_trainer_state(path, RUN_STATE)[key] == value
            continue
        with pytest.raises(CheckpointError, match=refusal) as err:
            read_trainer_state(path, RUN_STATE)
        assert "\n" not in str(err.value)


def test_a_ledger_position_is_checked_as_data(planted):
    """Both ledger positions a trainer.json holds are accepted (rank 0's, and a
    coordinator's with its epoch state), anything else in them is one line."""
    path, _, _ = planted
    position = {"ledger_id": 1 << 61, "records": 10, "committed_step": 9, "attempt": 0}
    coordinator = {"version": 2, **position, "epoch": 2, "epoch_ends": {"0": 5, "1": 10}}
    bad = [{**position, "records": "10"}, {**coordinator, "epoch_ends": {"0": "os.system"}},
           {**coordinator, "epoch_ends": {"one": 5}}, {**position, "planted": 1}, [1, 2]]
    _read_back(path, "ledger", (None, position, coordinator), bad, "not a ledger position")


def test_carried_ledger_rows_are_checked_as_data(planted):
    """The rows a checkpoint carries for the coordinator (``ledger_rows``) are read as data:
    well-formed ones come back as they are, anything else is one line naming the file; an
    oversized trainer.json is refused before it is parsed."""
    path, _, _ = planted
    from knapray.worker import checkpoint
    from knapray.worker.checkpoint import RUN_STATE, read_trainer_state

    good = [{"step": 8, "epoch": 2, "sample_ids": [5, -1], "home_ranks": [0, 3]},
            {"step": 9, "epoch": 2, "sample_ids": [6], "home_ranks": [1], "expert": 1}]
    bad = ["rows", [{"step": 8, "epoch": 2, "sample_ids": [5], "home_ranks": [0, 1]}],
           [{"step": 8, "epoch": 2, "sample_ids": [5], "home_ranks": [0], "expert": 256}],
           [{"step": 8, "epoch": 2, "sample_ids": [5], "home_ranks": [0], "expert": "1"}],
           [{"step": -1, "epoch": 2, "sample_ids": [], "home_ranks": []}],
           [{"step": 8, "epoch": 2, "sample_ids": ["os.system"], "home_ranks": [0]}],
           [{"step": 8, "epoch": 2, "sample_ids": [1], "home_ranks": [0], "call": "eval"}]]
    _read_back(path, "ledger_rows", ([], good), bad, "ledger_rows is not a list of")
    with open(os.path.join(path, "trainer.json"), "w") as f:
        json.dump({**TRAINER_BASE, "ledger_rows": good * 50}, f)
    limit = checkpoint.TRAINER_STATE_MAX_BYTES
    try:
        checkpoint.TRAINER_STATE_MAX_BYTES = 1000
        with pytest.raises(CheckpointError, match="is over 1000 bytes, more than any checkpoint file"):
            read_trainer_state(path, RUN_STATE)
    finally:
        checkpoint.TRAINER_STATE_MAX_BYTES = limit


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the planted library")
def test_planted_shared_library_is_never_opened(planted, tmp_path):
    """The reported exploit: ctypes.CDLL reached by a dotted name opens a planted .so, whose
    constructor runs."""
    path, marker, plant = planted
    src, lib = tmp_path / "evil.c", tmp_path / "evil.so"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    plant(_program(_call(_MD, "torch.ctypes.CDLL", str(lib))))
    _refused(path, marker, "refused")
    # and the library is live: loading it unguarded does create the marker
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"], check=True)
    assert os.path.exists(marker)


def _planted_run(tmp_path, checkpoint) -> tuple[list[str], str, str]:
    """A run directory whose newest checkpoint's metadata is a payload: (the `knapray train`
    arguments that resume it, the run directory, the marker the payload would create)."""
    from dist_utils import build_tiny_corpus
    from knapray.driver.preflight import load_run_config
    from knapray.driver.run_dir import resolve_paths, write_config

    corpus = build_tiny_corpus(tmp_path / "corpus", "g2b2i64f1s0", steps=2, shards=1)
    args = ["--config", "jobs/configs/demo.yaml", "--set", f"data.corpus={corpus}",
            "--set", f"run.storage={tmp_path / 'runs'}", "--set", "run.name=planted"]
    sets = [a for a in args[2:] if a != "--set"]
    cfg = resolve_paths(load_run_config("jobs/configs/demo.yaml", sets))
    write_config(cfg)
    path = os.path.join(cfg.run_dir, "checkpoints", "step-000000003")
    shutil.copytree(checkpoint, path)
    marker = str(tmp_path / "marker")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(_program(PAYLOADS["dotted name walking from an allowed module"](marker)))
    return args, cfg.run_dir, marker


def test_train_refuses_a_planted_checkpoint_before_any_worker_starts(tmp_path, checkpoint):
    args, run_dir, marker = _planted_run(tmp_path, checkpoint)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "knapray.cli", "train", *args], cwd=repo, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and ".metadata refused" in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert "Ray" not in p.stdout  # pre-flight: Ray never started
    assert not os.path.exists(marker)


def test_sample_refuses_a_planted_checkpoint(tmp_path, checkpoint):
    import argparse

    from knapray.commands.sample import plan_sampling

    _, run_dir, marker = _planted_run(tmp_path, checkpoint)
    args = argparse.Namespace(run=run_dir, checkpoint=None, size=None, caption=None, like=[0], frames=1)
    with pytest.raises(CheckpointError, match="refused"):
        plan_sampling(args)
    assert not os.path.exists(marker)


def test_a_build_aimed_at_a_class_is_refused_before_it_changes_anything(planted):
    """GLOBAL Metadata, then BUILD with {'__reduce_ex__': ...}: pickle's default BUILD would
    set the class attribute in this process before any check of the result."""
    path, marker, plant = planted
    before = vars(dcp_md.Metadata).get("__reduce_ex__")
    plant(_program(_global(_MD, "Metadata") + b"}" + _s("__reduce_ex__") + _s("x") + b"sb"))
    start = time.perf_counter()
    msg = _refused(path, marker, "Metadata")
    assert time.perf_counter() - start < 1.0
    assert vars(dcp_md.Metadata).get("__reduce_ex__") is before, "the class was changed by the file"
    assert "never does" in msg


def _nested_shared(levels: int, width: int):
    leaf: list = []
    for _ in range(levels):
        leaf = [leaf] * width
    return leaf


def test_shared_references_are_bounded_in_one_second(planted):
    """64 references to one list, 12 levels deep: a 92 KB file standing for 64^12 lists."""
    path, marker, plant = planted
    md = _metadata(path)
    md.planner_data = _nested_shared(12, 64)
    data = pickle.dumps(md, protocol=4)
    assert len(data) < 200_000
    plant(data)
    start = time.perf_counter()
    msg = _refused(path, marker, "planner_data", "expanded")
    assert time.perf_counter() - start < 1.0, msg


@pytest.mark.parametrize("limit, body, needle", [
    ("MAX_PICKLE_DEPTH", lambda n: b"(" * (n + 1), "nests containers"),
    ("MAX_PICKLE_REFS", lambda n: b"N\x94" + b"h\x000" * (n + 1), "refers back"),
    ("MAX_PICKLE_OPS", lambda n: b"N0" * (n // 2 + 1), "more than"),
])
def test_each_pickle_bound_is_one_line(planted, monkeypatch, limit, body, needle):
    """Every bound of knapray.limits the unpickler enforces, reached by a planted file (the
    bounds lowered so the files stay small)."""
    from knapray.worker import safe_dcp

    monkeypatch.setattr(safe_dcp, limit, 1000)
    path, marker, plant = planted
    plant(_program(body(1000) + b"N"))
    _refused(path, marker, needle)
