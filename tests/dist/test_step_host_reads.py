"""The training step never waits for the device between two reads (issue 44, item 1).

A step's host numbers (token counts, whether the plan arrived) are agreed on the gloo
group; whether its loss and gradients were finite is summed over ranks on the device and
gates the fused optimizer there (``found_inf``); its loss, timing and Ray report are read
every ``metrics.log_every`` steps, in one collective, with every row of the steps between.

Checked on two gloo ranks under FSDP2 with the fused AdamW a GPU run gets: every call that
would read a device value back on a GPU (``Tensor.item/tolist/cpu/numpy``, Python's
``bool/float/int`` of a tensor, the step timer's wait, and the dispatcher's own host
synchronizations) is recorded with the step it ran in. On a CPU these cost nothing, so
they are counted by what the code asks for: none may happen in a step that does not read.
A huge latent makes one step non-finite: it is skipped on the device as the host path
skips it, and the run's rows, ledger and quarantine are those of ``log_every: 1``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from dist_utils import TINY_MMDIT, build_tiny_corpus, local_trainer, run_distributed
from knapray.corpus import shard_paths
from knapray.worker.ledger_files import read_ledger
from knapray.testing.host_watch import _where
from knapray.testing.step_watch import SYNC_OPS, _tensors, aten

pytestmark = pytest.mark.dist

READS = ("tolist", "cpu", "numpy", "__array__")
"""Reads that dispatch no op on a CPU tensor (``item``, ``bool``, ``float``, ``int`` do:
``_local_scalar_dense``, seen by the dispatch mode)."""
STEPS = 10
LOG_EVERY = 4
SETS = [*TINY_MMDIT, "balance.topology=g1n2", "parallel.fsdp=full", f"run.max_steps={STEPS}", "checkpoint.every=0",
        "optim.ema_decay=0.9", "data.epochs=2"]


class DeviceReads(TorchDispatchMode):
    """A CPU stand-in for the device: the step's device batch (``PackedBatch.to``, cloned so
    it is not the host batch) and the model's parameters are *device values*, and so is every
    op's output that any device value went into. Records, per training step, each read of a
    device value a GPU would wait for (``Tensor.item/tolist/cpu/numpy``, ``bool/float/int``
    of a tensor, ``nonzero`` and the other ops whose output size is data) and each wait for
    the step timer, with the knapray line that asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.device_values = WeakIdKeyDictionary()
        self.step: int | None = None
        self.by_step: dict[int, list[str]] = {}
        self._saved: list[tuple[object, str, object]] = []

    def tag(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        self.device_values[t.to_local() if isinstance(t, DTensor) else t] = True
        return t

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device_values

    def note(self, what: str) -> None:
        if self.step is not None:
            line = f"{what} at {_where()}"
            calls = self.by_step.setdefault(self.step, [])
            if line not in calls:
                calls.append(line)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        inputs = _tensors([*args, *kwargs.values()])
        from_device = any(self.is_device(t) for t in inputs)
        if from_device and func in SYNC_OPS:
            self.note(f"{func} ({SYNC_OPS[func]})")
        if from_device and func in (aten.index.Tensor, aten.index_put_.default) and any(
                t.dtype == torch.bool for t in _tensors(args[1])):
            self.note(f"{func} with a boolean mask")
        out = func(*args, **kwargs)
        if from_device:
            for t in _tensors(out) + (inputs if func.namespace in ("c10d", "_c10d_functional") else []):
                self.device_values[t] = True  # a collective's outputs are its (in-place) arguments
        return out

    def __enter__(self) -> "DeviceReads":
        from knapray.models.packing import PackedBatch
        from knapray.worker.timing import StepTimer

        to = PackedBatch.to

        def to_device(batch, device):
            moved = to(batch, device)
            for f in dataclasses.fields(moved):
                value = getattr(moved, f.name)
                if isinstance(value, torch.Tensor):
                    setattr(moved, f.name, self.tag(value.clone()))
            return moved

        def timer_result(timer):
            self.note("StepTimer.result (waits for the step's last event)")
            return saved_result(timer)

        saved_result = StepTimer.result
        self._saved += [(PackedBatch, "to", to), (StepTimer, "result", saved_result)]
        PackedBatch.to, StepTimer.result = to_device, timer_result
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, self._read(name, original))
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _read(self, name: str, original):
        @functools.wraps(original)
        def call(t, *args, **kwargs):
            if self.is_device(t):
                self.note(f"Tensor.{name}")
            return original(t, *args, **kwargs)

        return call

    def around(self, train_step):
        """``Trainer.train_step`` recording under this step's number."""

        @functools.wraps(train_step)
        def step(trainer, stream):
            self.step = trainer.step
            try:
                return train_step(trainer, stream)
            finally:
                self.step = None

        return step


def _plant_huge(corpus: str) -> int:
    path = shard_paths(corpus)[0]
    table = pq.read_table(path)
    latents = table.column("latent").to_pylist()
    latents[-1] = [3e38] + latents[-1][1:]
    col = pa.array(latents, type=table.schema.field("latent").type)
    pq.write_table(table.set_column(table.schema.get_field_index("latent"), "latent", col), path)
    return int(table.column("sample_id")[-1].as_py())


def _train(rank: int, world: int, corpus: str, runs: str, name: str, log_every: int, fused: bool) -> dict:
    import knapray.worker.trainer as trainer_module
    from knapray.worker.optim import build_optimizer

    trainer_module.build_optimizer = functools.partial(build_optimizer, fused=fused)  # what a GPU gets
    trainer = local_trainer(rank, world, corpus, runs, name, [*SETS, f"metrics.log_every={log_every}"])
    reads = DeviceReads()
    for p in trainer.model.parameters():
        reads.tag(p)
    trainer_module.Trainer.train_step = reads.around(trainer_module.Trainer.train_step)
    with reads:
        summary = trainer.train()
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
               for n, p in trainer.model.named_parameters()}  # numpy: tensors would travel by shared memory
    ema = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).numpy().copy() for n, t in trainer.ema.shadow.items()}
    return {"steps": summary["steps"], "reads": reads.by_step, "weights": weights, "ema": ema,
            "ema_updates": trainer.ema.num_updates, "run_dir": trainer.run_dir}


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_no_read_between_two_logging_steps_and_the_same_run_as_reading_every_step(tmp_path):
    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b4i64f1s0,g1b2i128f1s0", steps=6, shards=2, seed=7)
    bad_id = _plant_huge(corpus)
    runs = str(tmp_path / "runs")
    lazy = run_distributed(_train, 2, corpus, runs, "lazy", LOG_EVERY, True)
    every = run_distributed(_train, 2, corpus, runs, "every", 1, False)

    reading = {s for s in range(STEPS) if s % LOG_EVERY == 0} | {STEPS - 1}
    for rank, out in enumerate(lazy):
        assert out["steps"] == STEPS
        stalls = {s: calls for s, calls in out["reads"].items() if s not in reading and calls}
        assert not stalls, f"rank {rank} read device values between two reads: {stalls}"
        # ... and the reads do happen where they should (the watch is not blind).
        assert any("StepTimer.result" in c for c in out["reads"][LOG_EVERY]), out["reads"][LOG_EVERY]
        assert any("_local_scalar_dense" in c or "Tensor.tolist" in c or "Tensor.cpu" in c
                   for c in out["reads"][LOG_EVERY]), out["reads"][LOG_EVERY]
    # The host-reading path (foreach AdamW, a read every step) does read every step.
    assert all(every[0]["reads"].get(s) for s in range(STEPS))

    # The same run: every metrics row, the same losses, the same non-finite step skipped and
    # quarantined, the same weights and EMA (fused and foreach AdamW agree to rounding).
    lazy_rows, every_rows = (_rows(os.path.join(o[0]["run_dir"], "metrics.jsonl")) for o in (lazy, every))
    assert [r["step"] for r in lazy_rows] == [r["step"] for r in every_rows] == list(range(STEPS))
    assert [bool(r.get("nonfinite")) for r in lazy_rows] == [bool(r.get("nonfinite")) for r in every_rows]
    assert sum(bool(r.get("nonfinite")) for r in lazy_rows) == 1
    for a, b in zip(lazy_rows, every_rows):
        if not a.get("nonfinite"):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["tokens"] == b["tokens"]
    for name, w in every[0]["weights"].items():
        np.testing.assert_allclose(lazy[0]["weights"][name], w, rtol=1e-4, atol=1e-6, err_msg=name)
        assert np.isfinite(lazy[0]["weights"][name]).all(), name
    for name, w in every[0]["ema"].items():
        np.testing.assert_allclose(lazy[0]["ema"][name], w, rtol=1e-4, atol=1e-6, err_msg=name)
    assert lazy[0]["ema_updates"] == every[0]["ema_updates"] == STEPS - 1  # the skipped one not counted
    (lazy_cols, every_cols) = (read_ledger(o[0]["run_dir"]).columns() for o in (lazy, every))
    for col in ("step", "sample_id", "epoch"):
        assert lazy_cols[col].tolist() == every_cols[col].tolist(), col
    assert sorted(set(lazy_cols["step"].tolist())) == list(range(STEPS))
    for epoch in (0, 1):  # each sample once an epoch (the second one cut by run.max_steps)
        ids = lazy_cols["sample_id"][lazy_cols["epoch"] == epoch].tolist()
        assert len(ids) == len(set(ids)) and ids, epoch
    quarantined = [q for rank in range(2) if os.path.exists(p := os.path.join(lazy[0]["run_dir"],
                                                                                  f"quarantine-rank{rank}.jsonl"))
                   for q in _rows(p)]
    assert {q["sample_id"]: q["reason"] for q in quarantined}.get(bad_id) == "non_finite_loss", quarantined
