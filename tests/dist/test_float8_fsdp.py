"""``parallel.fp8`` under FSDP2 on two gloo ranks: the weights gathered in float8
(``tensorwise``) or in bf16 (``rowwise``), the trainer's fused AdamW and its scales computed
after each optimizer step; a checkpoint taken and resumed continues exactly the run that
did not stop; the losses stay within float8's reach of the bf16 run's."""

from __future__ import annotations

import pytest

from dist_utils import build_tiny_corpus, local_trainer, run_distributed

pytestmark = pytest.mark.dist
pytest.importorskip("torchao.float8")

SETS = ["model.hidden_size=64", "model.num_heads=4", "model.rope_axes_dim=[4,6,6]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16", "balance.topology=g1n2",
        "parallel.fsdp=full", "parallel.precision=bf16", "checkpoint.every=2", "optim.lr=3e-3"]
LOSS_BOUND = 2e-2
"""Relative gap allowed between a float8 run's step losses and the bf16 run's (a few steps of
a tiny model; measured below 1e-3)."""


def _train(rank: int, world: int, corpus: str, runs: str, name: str, extra: list[str]) -> dict:
    from torch.distributed.tensor import DTensor

    trainer = local_trainer(rank, world, corpus, runs, name, [*SETS, *extra])
    float8 = sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())
    gathered_in_float8 = sum(type(p._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
                             for p in trainer.model.parameters() if isinstance(p, DTensor))
    summary = trainer.train()
    return {"losses": [r["loss"] for r in summary["records"]], "steps": summary["steps"], "float8": float8,
            "gathered_in_float8": gathered_in_float8}


def test_float8_under_fsdp_resumes_exactly_and_trains_as_bf16(tmp_path):
    """tensorwise (gathered in float8): bf16's run, the run straight, and stopped + resumed;
    rowwise (gathered in bf16, the same resume code): straight, against the same bf16 run."""
    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b4i64f1s0,g1b2i128f1s0", steps=4, shards=2, seed=7)
    runs = str(tmp_path / "runs")
    fp8 = ["parallel.fp8=true", "parallel.fp8_scaling=tensorwise"]
    bf16 = run_distributed(_train, 2, corpus, runs, "bf16", ["run.max_steps=4"])[0]
    straight = run_distributed(_train, 2, corpus, runs, "straight", [*fp8, "run.max_steps=4"])[0]
    first = run_distributed(_train, 2, corpus, runs, "stopped", [*fp8, "run.max_steps=2"])[0]
    resumed = run_distributed(_train, 2, corpus, runs, "stopped", [*fp8, "run.max_steps=4"])[0]
    rowwise = run_distributed(_train, 2, corpus, runs, "rowwise", ["parallel.fp8=true", "parallel.fp8_scaling=rowwise",
                                                                   "run.max_steps=4"])[0]

    assert straight["float8"] == rowwise["float8"] == 6 and bf16["float8"] == 0  # the image stream's 4, the single's 2
    assert (straight["gathered_in_float8"], rowwise["gathered_in_float8"]) == (6, 0)
    assert (first["steps"], resumed["steps"]) == (2, 4)
    assert first["losses"] + resumed["losses"] == straight["losses"]  # the checkpoint holds all of it
    print(f"\nfloat8 losses: tensorwise {[round(x, 5) for x in straight['losses']]}, rowwise "
          f"{[round(x, 5) for x in rowwise['losses']]}; bf16 {[round(x, 5) for x in bf16['losses']]}")
    for run in (straight, rowwise):
        for a, b in zip(run["losses"], bf16["losses"], strict=True):
            assert abs(a - b) <= LOSS_BOUND * abs(b), (run["losses"], bf16["losses"])
