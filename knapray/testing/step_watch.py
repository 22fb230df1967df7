"""What a training step does on the device, watched op by op (``knapray dryrun``).

``StepWatch`` is a ``TorchDispatchMode``: every aten / c10d op of the step passes through it
before it runs (under ``FakeTensorMode``: on fake tensors). It records

- every collective: kind (the c10d op), the size of its process group, how many, the bytes
  this rank puts in (for an all-to-all or all-gather its input, for an all-reduce the
  tensor), and whether its tensors are on the training device (NCCL would refuse a CPU
  tensor; the fake backend accepts it);
- host synchronizations: ops whose result the host must wait for (``.item()``,
  ``.tolist()``: ``_local_scalar_dense``; ``nonzero``, boolean-mask indexing and
  ``masked_select``, whose output size is data; copies between host and device without
  ``non_blocking``): each names the op and the knapray source line that issued it;
- dtypes where the compute dtype is bf16: every matrix multiply's inputs (forward and
  backward) and q, k, v at attention (``check_attention``).

Ops on DTensors are left to DTensor, which dispatches its local ops back through the mode.
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNC_OPS = {
    aten._local_scalar_dense.default: ".item() / .tolist() (a value read on the host)",
    aten.nonzero.default: "nonzero (output size is data)",
    aten.masked_select.default: "masked_select (output size is data)",
    aten.unique_dim.default: "unique (output size is data)",
    aten._unique2.default: "unique (output size is data)",
    aten.is_nonzero.default: "bool() of a tensor",
    aten.equal.default: "torch.equal (a value read on the host)",
}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
FLOAT8_MATMULS = {aten._scaled_mm.default}
"""``parallel.fp8``'s matmuls: counted apart (their operands are float8 by design)."""
COPIES = {aten._to_copy.default, aten.copy_.default}

# Which argument holds what this rank sends, per c10d op (the others send their first tensor).
_SENT = {"alltoall_base_": 1, "_allgather_base_": 1, "allgather_into_tensor_coalesced_": 1,
         "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1, "allgather_": 1,
         "reduce_scatter_": 1, "alltoall_": 1}
_KNAPRAY = str(Path(__file__).resolve().parents[1])


_KIND: dict[int, tuple] = {}
"""id of an op -> (the op, what ``StepWatch`` watches it for: ``_kind``); the op is kept, so
its id is never another's."""
_DTENSOR_TYPES: dict[tuple, bool] = {}
"""The ``types`` a mode is called with -> whether one is a DTensor (left to DTensor)."""


def _kind(func) -> str | None:
    """What ``StepWatch`` watches op ``func`` for, None for nothing."""
    if func.namespace in ("c10d", "_c10d_functional"):
        return "collective"
    if func in SYNC_OPS:
        return "sync"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return "index"
    if func in COPIES:
        return "copy"
    if func in FLOAT8_MATMULS:
        return "float8"
    if func in MATMULS:
        return "matmul"
    return None


def _has_dtensor(types) -> bool:
    from torch.distributed.tensor import DTensor

    return any(issubclass(t, DTensor) for t in types)


def _where() -> str:
    """The innermost knapray source line on the stack (outside this module)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_KNAPRAY) and not frame.filename.endswith("step_watch.py"):
            return f"{Path(frame.filename).relative_to(Path(_KNAPRAY).parent)}:{frame.lineno} ({frame.name})"
    return "outside knapray"


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size(args, kwargs) -> int | None:
    for a in [*args, *kwargs.values()]:
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject) and a._type().name() == "ProcessGroup":  # how c10d ops carry it
            return dist.ProcessGroup.unbox(a).size()
        if isinstance(a, str) and a:  # functional collectives name their group
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return _resolve_process_group(a).size()
            except (ImportError, ValueError, RuntimeError, KeyError):
                continue
    return None


@dataclass
class Collectives:
    """(kind, group size) -> [count, bytes sent]."""

    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, kind: str, size: int | None, nbytes: int) -> None:
        entry = self.counts[(kind, size)]
        entry[0] += 1
        entry[1] += nbytes

    def rows(self) -> list[tuple[str, int | None, int, int]]:
        return sorted((k, s, c, b) for (k, s), (c, b) in self.counts.items())


class HostSync(RuntimeError):
    """A step op the host would wait for the device on."""


class StepWatch(TorchDispatchMode):
    """Records a step's collectives, host syncs and dtype/device violations (see the module
    docstring). ``device``: the training device the collectives' tensors must be on;
    ``compute_dtype``: matmuls and attention inputs must be in it when it is bf16."""

    def __init__(self, device: torch.device | str, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.compute_dtype = compute_dtype
        self.collectives = Collectives()
        self.syncs: list[str] = []
        self.device_violations: list[str] = []
        self.dtype_violations: list[str] = []
        self.matmuls = 0
        self.float8_matmuls = 0
        self.attention_calls = 0
        self.count_syncs = True

    def reset_counts(self) -> None:
        """Forget the collectives counted so far (violations are kept)."""
        self.collectives = Collectives()
        self.matmuls = self.float8_matmuls = self.attention_calls = 0

    def check_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Called by the attention kernel with its inputs."""
        self.attention_calls += 1
        for name, t in (("q", q), ("k", k), ("v", v)):
            if self.compute_dtype != torch.float32 and t.dtype != self.compute_dtype:
                self._note(self.dtype_violations, f"attention {name} is {t.dtype}, not {self.compute_dtype}")
            if t.device.type != self.device_type:
                self._note(self.device_violations, f"attention {name} on {t.device}, not {self.device_type}")

    def _note(self, where: list[str], what: str) -> None:
        line = f"{what} at {_where()}"
        if line not in where:
            where.append(line)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Every op of a step comes here (some 200,000 in a full-width dry run), most watched for
        # nothing: what an op is watched for and whether its types hold a DTensor are looked up
        # by the op's identity and the types' tuple, each worked out once (an op's own hash is
        # a Python call).
        seen = _KIND.get(id(func))
        if seen is None or seen[0] is not func:
            seen = _KIND[id(func)] = (func, _kind(func))
        subclass = _DTENSOR_TYPES.get(types)
        if subclass is None:
            subclass = _DTENSOR_TYPES[types] = _has_dtensor(types)
        if subclass:
            return NotImplemented
        kwargs = kwargs or {}
        if seen[1] is not None:
            self._watch(seen[1], func, types, args, kwargs)
        return func(*args, **kwargs)

    def _watch(self, kind: str, func, types, args, kwargs) -> None:
        if kind == "collective":
            self._collective(func, args, kwargs)
        elif kind == "sync":
            self._sync(SYNC_OPS[func])
        elif kind == "index":
            if any(t.dtype == torch.bool for t in _tensors(args[1])):
                self._sync(f"{func.__name__} with a boolean mask (output size is data)")
        elif kind == "copy":
            self._copy(func, args, kwargs)
        elif kind == "float8" or (kind == "matmul" and any(t.__name__.startswith("Float8") for t in types)):
            self.float8_matmuls += 1  # _scaled_mm, or a matmul of torchao's float8 tensors (it calls _scaled_mm)
        elif kind == "matmul" and self.compute_dtype != torch.float32:
            self.matmuls += 1
            floats = [t for t in _tensors(list(args)) if t.is_floating_point()]
            if any(t.dtype != self.compute_dtype for t in floats):
                self._note(self.dtype_violations, f"{func.__name__} on {sorted({str(t.dtype) for t in floats})}, "
                                                  f"not {self.compute_dtype}")

    def _collective(self, func, args, kwargs) -> None:
        name = func._opname
        if name in ("wait_tensor", "barrier", "monitored_barrier"):
            return
        tensors = _tensors(list(args))
        sent = _tensors(args[_SENT.get(name, 0)]) if args else []
        self.collectives.add(name, _group_size(args, kwargs), sum(t.numel() * t.element_size() for t in sent))
        off = sorted({str(t.device) for t in tensors if t.device.type != self.device_type})
        if off:
            self._note(self.device_violations, f"{name} with tensors on {off}, not {self.device_type}")

    def _copy(self, func, args, kwargs) -> None:
        src = args[1] if func is aten.copy_.default else args[0]
        dst_device = args[0].device if func is aten.copy_.default else kwargs.get("device", src.device)
        if dst_device is None or torch.device(dst_device).type == src.device.type:
            return
        if not kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False):
            self._sync(f"a blocking copy {src.device.type} -> {torch.device(dst_device).type}")

    def _sync(self, what: str) -> None:
        if not self.count_syncs:
            return
        line = f"{what} at {_where()}"
        self.syncs.append(line)
        raise HostSync(line)
