"""``knapray calibrate``: time packed batches on this device, fit the cost model, validate it.

Calibration times forward + backward of ``MMDiT.blocks`` (every double- and single-stream
block, attention through ``knapray.attention``) on *packed batches*: every token budget x
every length mix of ``knapray.planning.fitting.costfit.calibration_batches`` (all of one short
length, short ones of distinct lengths, about 8 medium, long ones, one long plus short
ones, log-uniform spread). It fits (see
``knapray.planning.fitting.costfit``)::

    t(batch) = c + layers · (a·Σ L + b·Σ L² + s·n)

so the planner gets the *marginal* cost of a sequence in the batch a rank runs, with the
fixed cost of the step ``c`` paid once per batch. The per-sequence term ``s`` is kept only
if leave-one-out cross-validation says the data show one.

Execution mode: timings hold only for the mode they were taken in, so the run's mode is
reproduced here and recorded in the profile (``mode``: device, dtype, compile, ac,
attention backend, device name, torch version): both are applied by the trainer's own
``knapray.worker.parallelize``: ``compile=True`` compiles every block as training does
(each batch runs once untimed first, so compilation is never timed; attention runs
outside the compiled graphs); ``ac=True`` checkpoints every block (``ac: full``: its
forward is recomputed in the backward). ``CostModel.from_profile(path, run_mode=...)`` refuses a
profile whose mode differs from the run's.

Validation (``validate``) times held-out packed batches drawn from the paper mixes
(``PAPER_MIXES``; resolutions divided by ``scale`` to fit the device), planned onto bags
of one GPU by ``plan_balance`` so each is a batch a balanced rank would run, and compares
the profile's prediction with the measurement.

Timing: on CUDA, wall time between synchronizations; on CPU, one intra-op thread and the
calling thread's CPU time (``time.thread_time``: other processes waiting for the cores do
not inflate it). Batches are timed round robin, ``repeats`` times each, and the fastest
run counts (the least disturbed); calibration batches far off the first fit
(``RETIME_FACTOR``) are timed once more and keep their fastest run of all. Other
processes on the cores still slow a thread's own CPU time (they evict its caches), and by
a different factor when the load has changed between a calibration and a validation
minutes later; so on CPU the validation also re-times the profile's calibration batches
of its middle budget and divides its measurements by the median ratio of their times now
and then (the *load factor* it prints).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import platform
import time
from typing import Sequence

import numpy as np
import torch

from knapray.attention import LocalAttention, _resolve_backend
from knapray.models.config import DiTConfig
from knapray.models.families import FAMILIES, build_model, cross_text_pad, get_family
from knapray.planning import PAPER_MIXES
from knapray.planning.costs.cost import MODE_KEYS, PROFILE_FORMAT, CostModel
from knapray.planning.fitting.costfit import (
    calibration_batches,
    fit_packed,
    mean_abs_error,
    validation_batches,
)
from knapray.config.parallel import ParallelConfig
from knapray.worker.parallelize import parallelize

CPU_BUDGETS = (1024, 2048, 3072)
"""On CPU the per-token cost grows once a batch's activations leave the 2 MB L2 cache
(~4k tokens at width 128), so the budgets stay around the held-out batches' size."""
GPU_BUDGETS = (8192, 16384, 32768)
CPU_SHORT, GPU_SHORT = 64, 256
CPU_LONGEST = 2048
"""Longest calibrated sequence on CPU (the 1/4-scale paper mixes reach ~1.7k tokens; much
longer ones leave the caches). On GPU the largest budget."""
CPU_VALIDATE_SCALE, GPU_VALIDATE_SCALE = 4, 1
CPU_VALIDATE_TARGET_S, GPU_VALIDATE_TARGET_S = 0.15, 0.3
"""Seconds a held-out batch takes by the profile's prediction: ~2k tokens on CPU (inside
the calibrated budgets), a full rank's batch on GPU."""
RETIME_FACTOR = 2.0
"""Calibration batches whose fit error exceeds this many times the mean are timed again."""
MAX_ERROR = 0.05
"""Mean absolute error above which calibration and validation fail (exit 1)."""
DEFAULT_FAMILY = "mmdit"
"""Whose blocks are timed without ``--family`` or ``--config``."""


def _timed_families() -> tuple[str, str]:
    """For errors: the families calibration builds (``mmdit or wan``), and where the others'
    blocks are timed (`` (flux's blocks are MMDiT's: calibrate it as mmdit)``)."""
    own = " or ".join(f.name for f in FAMILIES.values() if f.sized_config is not None)
    others = "; ".join(f"{f.name}'s blocks are {get_family(f.calibrated_as).title}'s: calibrate it as {f.calibrated_as}"
                       for f in FAMILIES.values() if f.sized_config is None)
    return own, f" ({others})" if others else ""


def calibration_config(hidden: int, heads: int, depth_double: int, depth_single: int,
                       family: str = DEFAULT_FAMILY) -> DiTConfig:
    """A model of the given size, the family's ``sized_config``: an MMDiT with RoPE channels
    split over (t, h, w), or for ``family`` wan a Wan of ``depth_double + depth_single``
    blocks (Wan's FFN ratio, text padded to 512 as its pipelines do)."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}")
    head_dim = hidden // heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim {head_dim} (hidden/heads) must be even and >= 6")
    fam = FAMILIES.get(family)
    if fam is None or fam.sized_config is None:
        own, others = _timed_families()
        raise ValueError(f"calibration times the {own} family's blocks, not {family!r}{others}")
    return fam.sized_config(hidden, heads, depth_double, depth_single)


def execution_mode(device: torch.device, dtype: str, compile: bool, ac: bool, backend: str) -> dict:
    """The ``mode`` a profile records (``knapray.planning.costs.cost.MODE_KEYS``)."""
    on_gpu = device.type == "cuda"
    mode = {
        "device": device.type,
        "dtype": dtype,
        "compile": bool(compile),
        "ac": bool(ac),
        "attention_backend": backend,
        "device_name": torch.cuda.get_device_name(device) if on_gpu else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
    }
    assert set(mode) == set(MODE_KEYS)
    return mode


class _Bench:
    """A model of the calibrated size in one execution mode, and closures that run forward +
    backward of its blocks on a packed batch."""

    def __init__(self, model_dims: dict, device: str | None, dtype: str | None, compile: bool, ac: bool,
                 seed: int = 0) -> None:
        self.dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but torch sees no CUDA device")
        self.on_gpu = self.dev.type == "cuda"
        self.dtype_name = dtype or ("bfloat16" if self.on_gpu else "float32")
        if self.dtype_name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype_name!r}")
        self.dtype = getattr(torch, self.dtype_name)
        self.dims = {k: int(model_dims[k]) for k in ("hidden_size", "num_heads", "depth_double", "depth_single")}
        self.family = str(model_dims.get("family", DEFAULT_FAMILY))
        self.cfg = calibration_config(*self.dims.values(), family=self.family)
        self.layers = self.dims["depth_double"] + self.dims["depth_single"]
        torch.manual_seed(seed)
        self.model = build_model(self.cfg).to(device=self.dev, dtype=self.dtype)
        if get_family(self.family).zero_init:
            self.model.init_weights(std=0.02)  # non-degenerate: no all-zero modulation shortcuts
        # The trainer's own checkpointing and compile (``parallelize``): the mode a profile
        # records is then the mode a run executes.
        parallelize(self.model, ParallelConfig(activation_checkpointing="full" if ac else "none",
                                               compile=bool(compile)))
        self.compile = bool(compile)
        probe = torch.zeros(1, self.cfg.num_heads, self.cfg.head_dim, device=self.dev, dtype=self.dtype)
        self.backend = _resolve_backend("auto", probe)
        self.mode = execution_mode(self.dev, self.dtype_name, compile, ac, self.backend)

    def step_fn(self, lengths: Sequence[int], seed: int):
        """A closure running forward + backward of the blocks on one packed batch."""
        lens = [int(x) for x in lengths]
        n_tok, d, dev, dtype = sum(lens), self.cfg.hidden_size, self.dev, self.dtype
        gen = torch.Generator().manual_seed(seed)
        h0 = torch.randn(n_tok, d, generator=gen).to(device=dev, dtype=dtype)
        # the family's condition width (Wan's (S, 7 d): temb, then the blocks' modulation)
        vec = torch.randn(len(lens), self.cfg.condition_dim, generator=gen).to(device=dev, dtype=dtype)
        seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
        is_text = torch.zeros(n_tok, dtype=torch.bool)
        pos = torch.zeros(n_tok, 3, dtype=torch.long)
        start = 0
        for L in lens:  # 1/8 text first, then an image laid out on a square-ish grid
            n_txt = L // 8
            is_text[start : start + n_txt] = True
            side = max(1, int(np.sqrt(L - n_txt)))
            img = torch.arange(L - n_txt)
            pos[start + n_txt : start + L, 1], pos[start + n_txt : start + L, 2] = img // side, img % side
            start += L
        is_text, pos = is_text.to(dev), pos.to(dev)
        cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device=dev)
        # Under compile, parallelize keeps attention outside the compiled graphs, as in training.
        attn = LocalAttention(cu, max(lens))
        model = self.model
        padded = bool(cross_text_pad(self.cfg))

        def run() -> None:
            h = h0.detach().requires_grad_(True)
            if padded:  # the padding row ``embed`` would give the blocks (Wan attends to 512 text rows)
                model.embed(h0.new_zeros(0, self.cfg.text_dim), h0.new_zeros(0, self.cfg.patch_dim),
                            is_text[:0])
            out = model.blocks(h, vec, seq_index, pos, is_text, attn)
            out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    def time_batches(self, batches: Sequence[Sequence[int]], repeats: int, progress=None) -> list[float]:
        """Fastest of ``repeats`` timed runs of every batch, after one untimed run of each
        (allocations, kernel selection, compilation). Round robin over the batches, so a
        burst of load elsewhere hits one repeat of every batch rather than every repeat of
        one."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        threads = torch.get_num_threads()
        if not self.on_gpu:
            torch.set_num_threads(1)
        try:
            runs = []
            for i, lens in enumerate(batches):
                run = self.step_fn(lens, seed=i)
                run()
                runs.append(run)
            samples: list[list[float]] = [[] for _ in runs]
            for rep in range(repeats):
                for i, run in enumerate(runs):
                    samples[i].append(self._timed(run))
                if progress is not None:
                    progress(rep + 1, repeats)
        finally:
            torch.set_num_threads(threads)
        return [min(x) for x in samples]

    def _timed(self, run) -> float:
        if self.on_gpu:
            torch.cuda.synchronize(self.dev)
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize(self.dev)
            return time.perf_counter() - t0
        t0 = time.thread_time()
        run()
        return time.thread_time() - t0

    def measured_on(self) -> dict:
        return {
            "threads": torch.get_num_threads() if self.on_gpu else 1,
            "timer": "wall time between CUDA synchronizations" if self.on_gpu else "thread CPU time (time.thread_time)",
            "host": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }


def calibrate(
    hidden: int = 128,
    heads: int = 4,
    depth_double: int = 1,
    depth_single: int = 1,
    budgets: Sequence[int] | None = None,
    short: int | None = None,
    longest: int | None = None,
    repeats: int = 7,
    device: str | None = None,
    dtype: str | None = None,
    compile: bool = False,
    ac: bool = False,
    per_sequence: bool | None = None,
    out: str | None = None,
    seed: int = 0,
    progress=None,
    family: str = DEFAULT_FAMILY,
) -> dict:
    """Time packed batches, fit, and (if ``out``) write the profile; returns it.

    ``per_sequence``: None decides the per-sequence term by cross-validation. ``family``
    wan: Wan blocks, each sequence 1/8 text (its cross-attention keys, plus the padding key)
    and 7/8 image tokens; the fit prices a sequence by all its tokens, cross-attention
    included, so the profile's ``text_tokens`` is 0 (no analytic cross term on top)."""
    bench = _Bench({"hidden_size": hidden, "num_heads": heads, "depth_double": depth_double,
                    "depth_single": depth_single, "family": family}, device, dtype, compile, ac, seed)
    budgets = sorted({int(b) for b in (budgets or (GPU_BUDGETS if bench.on_gpu else CPU_BUDGETS))})
    short = int(short or (GPU_SHORT if bench.on_gpu else CPU_SHORT))
    longest = int(longest or (budgets[-1] if bench.on_gpu else min(CPU_LONGEST, budgets[-1])))
    named = calibration_batches(budgets, short, longest, seed)
    batches = [lens for _, lens in named]
    seconds = bench.time_batches(batches, repeats, progress)
    # The per-sequence sdpa path makes one attention call per distinct length; Wan's
    # cross-attention one per sequence (its keys are each sequence's own text).
    cross = bench.cfg.attention_kind == "cross"
    seq_counts = "lengths" if bench.backend == "sdpa" and not cross else "sequences"
    result = fit_packed(batches, seconds, bench.layers, per_sequence, seq_counts)
    # A batch far off the fit may have been disturbed on every one of its runs (a burst of
    # load elsewhere): time those again and keep each one's fastest run of all.
    err = np.abs(np.asarray(result.predicted_s) - seconds) / np.asarray(seconds)
    again = np.flatnonzero(err > RETIME_FACTOR * err.mean()).tolist()
    if again:
        more = bench.time_batches([batches[i] for i in again], repeats, progress)
        for i, t in zip(again, more):
            seconds[i] = min(seconds[i], t)
        result = fit_packed(batches, seconds, bench.layers, per_sequence, seq_counts)
    cost_fields = {
        "d_model": hidden,
        "num_heads": heads,
        "double_blocks": bench.cfg.depth_double,  # Wan: all its blocks are single-stream
        "single_blocks": bench.cfg.depth_single,
        **result.cost_fields(),
        "activation_bytes": torch.tensor([], dtype=bench.dtype).element_size(),
        # Ulysses all-to-alls per layer, in hidden-state volumes of a token: joint q, k, v and
        # output (4) forward, 4 backward, + 4 when the forward is recomputed; Wan's blocks
        # also send image q and bring its output back for cross-attention (6, 12, 18).
        "ulysses_a2a_per_layer": (18 if ac else 12) if cross else (12 if ac else 8),
        "recompute_passes": 1.0 if ac else 0.0,
        # Wan: cross-attention is in the fitted terms (a sequence's L counts all its tokens)
        **({"attention_kind": "cross", "text_tokens": 0} if cross else {}),
    }
    profile = {
        "format": PROFILE_FORMAT,
        "mode": bench.mode,
        "measured_on": bench.measured_on(),
        "model": {**bench.dims, "mlp_ratio": bench.cfg.mlp_ratio, "family": family},
        "passes": "forward + backward of all blocks, packed batches"
        + (", forward recomputed (activation checkpointing)" if ac else "")
        + (", blocks compiled (torch.compile dynamic=True)" if compile else ""),
        "repeats": repeats,
        "retimed": [named[i][0] for i in again],
        "batches": [{"name": name, "lengths": lens} for name, lens in named],
        "seconds": seconds,
        "fit": result.to_dict(),
        "cost_model": cost_fields,
        "command": _command(hidden, heads, depth_double, depth_single, budgets, short, longest, repeats, bench, out,
                            family),
    }
    if out:
        with open(out, "w") as f:
            json.dump(profile, f, indent=1)
    return profile


def validate(
    path: str,
    scale: int | None = None,
    target_s: float | None = None,
    per_mix: int = 4,
    repeats: int = 7,
    mixes: Sequence[str] | None = None,
    device: str | None = None,
    seed: int = 12345,
    progress=None,
) -> dict:
    """Time held-out packed batches in the profile's own mode and compare with its prediction.

    ``scale`` divides the mixes' resolutions (default 4 on CPU, 1 on GPU); ``target_s``
    sets how many bags of one the sample step is balanced onto, so that a batch takes about
    that long by the profile's prediction (default 0.15 s on CPU, 0.3 s on GPU)."""
    with open(path) as f:
        profile = json.load(f)
    mode = profile.get("mode") if isinstance(profile, dict) else None
    if not isinstance(mode, dict) or not isinstance(profile.get("model"), dict):
        raise ValueError(f"{path}: not a packed-batch profile (no 'mode' and 'model'); run `knapray calibrate`")
    bench = _Bench(profile["model"], device or mode["device"], mode["dtype"], mode["compile"], mode["ac"])
    # The profile must match the mode it is validated in (same check the planner does).
    run_mode = {k: bench.mode[k] for k in ("device", "dtype", "compile", "ac", "attention_backend")}
    cost = CostModel.from_profile(path, run_mode=run_mode)
    scale = int(scale or (GPU_VALIDATE_SCALE if bench.on_gpu else CPU_VALIDATE_SCALE))
    target_s = float(target_s or (GPU_VALIDATE_TARGET_S if bench.on_gpu else CPU_VALIDATE_TARGET_S))
    named = validation_batches(cost, list(mixes or PAPER_MIXES), scale, target_s, per_mix, seed)
    batches = [lens for _, lens in named]
    anchors = [] if bench.on_gpu else _anchor_batches(profile)
    times = bench.time_batches([b["lengths"] for b in anchors] + batches, repeats, progress)
    load = float(np.median([now / b["seconds"] for now, b in zip(times, anchors)])) if anchors else 1.0
    measured = [t / load for t in times[len(anchors):]]
    predicted = [cost.batch_time(lens) for lens in batches]
    mae, worst = mean_abs_error(predicted, measured)
    return {
        "profile": path,
        "mode": bench.mode,
        "scale": scale,
        "target_s": target_s,
        "repeats": repeats,
        "load_factor": load,
        "anchors": [b["name"] for b in anchors],
        "batches": [
            {"name": name, "sequences": len(lens), "tokens": int(sum(lens)), "longest": int(max(lens)),
             "predicted_s": p, "measured_s": m, "error": (p - m) / m}
            for (name, lens), p, m in zip(named, predicted, measured)
        ],
        "mean_abs_error": mae,
        "max_abs_error": worst,
    }


def _anchor_batches(profile: dict) -> list[dict]:
    """The profile's calibration batches of its middle token budget, with their seconds."""
    named = [dict(b, seconds=t) for b, t in zip(profile["batches"], profile["seconds"])]
    budgets = sorted({sum(b["lengths"]) for b in named})
    mid = budgets[len(budgets) // 2]
    return [b for b in named if sum(b["lengths"]) == mid]


def print_report(profile: dict) -> None:
    m, f = profile["mode"], profile["fit"]
    print(f"calibration on {m['device']} ({m['device_name']}), {m['dtype']}, compile {m['compile']}, "
          f"ac {m['ac']}, attention {m['attention_backend']}, torch {m['torch']}, {profile['model']}")
    print(f"{'batch':<14} {'seqs':>5} {'tokens':>7} {'measured s':>11} {'fit s':>11} {'error':>8}")
    for b, t, p in zip(profile["batches"], profile["seconds"], f["fit_seconds"]):
        print(f"{b['name']:<14} {len(b['lengths']):>5} {sum(b['lengths']):>7} {t:>11.6f} {p:>11.6f} "
              f"{(p - t) / t:>+8.2%}")
    print(f"fit: t = {f['overhead_s']:.3e} + {f['layers']} x ({f['linear_s_per_token_per_layer']:.3e} N "
          f"+ {f['attn_s_per_pair_per_layer']:.3e} sum L^2 + {f['seq_s_per_sequence_per_layer']:.3e} n) s")
    print(f"per-sequence term {'kept' if f['per_sequence_term'] else 'dropped'}: leave-one-out mean abs. error "
          f"{f['cv_mape_with_seq']:.2%} with it, {f['cv_mape_without_seq']:.2%} without")
    print(f"mean abs. error {f['mape']:.2%}, worst {f['max_ape']:.2%} (leave-one-out {f['cv_mape']:.2%})"
          + (f"; timed twice (far off the first fit): {', '.join(profile['retimed'])}" if profile["retimed"] else ""))
    print(f"command: {profile['command']}")


def print_validation(report: dict, max_error: float = MAX_ERROR) -> None:
    m = report["mode"]
    print(f"validation of {report['profile']} on {m['device']} ({m['device_name']}), {m['dtype']}, "
          f"compile {m['compile']}, ac {m['ac']}: paper mixes at 1/{report['scale']} resolution, "
          f"balanced onto bags of one (about {report['target_s']} s per batch)")
    if report["anchors"]:
        print(f"load factor {report['load_factor']:.3f}: the median of now / then over the re-timed calibration "
              f"batches {', '.join(report['anchors'])}; measurements below are divided by it")
    print(f"{'batch':<16} {'seqs':>5} {'tokens':>7} {'longest':>7} {'predicted s':>12} {'measured s':>11} {'error':>8}")
    for b in report["batches"]:
        print(f"{b['name']:<16} {b['sequences']:>5} {b['tokens']:>7} {b['longest']:>7} {b['predicted_s']:>12.6f} "
              f"{b['measured_s']:>11.6f} {b['error']:>+8.2%}")
    ok = report["mean_abs_error"] <= max_error
    print(f"mean abs. error {report['mean_abs_error']:.2%}, worst {report['max_abs_error']:.2%}: "
          f"{'PASS' if ok else 'FAIL'} (limit {max_error:.0%})")


def _flag(flag: str, value, default) -> list[str]:
    """``[flag value]``, or nothing where ``value`` is the flag's default."""
    return [] if value == default else [f"{flag} {value}"]


def _command(hidden, heads, dd, ds, budgets, short, longest, repeats, bench: _Bench, out,
             family=DEFAULT_FAMILY) -> str:
    parts = [
        "knapray calibrate", *_flag("--family", family, DEFAULT_FAMILY), f"--hidden {hidden}", f"--heads {heads}", f"--depth-double {dd}",
        f"--depth-single {ds}", "--budgets " + ",".join(str(x) for x in budgets), f"--short {short}",
        f"--longest {longest}",
        f"--repeats {repeats}", f"--device {bench.dev.type}",
        "--dtype " + {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[bench.dtype_name],
    ]
    if bench.mode["compile"]:
        parts.append("--compile")
    if bench.mode["ac"]:
        parts.append("--ac full")
    if out:
        parts.append(f"--out {out}")
    return " ".join(parts)


# ---- the command ----------------------------------------------------------------------------

DESCRIPTION = ("Time packed batches on this device, fit the cost model, write a profile; or --validate a profile "
               "on held-out batches. With --config, the run's model size and execution mode (parallel.precision, "
               "parallel.activation_checkpointing, parallel.compile, scaling.use_gpu) are calibrated; flags override them.")
DEFAULT_DIMS = {"hidden": 128, "heads": 4, "depth_double": 1, "depth_single": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import (add_ac, add_compile, add_config, add_device, add_dtype, add_json, float_in,
                                        int_at_least)

    add_config(p, required=False, what=": calibrate its model size and execution mode")
    p.add_argument("--family", default=None,
                   help="whose blocks to time (default: model.family with --config, flux timed as mmdit; else "
                   "mmdit); wan: Wan's blocks with cross-attention to each sequence's text")
    p.add_argument("--hidden", type=int_at_least(1), default=None,
                   help="model width (default: model.hidden_size with --config, else 128: CPU size; Flux 3072)")
    p.add_argument("--heads", type=int_at_least(1), default=None,
                   help="attention heads (default: model.num_heads with --config, else 4; Flux 24)")
    p.add_argument("--depth-double", type=int_at_least(0), default=None,
                   help="double-stream blocks timed (default: model.depth_double with --config, else 1)")
    p.add_argument("--depth-single", type=int_at_least(0), default=None,
                   help="single-stream blocks timed (default: model.depth_single with --config, else 1)")
    p.add_argument("--budgets", help="comma-separated token budgets of the packed batches "
                   "(default: 1024,2048,3072 on CPU, 8192,16384,32768 on GPU)")
    p.add_argument("--short", type=int_at_least(1), default=None,
                   help="length of the short sequences (default 64 CPU, 256 GPU)")
    p.add_argument("--longest", type=int_at_least(1), default=None,
                   help="longest calibrated sequence: the run's longest (default: 2048 on CPU, the largest "
                   "budget on GPU)")
    p.add_argument("--repeats", type=int_at_least(1), default=7,
                   help="timed runs per batch; the fastest counts (default 7)")
    add_device(p, help="where to time (default: scaling.use_gpu with --config, else cuda if present)")
    add_dtype(p, help="compute dtype (default: parallel.precision with --config, else bf16 on GPU, fp32 on CPU)")
    add_compile(p, "torch.compile every block (dynamic shapes), as the run does (default: parallel.compile)")
    add_ac(p, default=None, help="none or full, as the run does (default: parallel.activation_checkpointing with "
           "--config, else none)")
    p.add_argument("--per-sequence", choices=["auto", "on", "off"], default="auto",
                   help="per-sequence cost term: auto keeps it if leave-one-out cross-validation says so (default)")
    p.add_argument("--out", default="profile.json", help="profile JSON to write (default profile.json)")
    p.add_argument("--validate", metavar="PROFILE", help="time held-out packed batches from the paper mixes in the "
                   "profile's mode; print predicted vs measured; exit 1 if the mean abs. error exceeds --max-error")
    p.add_argument("--validate-scale", type=int_at_least(1), default=None,
                   help="--validate: divide the mixes' resolutions by this (default 4 on CPU, 1 on GPU)")
    p.add_argument("--validate-target-s", type=float_in(gt=0), default=None,
                   help="--validate: seconds a held-out batch should take by the profile's prediction "
                   "(default 0.15 on CPU, 0.3 on GPU)")
    p.add_argument("--per-mix", type=int_at_least(1), default=4,
                   help="--validate: held-out batches per paper mix (default 4)")
    p.add_argument("--max-error", type=float_in(gt=0), default=MAX_ERROR,
                   help="exit 1 if the mean abs. error (calibration: leave-one-out; validation: held-out) exceeds "
                   f"this (default {MAX_ERROR:g})")
    add_json(p)


def calibration_args(args: argparse.Namespace) -> dict:
    """``calibrate``'s keyword arguments from the command line: a flag given wins, then the
    run config's value (``--config``), then the built-in default. Raises ValueError."""
    from knapray.commands.flags import TORCH_DTYPE_NAMES

    cfg = None
    if args.config:
        from knapray.driver.preflight import load_run_config

        cfg = load_run_config(args.config, args.set)
    elif args.set:
        raise ValueError("--set overrides a run config's values: give the config with --config")
    model = {"hidden": "hidden_size", "heads": "num_heads", "depth_double": "depth_double",
             "depth_single": "depth_single"}
    dims = {k: getattr(args, k) if getattr(args, k) is not None else
            (getattr(cfg.model, field) if cfg is not None else DEFAULT_DIMS[k]) for k, field in model.items()}
    device = None if args.device == "auto" else args.device
    if device is None and cfg is not None:
        device = "cuda" if cfg.scaling.use_gpu else "cpu"
    dtype = args.dtype
    if dtype == "auto" and cfg is not None:
        dtype = cfg.parallel.precision  # auto | bf16 | fp32
    ac = args.ac if args.ac is not None else (cfg.parallel.activation_checkpointing if cfg is not None else "none")
    if ac in ("every_k", "selective"):
        where = f"--ac {ac}" if args.ac is not None else f"parallel.activation_checkpointing {ac} ({args.config})"
        raise ValueError(f"{where}: a profile records activation checkpointing as full or none; calibrate with "
                         "--ac full or --ac none")
    budgets = None
    if args.budgets:
        try:
            budgets = [int(x) for x in args.budgets.split(",")]
        except ValueError:
            raise ValueError(f"--budgets {args.budgets!r}: expected comma-separated token counts, e.g. 1024,2048")
    family = args.family or (get_family(cfg.model.family).calibrated_as if cfg is not None else DEFAULT_FAMILY)
    if family not in FAMILIES or get_family(family).sized_config is None:
        own, others = _timed_families()
        raise ValueError(f"--family {family!r}: calibrate times the {own} family's blocks{others}")
    return {**dims, "family": family, "budgets": budgets, "short": args.short, "longest": args.longest, "repeats": args.repeats,
            "device": device, "dtype": None if dtype == "auto" else TORCH_DTYPE_NAMES[dtype],
            "compile": bool(args.compile or (cfg is not None and cfg.parallel.compile)), "ac": ac == "full",
            "per_sequence": {"auto": None, "on": True, "off": False}[args.per_sequence], "out": args.out}


def cli(args: argparse.Namespace) -> int:
    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"  timed round {done}/{total}", file=sys.stderr, flush=True)

    if args.validate:
        if args.config or args.set:
            raise ValueError("--validate times in the profile's own recorded mode: leave out --config / --set")
        report = validate(
            args.validate, scale=args.validate_scale, target_s=args.validate_target_s, per_mix=args.per_mix,
            repeats=args.repeats, device=None if args.device == "auto" else args.device, progress=progress,
        )
        print_validation(report, args.max_error)
        if args.json:
            print(json.dumps(report))
        return 0 if report["mean_abs_error"] <= args.max_error else 1
    profile = calibrate(**calibration_args(args), progress=progress)
    print_report(profile)
    if args.json:
        print(json.dumps(profile))
    return 0 if profile["fit"]["cv_mape"] <= args.max_error else 1
