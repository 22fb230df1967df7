"""Checkpoints: DCP round trip, load at another world size, atomic completion, and
nothing from a run directory executing code (planted metadata, planted pickled values)."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from dist_utils import run_distributed
from knapray.worker.checkpoint import (
    COMPLETE,
    Checkpointer,
    CheckpointError,
    JsonState,
    SafeLoadPlanner,
    training_parts,
)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def _trained(seed: int = 0):
    model, opt = _model(seed)
    for i in range(3):
        torch.manual_seed(100 + i)
        model(torch.randn(5, 6)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_restores_model_optimizer_and_trainer_state(tmp_path):
    model, opt = _trained()
    ck = Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(model, opt),
                      state=JsonState({"epoch": 2, "ledger": {"attempt": 1}}))
    ck.save(7, barrier=lambda: None)
    fresh, fresh_opt = _model(seed=1)
    state = JsonState()
    again = Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(fresh, fresh_opt), state=state)
    restored = again.load(again.latest())
    assert restored.step == 7 and restored.trainer["epoch"] == 2 and restored.trainer["ledger"] == {"attempt": 1}
    assert state.values == {"epoch": 2, "ledger": {"attempt": 1}, "step": 7}  # handed to the state
    assert _same(model, fresh)
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)
    # The optimizer continues exactly: one more identical step gives identical weights.
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.manual_seed(7)
        m(torch.randn(5, 6)).pow(2).sum().backward()
        o.step()
    assert _same(model, fresh)


def test_only_completed_checkpoints_count_and_old_ones_go(tmp_path):
    model, opt = _trained()
    ck = Checkpointer(str(tmp_path), rank=0, group=None, keep=2, parts=training_parts(model, opt),
                      state=JsonState({"epoch": 0}))
    for step in (1, 3, 5):
        ck.save(step, barrier=lambda: None)
    assert [os.path.basename(p) for p in ck.completed()] == ["step-000000003", "step-000000005"]
    os.remove(os.path.join(ck.latest(), COMPLETE))  # a save that never finished
    os.makedirs(tmp_path / "step-000000009.partial")
    assert os.path.basename(ck.latest()) == "step-000000003"


def test_planted_metadata_is_refused_in_one_line(tmp_path):
    model, opt = _trained()
    ck = Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(model, opt),
                      state=JsonState({"epoch": 0}))
    path = ck.save(1, barrier=lambda: None)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    fresh, fresh_opt = _model(1)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(fresh, fresh_opt)).load(path)
    assert not marker.exists()
    assert "\n" not in str(err.value) and "refused" in str(err.value) and path in str(err.value)


def test_planted_pickled_value_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"lr": Evil()}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}

    class Item:
        class dest_index:
            fqn = "optimizer.param_groups"

    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(Item, buf)
    assert not marker.exists()


def _save_on(rank: int, world: int, root: str):
    import torch.distributed as dist

    model, opt = _trained()
    ck = Checkpointer(root, rank=rank, group=dist.new_group(backend="gloo"), parts=training_parts(model, opt),
                      state=JsonState({"epoch": 0, "world_size": world}))
    ck.save(4, barrier=dist.barrier)
    return sorted(os.listdir(ck.latest()))


def _load_on(rank: int, world: int, root: str):
    import torch.distributed as dist

    model, opt = _model(seed=rank + 10)
    ck = Checkpointer(root, rank=rank, group=dist.new_group(backend="gloo"), parts=training_parts(model, opt))
    restored = ck.load(ck.latest())
    return restored.trainer["world_size"], {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.dist
def test_saved_by_two_ranks_loads_on_three(tmp_path):
    files = run_distributed(_save_on, 2, str(tmp_path))[0]
    assert "COMPLETE" in files and ".metadata" in files and "trainer.json" in files
    expected, _ = _trained()
    for saved_world, state in run_distributed(_load_on, 3, str(tmp_path)):
        assert saved_world == 2
        assert all(torch.equal(torch.tensor(state[k]), v) for k, v in expected.state_dict().items())


def test_the_checkpointer_owns_its_cadence(tmp_path):
    model, opt = _trained()
    ck = Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(model, opt), every=3)
    assert [s for s in range(10) if ck.should_save(s)] == [2, 5, 8]
    assert not ck.should_save(2, boundary=False)  # inside a gradient accumulation group
    never = Checkpointer(str(tmp_path), rank=0, group=None, parts=training_parts(model, opt), every=0)
    assert not any(never.should_save(s) for s in range(10))
    with pytest.raises(ValueError, match="missing \\['optimizer'\\]"):
        Checkpointer(str(tmp_path), rank=0, group=None, parts={"model": training_parts(model, opt)["model"]})


def test_an_extra_part_is_saved_and_restored_and_may_be_absent(tmp_path):
    """The EMA's path: any Stateful part goes through the checkpointer; a checkpoint
    written without it (an older run, no EMA) still loads, the part left as it was."""
    from knapray.worker.checkpoint import TensorsPart

    model, opt = _trained()
    shadow = {"w": torch.arange(6.0).reshape(2, 3)}
    Checkpointer(str(tmp_path / "a"), rank=0, group=None, parts=training_parts(model, opt, ema=TensorsPart(shadow)),
                 ).save(1, barrier=lambda: None)
    fresh, fresh_opt = _model(seed=3)
    target = {"w": torch.zeros(2, 3)}
    ck = Checkpointer(str(tmp_path / "a"), rank=0, group=None,
                      parts=training_parts(fresh, fresh_opt, ema=TensorsPart(target)))
    assert ck.load(ck.latest()).extra == ["ema"] and torch.equal(target["w"], shadow["w"])
    Checkpointer(str(tmp_path / "b"), rank=0, group=None, parts=training_parts(model, opt)).save(1, barrier=lambda: None)
    untouched = {"w": torch.full((2, 3), 7.0)}
    ck = Checkpointer(str(tmp_path / "b"), rank=0, group=None,
                      parts=training_parts(fresh, fresh_opt, ema=TensorsPart(untouched)))
    assert ck.load(ck.latest()).extra == [] and torch.equal(untouched["w"], torch.full((2, 3), 7.0))
    assert _same(model, fresh)
