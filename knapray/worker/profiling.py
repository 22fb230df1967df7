"""A torch.profiler window over chosen training steps, and where its device time went.

``metrics.profile_steps: [a, b]`` profiles steps a..b-1 on every rank. Each rank writes to
``<run>/profile/``: ``rank<r>.trace.json`` (Chrome trace; open it in Perfetto or
chrome://tracing) and ``rank<r>.txt``, a summary that reads without a viewer (its numbers in ``rank<r>.json``):

- *device busy*: the union of the kernels' intervals over the window's wall time (a step
  that waits on the host shows here as idle device time);
- *by kind*: kernel time in matrix products, attention, compiled (Triton) kernels, other
  elementwise kernels, communication and copies, as a share of the busy time;
- the heaviest kernels by total time (or, on CPU, the heaviest operators by self time).

``summarize`` is pure (a list of intervals in, text out) so it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from knapray.nofollow import open_nofollow
from knapray.run_files import RunDir

KINDS = (
    ("compiled", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "matmul", "_mm_", "splitk", "::mm", "::addmm", "::bmm")),
    ("communication", ("nccl", "allgather", "reducescatter", "all_to_all", "alltoall")),
    ("copy", ("memcpy", "memset", "copy_")),
)
"""Kernel kinds by substrings of their (lower-cased) names, first match wins; the rest
are ``elementwise/other``."""


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "elementwise/other"


@dataclass(frozen=True)
class Interval:
    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return max(0.0, self.end_us - self.start_us)


def busy_us(intervals: list[Interval]) -> float:
    """Length of the union of the intervals (overlapping kernels, e.g. on two streams,
    count once)."""
    total, end = 0.0, float("-inf")
    for iv in sorted(intervals, key=lambda i: i.start_us):
        if iv.end_us <= end:
            continue
        total += iv.end_us - max(iv.start_us, end)
        end = iv.end_us
    return total


def summary(kernels: list[Interval], wall_us: float, steps: int, *, top: int = 15, device: str = "cuda") -> dict:
    """One rank's window as numbers: ``kernels`` are device kernels (or, on CPU, top-level
    operators), ``wall_us`` the window's host wall time over ``steps`` steps."""
    total = sum(k.us for k in kernels)
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_kind[kind_of(k.name)] = by_kind.get(kind_of(k.name), 0.0) + k.us
        entry = by_name.setdefault(k.name, [0.0, 0])
        entry[0] += k.us
        entry[1] += 1
    return {
        "device": device, "steps": steps, "wall_ms": wall_us / 1e3, "kernel_ms": total / 1e3,
        "busy_ms": busy_us(kernels) / 1e3 if kernels else 0.0,
        "by_kind_ms": {kind: us / 1e3 for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name, "ms": us / 1e3, "calls": n}
                for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def summarize(kernels: list[Interval], wall_us: float, steps: int, *, top: int = 15, device: str = "cuda") -> str:
    """The summary text of one rank's window (``summary``'s numbers, read without a viewer)."""
    return format_summary(summary(kernels, wall_us, steps, top=top, device=device))


def format_summary(s: dict, top: int | None = None) -> str:
    wall, steps = s["wall_ms"], s["steps"]
    lines = [f"profiled steps: {steps}, wall {wall:.1f} ms ({wall / max(steps, 1):.1f} ms per step)"]
    if "host_syncs_per_step" in s:
        first = s.get("first_step", 0)
        lines.append("host syncs per step: " + ", ".join(
            f"step {first + i}: {n}" for i, n in enumerate(s["host_syncs_per_step"]))
            + " (values read back, CUDA waits: 0 expected outside a step that reads, every metrics.log_every)")
    total = s["kernel_ms"]
    if not s["top"]:
        return "\n".join(lines + ["no kernels recorded"])
    what = "kernels" if s["device"] == "cuda" else "operators (self time)"
    lines.append(f"device busy: {s['busy_ms']:.1f} ms = {100 * s['busy_ms'] / wall:.1f}% of the wall time"
                 if s["device"] == "cuda" else f"{what}: {total:.1f} ms")
    lines.append(f"by kind ({what}, {total:.1f} ms in all):")
    for kind, ms in s["by_kind_ms"].items():
        lines.append(f"  {kind:<18} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
    heaviest = s["top"][:top] if top else s["top"]
    lines.append(f"top {len(heaviest)} by total time:")
    for k in heaviest:
        name = k["name"] if len(k["name"]) <= 100 else k["name"][:97] + "..."
        lines.append(f"  {k['ms']:9.2f} ms {k['calls']:6d}x  {100 * k['ms'] / total:5.1f}%  {name}")
    return "\n".join(lines)


HOST_SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
"""Profiler events that are the host waiting for the device: a value read back (``.item()``,
``.tolist()``, ``bool()`` of a tensor) and the CUDA runtime's waits."""


def _step_ranges(events) -> list:
    """The host's ``knapray_step`` ranges. On CUDA the profiler also shows each range on the
    device's timeline (under the same name, later: the kernels run behind the host), which
    counted each step twice: 6 "steps" for 3, and a wall time that held both."""
    from torch.autograd import DeviceType

    return [e for e in events if e.name == "knapray_step" and e.device_type == DeviceType.CPU]


def host_syncs_per_step(prof: torch.profiler.profile) -> list[int]:
    """For each profiled step (its ``knapray_step`` range, in order), how many ``HOST_SYNCS``
    events started inside it."""
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in _step_ranges(events))
    starts = [e.time_range.start for e in events if e.name in HOST_SYNCS]
    return [sum(a <= t < b for t in starts) for a, b in steps]


def _intervals(prof: torch.profiler.profile, device: str) -> tuple[list[Interval], float]:
    """(device kernels, or top-level CPU operators on CPU; the host wall time of the
    window's ``knapray_step`` ranges)."""
    from torch.autograd import DeviceType

    events = prof.events()
    wall = sum(e.time_range.elapsed_us() for e in _step_ranges(events))
    if device == "cuda":
        # A record_function range (ours, the optimizer's) also shows on the device's timeline
        # under its own name: only names no CPU event has are kernels.
        host_names = {e.name for e in events if e.device_type == DeviceType.CPU}
        picked = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in host_names]
        return [Interval(e.name, e.time_range.start, e.time_range.end) for e in picked], wall
    # CPU: operators' self time (a child's time is its own), as back-to-back intervals.
    out, t = [], 0.0
    for e in events:
        if e.device_type == DeviceType.CPU and e.name != "knapray_step" and e.self_cpu_time_total > 0:
            out.append(Interval(e.name, t, t + e.self_cpu_time_total))
            t += e.self_cpu_time_total
    return out, wall


class StepProfiler:
    """Profiles steps ``[start, stop)``: ``with profiler.step(n): ...`` around each step."""

    def __init__(self, run_dir: str, rank: int, window: tuple[int, int] | list[int] | None, device: torch.device):
        self.dir = RunDir(run_dir).profile
        self.rank = rank
        self.window = tuple(window) if window else None
        self.device = "cuda" if device.type == "cuda" else "cpu"
        self.prof: torch.profiler.profile | None = None
        self.steps = 0
        self.written: str | None = None

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        if self.window is None or self.written is not None or not self.window[0] <= n < self.window[1]:
            yield
            return
        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        with torch.profiler.record_function("knapray_step"):
            yield
        self.steps += 1
        if n + 1 >= self.window[1]:
            self.close()

    def close(self) -> None:
        """End the window (also when the run ends inside it) and write its files."""
        if self.prof is None or self.written is not None:
            return
        if self.device == "cuda":
            torch.cuda.synchronize()  # the window's last kernels, once, after its last step
        self.prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.dir, f"rank{self.rank}.trace.json"))
        kernels, wall = _intervals(self.prof, self.device)
        numbers = summary(kernels, wall, self.steps, device=self.device)
        numbers["first_step"] = self.window[0]
        numbers["host_syncs_per_step"] = host_syncs_per_step(self.prof)
        with open_nofollow(os.path.join(self.dir, f"rank{self.rank}.json"), "w") as f:
            json.dump(numbers, f)
        path = os.path.join(self.dir, f"rank{self.rank}.txt")
        with open_nofollow(path, "w") as f:
            f.write(format_summary(numbers) + "\n")
        self.written = path
        self.prof = None
