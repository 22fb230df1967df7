"""Stream a pretrained checkpoint into a model, file by file, each process reading only
the rows of each tensor it keeps.

The model is built on the meta device, parallelized (FSDP2 shards each parameter's dim 0
over its mesh), then given uninitialized storage with ``to_empty``; ``load_pretrained``
fills it. A plain parameter is filled whole. An FSDP2 parameter is a DTensor whose local
tensor holds rows [start, start + n) of the full one (``Shard(0)``: the full tensor cut
into ``ceil(rows / mesh size)``-row chunks, as ``torch.chunk``; ``Replicate`` axes keep
all rows): the loader reads exactly those rows of each checkpoint tensor from the
memory-mapped file (``safe_open(...).get_slice``), so no process ever holds the full
model, on the host or on the device. Nothing is unpickled: safetensors only.
"""

from __future__ import annotations

import dataclasses
import resource
import time

import torch
import torch.nn as nn

from knapray.distributed.param_rows import shard_rows
from knapray.models.config import DiTConfig
from knapray.models.families import checkpoint_layout
from knapray.weights.source import PretrainedSource


@dataclasses.dataclass(frozen=True)
class LoadReport:
    path: str
    layout: str
    files: int
    tensors: int
    """Checkpoint tensors this process read rows of."""
    bytes_read: int
    """Checkpoint bytes this process read (its rows of every tensor)."""
    checkpoint_bytes: int
    seconds: float
    peak_host_bytes: int
    """This process's peak resident memory so far (``ru_maxrss``), loading included."""

    def line(self) -> str:
        mib = 2**20
        return (f"loaded {self.path} ({self.layout} layout, {self.files} file(s)): read {self.bytes_read / mib:.1f} "
                f"of {self.checkpoint_bytes / mib:.1f} MiB ({self.tensors} tensors) in {self.seconds:.1f} s; "
                f"peak host memory {self.peak_host_bytes / mib:.0f} MiB")


def peak_host_bytes() -> int:
    """Peak resident set size of this process (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def load_pretrained(model: nn.Module, cfg: DiTConfig, source: PretrainedSource | None = None) -> LoadReport:
    """Fill ``model``'s parameters (plain or FSDP2-sharded, on any device, allocated) from
    ``cfg.pretrained``, checked first (``check_pretrained``). Returns what it read."""
    from safetensors import safe_open

    from knapray.weights.checks import check_pretrained

    t0 = time.perf_counter()
    source = source or check_pretrained(cfg)
    layout = checkpoint_layout(cfg, source.layout)
    from knapray.models.lora import base_name, is_adapter

    # A LoRA model's base parameters carry ``.base_layer`` in their names; its adapters are
    # not in the checkpoint (``init_adapters`` fills them).
    from knapray.models.fp8 import FP8, SCALE, is_scale, quantize_rows

    named = dict(model.named_parameters())
    params = {base_name(n): p for n, p in named.items() if not is_adapter(n) and not is_scale(n)}
    # A float8 weight (model.lora.base_dtype: fp8) is quantized row by row as its rows are read,
    # each row's scale written beside it (the scales are sharded by rows as the weight is).
    scales = {base_name(n): shard_rows(named[n.removesuffix("weight") + SCALE])
              for n, p in named.items() if p.dtype == FP8}
    if set(params) != {p.param for p in layout.pieces}:
        raise ValueError(f"the model's parameters differ from family {cfg.family}'s layout: got "
                         f"{sorted(set(params) ^ {p.param for p in layout.pieces})[:3]}")
    meta = [n for n, p in params.items() if p.is_meta]
    if meta:
        raise ValueError(f"parameter {meta[0]!r} is on the meta device: allocate the model (to_empty) before loading")
    targets = {name: shard_rows(p) for name, p in params.items()}
    written = dict.fromkeys(params, 0)
    by_file: dict[str, list] = {}
    for piece in layout.pieces:
        by_file.setdefault(source.tensors[piece.key].file, []).append(piece)
    bytes_read, touched = 0, set()
    for file, pieces in by_file.items():  # one file open at a time, mapped, not read whole
        with safe_open(file, framework="pt", device="cpu") as f:
            for piece in pieces:
                local, start, rows = targets[piece.param]
                lo, hi = max(piece.dst, start), min(piece.dst + piece.rows, start + rows)
                if lo >= hi:
                    continue  # none of this piece's rows is ours
                src = piece.src + (lo - piece.dst)
                data = f.get_slice(source.tensors[piece.key].name)[src : src + (hi - lo)]
                if piece.param in scales:
                    values, scale = quantize_rows(data)
                    local[lo - start : hi - start].copy_(values)
                    scales[piece.param][0][lo - start : hi - start].copy_(scale)
                else:
                    local[lo - start : hi - start].copy_(data)
                written[piece.param] += hi - lo
                bytes_read += data.numel() * data.element_size()
                touched.add(piece.key)
    short = [n for n, (_, _, rows) in targets.items() if written[n] != rows]
    if short:
        raise ValueError(f"parameter {short[0]!r}: {written[short[0]]} of its {targets[short[0]][2]} local rows loaded")
    return LoadReport(path=source.path, layout=source.layout, files=len(by_file), tensors=len(touched),
                      bytes_read=bytes_read, checkpoint_bytes=source.total_bytes,
                      seconds=time.perf_counter() - t0, peak_host_bytes=peak_host_bytes())
