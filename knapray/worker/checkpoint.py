"""Checkpoints in the run directory: the run's ``Stateful`` parts (model, optimizer, EMA)
with torch.distributed.checkpoint (DCP), the trainer's own state as JSON, written
atomically, loadable at another world size. The ``Checkpointer`` is handed the parts once
and owns the cadence (``should_save``): the trainer asks it after each step.

Layout: ``<run dir>/checkpoints/step-000000123/`` holds DCP's files (one data file per
writing rank, ``.metadata``), ``trainer.json`` (step, epoch, world size, topology, the
ledger position) and ``COMPLETE``, written last. A save goes to ``step-....partial`` and
is renamed when every rank has written its part; only directories with ``COMPLETE`` are
resumed from, so a save cut short by a crash is never read.

DCP saves each tensor's shards once (replicated tensors from one rank, FSDP shards from
their owners) and reshards on load, so a run saved by 4 ranks resumes on 3 (the elastic
restart path), sharded or not.

Nothing read from a run directory can execute code: DCP reads tensors with
``torch.load(weights_only=True)``, but its default planner unpickles non-tensor values
(the optimizer's param groups) with an unrestricted torch.load and its ``.metadata`` with plain
pickle; here the metadata goes through ``safe_dcp`` (an exact list of classes, then
checked as data, before any tensor is read: ``check_checkpoint``, which pre-flight also
runs), and non-tensor values through ``torch.load(weights_only=True)``
(``SafeLoadPlanner``). ``trainer.json`` is JSON with its fields checked.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from knapray.files import read_json
from knapray.limits import MAX_EPOCHS, MAX_STEPS, MAX_WORLD_SIZE
from knapray.nofollow import open_nofollow

from knapray.worker.safe_dcp import UnsafeMetadata, read_metadata

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer.json"
PARTIAL = ".partial"

# ---- safe reading of DCP's metadata ------------------------------------------------------


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``safe_dcp.read_metadata``: exact
    allowed classes, checked as data, storage entries inside the checkpoint directory."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        rank = kwargs.get("rank")
        filename = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = _read_metadata(os.path.join(self.path, filename))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_metadata(path: str) -> dcp.Metadata:
    try:
        return read_metadata(path)
    except UnsafeMetadata as e:
        raise CheckpointError(f"checkpoint metadata {path} refused: {e} (a planted or foreign file?)") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint metadata {path} cannot be read: {e.strerror or e}") from None


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``
    (plain numbers, strings, lists, dicts, tuples: what optimizer param groups hold)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def saved_keys(path: str) -> list[str]:
    """Flattened names of everything a checkpoint holds (``model.img_in.weight``, ...)."""
    return list(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def safe_load(state: dict, path: str, group: dist.ProcessGroup | None = None) -> None:
    """``dcp.load`` of ``path`` into ``state`` in place, with nothing unpickled unsafely."""
    with warnings.catch_warnings():  # a single process without a process group is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), process_group=group)


# ---- the checkpointer ---------------------------------------------------------------------


def completed_checkpoints(root: str) -> list[str]:
    """Marked checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step-") and not n.endswith(PARTIAL))
    return [os.path.join(root, n) for n in names if os.path.exists(os.path.join(root, n, COMPLETE))]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names it and why, in one line."""


class StorageFull(OSError):
    """The run's storage filled up while a checkpoint was written: one line saying "no space
    left on <path>" (an environment failure, not bad input)."""


NO_SPACE_MARGIN = 1 << 20
"""Free bytes below which a failed write is taken for a full disk (DCP's zip writer reports
ENOSPC as ``unexpected pos``, without an errno)."""


def no_space(error: BaseException, path: str, needed: int = 0) -> StorageFull | None:
    """``StorageFull`` naming ``path`` if ``error`` (a failed write under ``path``) came from a
    full disk: ENOSPC anywhere in its chain or text, or less free space left than
    ``needed`` bytes (what the write was to add) or ``NO_SPACE_MARGIN``; else None."""
    chain, seen = [], error
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    full = any(getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) for e in chain)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    if not full and (free is None or free >= max(needed, NO_SPACE_MARGIN)):
        return None
    left = "" if free is None else f" ({free} bytes free)"
    return StorageFull(errno.ENOSPC, f"no space left on {path}{left}: free space there (older runs, "
                       "checkpoints), or give the run more storage, then run the same command again to resume")


_INT64 = (-(1 << 63), (1 << 63) - 1)
_COUNT = (0, (1 << 63) - 1)
_TRAINER_FIELDS = {"step": (0, MAX_STEPS), "epoch": (0, MAX_EPOCHS), "world_size": (1, MAX_WORLD_SIZE),
                   "topology": 1024}
"""Every field of ``trainer.json``: an int in [lo, hi], or (topology) a topology spec of at most that many characters."""
_LEDGER_POSITION = {"ledger_id": _COUNT, "records": _COUNT, "committed_step": (-1, MAX_STEPS),
                    "attempt": (0, (1 << 31) - 1)}


RUN_STATE = ("step", "epoch", "world_size", "topology", "ledger")
"""What the trainer keeps in ``trainer.json`` (and requires on resume); ``ledger`` may be null.
``ledger_rows`` (optional, checked where present): rows of locally planned steps the
coordinator had not taken when the checkpoint was written, which the resume hands over."""

TRAINER_STATE_MAX_BYTES = 1 << 28
"""``trainer.json`` is a few numbers, plus the rows of steps planned while the coordinator
was away (a long outage at a large world: megabytes); anything longer is refused."""


def read_trainer_state(path: str, required: tuple[str, ...] = ("step",)) -> dict:
    """A checkpoint's ``trainer.json``, its fields checked: step, and where present (every
    one of ``required``) epoch, world size and topology of the run that wrote it; with
    ``ledger`` required, the ledger position too (a dict of ints, or null). Every number is
    range-checked (a step within ``MAX_STEPS``, a world within ``MAX_WORLD_SIZE``, ledger
    counts within int64...); a refusal names the file and the field, never what it holds.
    A symbolic link there is refused, its target never opened."""
    file = os.path.join(path, TRAINER_STATE)
    trainer = read_json(file, TRAINER_STATE_MAX_BYTES, "checkpoint file", CheckpointError, follow_links=False)
    for name, rule in _TRAINER_FIELDS.items():
        if name not in required and name not in trainer:
            continue
        value = trainer.get(name)
        if isinstance(rule, int):
            if not (type(value) is str and 0 < len(value) <= rule and _is_topology(value)):
                raise CheckpointError(f"checkpoint file {file}: {name} is {_kind(value)}, not a topology spec "
                                      "(e.g. g8n4, g1n2+g2n1)")
        elif not _int_in(value, rule):
            what = f"an int outside [{rule[0]}, {rule[1]}]" if type(value) is int else \
                f"{_kind(value)}, not an int in [{rule[0]}, {rule[1]}]"
            raise CheckpointError(f"checkpoint file {file}: {name} is {what}")
    ledger = trainer.get("ledger") if "ledger" in required else None
    if ledger is not None and not _is_ledger_position(ledger):
        raise CheckpointError(f"checkpoint file {file}: ledger is not a ledger position (ints {', '.join(_LEDGER_POSITION)} "
                              f"in range; with a coordinator also ints {', '.join(_COORDINATOR_INTS)} and epoch_ends, "
                              "epoch -> step)")
    rows = trainer.get("ledger_rows")
    if rows is not None and not _are_ledger_rows(rows):
        raise CheckpointError(f"checkpoint file {file}: ledger_rows is not a list of {{step, epoch, sample_ids, "
                              "home_ranks, expert}} (a step and an epoch in range, two lists of one length: int64 ids, "
                              "ranks of a world; expert optional, in [0, 255])")
    return trainer


def _is_topology(spec: str) -> bool:
    from knapray.planning import Topology

    try:
        Topology.parse(spec)
    except ValueError:
        return False
    return True


def _int_in(value: object, bounds: tuple[int, int]) -> bool:
    return type(value) is int and bounds[0] <= value <= bounds[1]


def _kind(value: object) -> str:
    """What a value read from a file is, without its content: "an int", "a str", "null"."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _are_ledger_rows(rows: object) -> bool:
    """``ledger_rows`` as ``StepPlanner.settle`` writes them: data only, every number in range."""
    return isinstance(rows, list) and all(
        isinstance(r, dict) and set(r) - {"expert"} == {"step", "epoch", "sample_ids", "home_ranks"}
        and _int_in(r["step"], _TRAINER_FIELDS["step"]) and _int_in(r["epoch"], _TRAINER_FIELDS["epoch"])
        and _int_in(r.get("expert", 0), (0, 255))
        and isinstance(r["sample_ids"], list) and isinstance(r["home_ranks"], list)
        and len(r["sample_ids"]) == len(r["home_ranks"])
        and all(_int_in(i, _INT64) for i in r["sample_ids"])
        and all(_int_in(h, (0, MAX_WORLD_SIZE - 1)) for h in r["home_ranks"])
        for r in rows)


_COORDINATOR_INTS = {"version": (0, 1 << 20), "epoch": (0, MAX_EPOCHS)}
"""What a coordinator's ``state_dict`` adds to the ledger position (``epoch_ends`` besides)."""


def _is_ledger_position(ledger: object) -> bool:
    """A ledger position as ``Ledger.position`` writes it (rank 0's local ledger), or as the
    coordinator's ``state_dict`` does: the position plus its epoch state. Data only: every
    value an int in its range, ``epoch_ends`` a map of epoch numbers (as JSON keys) to steps."""
    if not isinstance(ledger, dict) or not all(_int_in(ledger.get(k), r) for k, r in _LEDGER_POSITION.items()):
        return False
    for key, value in ledger.items():
        if key == "epoch_ends":
            if not (isinstance(value, dict) and len(value) <= 1 << 20 and all(
                    isinstance(e, str) and e.isdigit() and len(e) <= 7 and int(e) <= MAX_EPOCHS
                    and _int_in(t, (-1, MAX_STEPS)) for e, t in value.items())):
                return False
        elif key in _COORDINATOR_INTS:
            if not _int_in(value, _COORDINATOR_INTS[key]):
                return False
        elif key not in _LEDGER_POSITION:
            return False
    return True


def check_checkpoint(path: str, required: tuple[str, ...] = ("step",)) -> dict:
    """Everything a resume reads from checkpoint ``path`` before it loads tensors: its
    ``trainer.json`` and its DCP metadata, checked without running anything a planted file
    names. Returns the trainer state; raises ``CheckpointError`` (one line naming the file)."""
    trainer = read_trainer_state(path, required)
    _read_metadata(os.path.join(path, ".metadata"))
    return trainer


@dataclass(frozen=True)
class Restored:
    """What a resumed run learns from its checkpoint."""

    path: str
    trainer: dict
    """``trainer.json``: step (the last step the checkpoint covers), epoch, world_size, ..."""
    extra: list[str] = field(default_factory=list)
    """Names of the ``extra`` state dicts the checkpoint had (and that were loaded)."""

    @property
    def step(self) -> int:
        return int(self.trainer["step"])


class ModelPart(Stateful):
    """The model's parameters as a checkpoint part (DCP's sharding-aware state dict: FSDP
    shards saved by their owners, loaded at any world size)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from knapray.models.lora import has_adapters

        self.model = model
        self.adapters_only = has_adapters(model)
        """A LoRA model: only the adapters (the trained parameters) are saved and loaded; the
        base comes from ``model.pretrained`` (the trainer records its fingerprint)."""

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=self.adapters_only))

    def load_state_dict(self, state: dict) -> None:
        if self.adapters_only:
            from knapray.models.lora import is_adapter

            missing = [n for n, p in self.model.named_parameters() if is_adapter(n) and n not in state]
            if missing:
                raise CheckpointError(f"the checkpoint holds no adapter {missing[0]!r}: it was not written by a "
                                      "LoRA run of this model.lora")
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.adapters_only))


class OptimizerPart(Stateful):
    """The optimizer's state (AdamW moments and steps, keyed by parameter name)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class JsonState(Stateful):
    """A plain dict as a checkpoint's JSON state (``trainer.json``), for tools and tests; a
    run's trainer is its own."""

    def __init__(self, values: dict | None = None) -> None:
        self.values = dict(values or {})

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


class TensorsPart(Stateful):
    """A dict of tensors as a checkpoint part, loaded in place (e.g. an EMA's shadows)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            if value is not self.tensors[name]:
                self.tensors[name].copy_(value)


REQUIRED_PARTS = ("model", "optimizer")
"""Parts every checkpoint has; others (``ema``) are loaded when the checkpoint has them."""


def training_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **more: Stateful | None
                   ) -> dict[str, Stateful]:
    """The parts a run checkpoints: model, optimizer, and each of ``more`` given (e.g.
    ``ema=...``; None leaves it out)."""
    return {"model": ModelPart(model), "optimizer": OptimizerPart(model, optimizer),
            **{name: part for name, part in more.items() if part is not None}}


class Checkpointer:
    """Saves and restores a run's parts under ``<run dir>/checkpoints``.

    ``parts``: name -> ``Stateful`` whose ``state_dict`` is tensors (DCP saves it under the
    name); ``state``: the trainer, whose ``state_dict`` is JSON values (``trainer.json``)
    and whose ``load_state_dict`` takes them back. ``every``: steps between checkpoints
    (0: none on the way). ``group``: the group DCP coordinates on (a gloo group: its
    collectives exchange Python objects); None in a single process without a process group.
    """

    def __init__(self, root: str, *, rank: int, group: dist.ProcessGroup | None, parts: dict[str, Stateful],
                 state: Stateful | None = None, every: int = 0, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        missing = [name for name in REQUIRED_PARTS if name not in parts]
        if missing:
            raise ValueError(f"a checkpoint needs the parts {list(REQUIRED_PARTS)}; missing {missing}")
        self.root, self.rank, self.group, self.keep = root, rank, group, keep
        self.parts, self.state, self.every = dict(parts), state, every

    def should_save(self, step: int, *, boundary: bool = True) -> bool:
        """Whether step ``step`` ends with a checkpoint: every ``every`` steps, on a step
        boundary (``boundary``: not inside a gradient accumulation group)."""
        return bool(self.every) and (step + 1) % self.every == 0 and boundary

    def completed(self) -> list[str]:
        return completed_checkpoints(self.root)

    def latest(self) -> str | None:
        done = self.completed()
        return done[-1] if done else None

    def save(self, step: int, barrier) -> str:
        """Collective: every rank writes its part, then rank 0 finishes the directory.
        ``barrier()`` must wait for every rank (the caller's step-sync barrier)."""
        final = os.path.join(self.root, f"step-{step:09d}")
        partial = final + PARTIAL
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a crashed save of the same step
            os.makedirs(partial)
        barrier()
        state = {name: part.state_dict() for name, part in self.parts.items()}
        trainer = self.state.state_dict() if self.state is not None else {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=self.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every rank's failure
            self._failed(e, partial, _local_bytes(state))
            raise
        barrier()  # every rank's data file is written
        if self.rank == 0:
            try:
                _write_json(os.path.join(partial, TRAINER_STATE), dict(trainer, step=step))
            except OSError as e:
                self._failed(e, partial)
                raise
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
            _write_json(os.path.join(final, COMPLETE), {"step": step})
            for old in self.completed()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()  # nobody goes on (or reads it) before it is complete
        return final

    def _failed(self, error: BaseException, partial: str, needed: int = 0) -> None:
        """A save that failed: a full disk raises ``StorageFull`` (the partial directory
        removed, so the disk is not left full), anything else returns to be re-raised."""
        full = no_space(error, self.root, needed)
        if full is None:
            return
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise full from None

    def load(self, path: str) -> Restored:
        """Collective: load ``path`` into every part it has (any world size; the model and
        the optimizer it must have), then hand ``trainer.json`` to the state's
        ``load_state_dict``."""
        trainer = check_checkpoint(path)
        try:
            saved = saved_keys(path)
            names = [n for n in self.parts if n in REQUIRED_PARTS or any(s.startswith(n + ".") for s in saved)]
            state = {name: self.parts[name].state_dict() for name in names}
            safe_load(state, path, self.group)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps each rank's failure
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            cause = next((line for line in reversed(lines) if "Error:" in line), lines[-1])
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {cause[:600]}") from None
        for name in names:
            self.parts[name].load_state_dict(state[name])
        if self.state is not None:
            self.state.load_state_dict(trainer)
        return Restored(path=path, trainer=trainer, extra=sorted(set(names) - set(REQUIRED_PARTS)))


def _local_bytes(state: dict) -> int:
    """Bytes of the tensors (local shards) in a nested state dict: about what this rank writes."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open_nofollow(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
