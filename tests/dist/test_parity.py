"""Balanced execution computes the same function: outputs and every parameter gradient
of the MMDiT match a single-process reference, for every topology, unbalanced too."""

from __future__ import annotations

import json

import pytest

from knapray.cli import main
from knapray.testing.parity import passed, run_parity

TOPOLOGIES = ["g1n4", "g2n2", "g4n1", "g1n2+g2n1", "g2n2/overlap", "g4n1/overlap"]
"""``/overlap``: every other sequence whole on a rank that also computes a share of its bag's
(groups that overlap on that rank; ``knapray.testing.parity.overlapped``)."""
# Rank 1 holds nothing; i64 images at scale 4 are one visual token plus 0-3 text tokens,
# so several sequences are shorter than a bag of 2 or 4; long ones split into chunks
# whose later parts hold no text.
MIX = "g1b2i256f1s0,g1b1i512f1s0,g1b4i64f1s0,g1b1i128f2s0"


@pytest.mark.dist
def test_balanced_mmdit_matches_single_process_reference():
    report = run_parity(4, TOPOLOGIES, MIX, scale=4, seed=5, max_text_tokens=12, empty_ranks=(1,))
    for case in TOPOLOGIES + ["unbalanced"]:
        r = report[case]
        assert r["num_params"] > 30
        assert r["out_rel"] <= 1e-5, (case, r)
        assert r["loss_rel"] <= 1e-5, (case, r)
        assert r["grad_rel_max"] <= 1e-5, (case, r["worst_param"], r["grad_rel_max"])
        assert r["ranks_without_sequences"] == 1
    # The cases the check must exercise did occur.
    assert report["g4n1"]["sequences_shorter_than_bag"] > 0
    assert report["g2n2"]["sequences_shorter_than_bag"] > 0
    assert all(report[c]["chunks_without_text"] > 0 for c in ("g2n2", "g4n1", "g1n2+g2n1"))
    # Overlapping groups: sequences whole on ranks of bags of several, and ranks that ran
    # their own beside their share of the bag's.
    for case in ("g2n2/overlap", "g4n1/overlap"):
        assert report[case]["whole_on_shared_ranks"] > 0 and report[case]["ranks_running_both"] > 0, report[case]
        assert report[case.removesuffix("/overlap")]["whole_on_shared_ranks"] == 0
    # Balancing did balance (the same function, computed on other ranks).
    assert report["g4n1"]["imbalance"] < report["unbalanced"]["imbalance"]
    assert report["g1n4"]["moved_token_fraction"] > 0
    assert passed(report)


def test_parity_cli_rejects_bad_setups(capsys):
    assert main(["parity", "--world-size", "4", "--topology", "g8n1"]) == 2
    assert "not a positive multiple of 8" in capsys.readouterr().err
    assert main(["parity", "--world-size", "4", "--topology", "g2n2", "--heads", "3"]) == 2
    assert "3 attention heads cannot be split over a bag of 2" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_parity_cli_runs_fsdp_and_checkpointing(capsys, ac):
    """Ulysses bags of 2 under FSDP with checkpointing; ``selective`` keeps the attention
    kernels' outputs while the all-to-alls around them are recomputed."""
    rc = main(["parity", "--world-size", "4", "--topology", "g2n2", "--mix", MIX, "--scale", "4", "--seed", "3",
               "--max-text-tokens", "12", "--fsdp", "full", "--ac", ac, "--empty-ranks", "1",
               "--textless-ranks", "2", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["_meta"]["passed"]
    meta = report["_meta"]
    assert (meta["fsdp"], meta["activation_checkpointing"], meta["compile"]) == ("full", ac, False)
    for case in ("g2n2", "unbalanced"):
        assert report[case]["grad_norm_rel"] <= 1e-5
        assert report[case]["ranks_without_sequences"] == 1 and report[case]["ranks_without_text"] >= 1


def test_parity_cli_rejects_bad_parallelism(capsys):
    assert main(["parity", "--world-size", "4", "--topology", "g2n2", "--fsdp", "hybrid"]) == 2
    assert "fsdp hybrid shards within a node: it needs gpus_per_node" in capsys.readouterr().err
    assert main(["parity", "--world-size", "4", "--topology", "g2n2", "--fsdp", "hybrid",
                 "--gpus-per-node", "3"]) == 2
    assert "world size 4 is not a multiple of gpus_per_node=3" in capsys.readouterr().err
    assert main(["parity", "--world-size", "4", "--topology", "g2n2", "--textless-ranks", "4"]) == 2
    assert "textless_ranks [4] are not ranks of a world of 4" in capsys.readouterr().err
