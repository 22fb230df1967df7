"""The GPU check: short bf16 training runs through the torchrun launcher, judged (the
library of ``python3 -m knapray.commands.gpu_check``, ``make gpu-check`` and ``make gpu-bench``).

Each run builds (once) a synthetic corpus, writes a run config, launches
``torch.distributed.run -m knapray.commands.torchrun`` (so it needs neither Ray nor an install:
only torch, numpy, pyarrow and pyyaml) and reads the run's metrics.jsonl. Per run it prints
loss first -> last, tokens/s, model TFLOP/s (the formula is printed with it), recompiles
and peak memory, and the check exits 1 if a step failed, fewer steps ran than asked, the
loss did not fall, or a run with a speed bar stayed below it. The runs:

``eager``          the 1536-wide MMDiT (2 double + 4 single blocks) on mixed-resolution
                   images and videos (4k-20k tokens per step), eager, no FSDP
``fsdp-compile``   a 3072-wide MMDiT (2 double + 4 single, 24 heads) on packed ~16k-token
                   steps, ``parallel.fsdp: full`` (on one rank no FSDP wrapping: autocast
                   over fp32 parameters), compiled blocks: bar 450 TFLOP/s
``fsdp-compile-ac`` the same with every block checkpointed: bar 337.5 TFLOP/s, the first
                   bar times 3/4: recomputation adds a forward (4 passes of work per step)
                   that model FLOPs (3 passes) do not credit
``fsdp-compile-sac`` the same with ``selective`` checkpointing (attention's outputs kept,
                   the rest recomputed): bar 354 TFLOP/s, the first bar times 3 / (3 + the
                   recomputed share of the FLOPs, 0.81 at 4 x 4,293 tokens)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from knapray.models.config import MMDiTConfig
from knapray.models.flops import attention_share, formula, model_tflops_bar
from knapray.quiet_imports import load_torchao_quietly

REPO_ROOT = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 5
"""Leading steps left out of speed numbers (allocator warm-up, kernel selection, compiles)."""


@dataclass(frozen=True)
class Check:
    """One judged training run: model, data, run settings and an optional speed bar."""

    name: str
    model: dict
    mix: str
    scale: int
    corpus_steps: int
    samples_per_step: int
    lr: float
    parallel: dict = field(default_factory=dict)
    """The run config's parallel section (fsdp, compile, activation checkpointing)."""
    min_tflops: float | None = None
    """Bar on the median model TFLOP/s per GPU after warm-up (None: no bar)."""

    @property
    def corpus_key(self) -> str:
        m = self.model
        return f"{self.mix}-s{self.scale}-n{self.corpus_steps}-c{m['in_channels']}-t{m['text_dim']}-p{m['pooled_dim']}"


WIDE = dict(in_channels=16, patch_size=[1, 2, 2], hidden_size=1536, num_heads=24, depth_double=2,
            depth_single=4, text_dim=256, pooled_dim=64, rope_axes_dim=[16, 24, 24])
FLUX_WIDTH = dict(WIDE, hidden_size=3072, rope_axes_dim=[16, 56, 56])
FSDP_COMPILE_BAR = 450.0
"""Model TFLOP/s per GPU (forward+backward CUDA-event time) the compiled FSDP run must reach."""
GPU_CHECKS = (
    # 1k-token images, 4k-token images and 6.4k-token videos (+ up to 392 text tokens).
    Check(name="eager", model=WIDE, mix="g1b4i512f1s0,g1b2i1024f1s0,g1b1i256f85s1", scale=1, corpus_steps=20,
          samples_per_step=4, lr=2e-4),
    # 1024^2 images: 4096 visual + up to 392 text tokens each; 4 per step: ~16.4k-18k tokens.
    Check(name="fsdp-compile", model=FLUX_WIDTH, mix="g1b1i1024f1s0", scale=1, corpus_steps=140,
          samples_per_step=4, lr=1e-4, parallel={"fsdp": "full", "compile": True}, min_tflops=FSDP_COMPILE_BAR),
    # Every block recomputed: the same device throughput does 4 passes of work per step, of
    # which model FLOPs count 3, so the bar is 450 * 3/4 = 337.5 (models.flops.model_tflops_bar).
    Check(name="fsdp-compile-ac", model=FLUX_WIDTH, mix="g1b1i1024f1s0", scale=1, corpus_steps=140,
          samples_per_step=4, lr=1e-4, parallel={"fsdp": "full", "compile": True, "activation_checkpointing": "full"},
          min_tflops=model_tflops_bar(FSDP_COMPILE_BAR, recomputed_fraction=1.0)),
    # Selective: everything but the attention core is recomputed (its share of the model
    # FLOPs at 4 sequences of 4,096 image + ~197 text tokens: 0.19).
    Check(name="fsdp-compile-sac", model=FLUX_WIDTH, mix="g1b1i1024f1s0", scale=1, corpus_steps=140,
          samples_per_step=4, lr=1e-4,
          parallel={"fsdp": "full", "compile": True, "activation_checkpointing": "selective"},
          min_tflops=model_tflops_bar(FSDP_COMPILE_BAR, recomputed_fraction=1.0 - attention_share(
              [4293] * 4, MMDiTConfig.from_dict(FLUX_WIDTH)))),
)
CPU_CHECK = Check(
    name="cpu", model=dict(in_channels=4, patch_size=[1, 2, 2], hidden_size=64, num_heads=4, depth_double=1,
                           depth_single=1, text_dim=32, pooled_dim=32, rope_axes_dim=[4, 6, 6]),
    mix="image+video", scale=8, corpus_steps=2, samples_per_step=2, lr=1e-3,
)


LOG_EVERY = 5
"""The runs' ``metrics.log_every``: a step's wall time is its read window's, shared evenly."""


def profile_window(steps: int) -> list[int]:
    """Three steps after the warm-up (fewer in a shorter run; the last steps if it is all warm-up)."""
    start = min(WARMUP_STEPS, max(0, steps - 3))
    return [start, min(steps, start + 3)]


def write_config(check: Check, corpus: Path, run_root: Path, *, steps: int, topology: str, cpu: bool,
                 profile: bool = False) -> Path:
    cfg = {
        "model": check.model,
        "data": {"corpus": str(corpus), "samples_per_step": check.samples_per_step, "epochs": 1, "seed": 0},
        "balance": {"topology": topology, "coordinator": False},
        "optim": {"lr": check.lr, "grad_clip": 1.0},
        "run": {"name": check.name, "storage": str(run_root), "max_steps": steps},
        "distributed": {"timeout_s": 300},
        "scaling": {"use_gpu": not cpu},
        "parallel": {"precision": "fp32" if cpu else "bf16", **check.parallel},
        # the runs are judged, not resumed: no 15 GB writes
        "checkpoint": {"every": 0, "final": False},
        # Read every LOG_EVERY steps: the steps between never wait for the device.
        "metrics": {"log_every": LOG_EVERY},
    }
    if profile:
        cfg["metrics"]["profile_steps"] = profile_window(steps)
    path = run_root / f"{check.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def judge(records: list[dict], steps: int, cfg: MMDiTConfig, min_tflops: float | None = None
          ) -> tuple[list[str], list[str], dict]:
    """(report lines, failures, the numbers) from rank 0's per-step records."""
    failures = []
    if len(records) < steps:
        failures.append(f"only {len(records)} of {steps} steps ran")
    if not records:
        return [], failures or ["no step ran"], {"steps": 0}
    losses = np.array([r["loss"] for r in records])
    # Judged on the loss relative to predicting zero velocity on the same batch (1.0 at
    # initialization): the raw loss varies more with the step's samples than with learning.
    rel = np.array([r["loss_rel"] for r in records])
    k = min(3, max(1, len(rel) // 4))
    first, last = float(rel[:k].mean()), float(rel[-k:].mean())
    if not np.isfinite(losses).all():
        failures.append("a loss is not finite")
    if not last < first:
        failures.append(f"loss did not fall: relative loss of the first {k} steps {first:.4f}, of the last {k} {last:.4f}")
    body = records[WARMUP_STEPS:] if len(records) > WARMUP_STEPS + 1 else records
    tokens = sum(r["tokens"] for r in body)
    seconds = sum(r["step_s"] for r in body)
    world = records[0]["world_size"]
    tflops = [r["model_tflops_per_gpu"] for r in body]
    fwd_bwd = [r["model_tflops_fwd_bwd_per_gpu"] for r in body]
    median, median_fb = float(np.median(tflops)), float(np.median(fwd_bwd))
    peaks = [r["peak_mem_gib"] for r in records if r.get("peak_mem_gib") is not None]
    mfu = [r["mfu"] for r in body if r.get("mfu") is not None]
    lines = [
        f"steps                {len(records)} ({records[0]['clock']} timing, world {world}, topology {records[0]['topology']})",
        f"loss first -> last   {losses[0]:.4f} -> {losses[-1]:.4f}",
        f"relative loss        {first:.4f} -> {last:.4f} (mean of the first / last {k} steps; loss over the "
        "loss of predicting zero velocity on the same batch)",
        f"tokens/s             {tokens / seconds:,.0f} (steps {WARMUP_STEPS}.., {tokens / len(body):,.0f} tokens per step)",
        f"model TFLOP/s/GPU    median {median:.3g}, mean {np.mean(tflops):.3g}, best {np.max(tflops):.3g}"
        + (f" (MFU median {np.median(mfu):.1%})" if mfu else ""),
        f"                     {formula(cfg)}, over the step's wall time",
        f"  forward+backward   median {median_fb:.3g} model TFLOP/s/GPU: the same FLOPs over the slowest rank's "
        f"forward+backward\n                     ({records[0]['clock']}; without the optimizer step and batch "
        "preparation, which the wall time includes)",
        f"wall / fwd+bwd       {median / median_fb:.3f} (the wall-time median over the forward+backward one; "
        f"goal >= 0.95: the host adds at most 5%; read every {LOG_EVERY} steps)" if median_fb > 0 else
        "wall / fwd+bwd       n/a",
        f"recompiles           {records[-1].get('recompiles', 0)}",
        f"peak memory          {max(peaks):.2f} GiB (rank 0, allocated)" if peaks else "peak memory          n/a (CPU)",
        f"attention            {_attention_kinds(body)}",
    ]
    numbers = {"steps": len(records), "world_size": world, "clock": records[0]["clock"], "loss_first": float(losses[0]),
               "loss_last": float(losses[-1]), "loss_rel_first": first, "loss_rel_last": last,
               "tokens_per_s": tokens / seconds if seconds > 0 else None, "tokens_per_step": tokens / len(body),
               "model_tflops_per_gpu": median, "model_tflops_fwd_bwd_per_gpu": median_fb,
               "wall_over_fwd_bwd": median / median_fb if median_fb > 0 else None,
               "formula": formula(cfg), "recompiles": records[-1].get("recompiles", 0),
               "peak_mem_gib": max(peaks) if peaks else None, "bar_tflops": min_tflops,
               "attention": _attention_kinds(body)}
    if min_tflops is not None:
        # The bars are the blocks' throughput (what issue 11 measured on blocks): judged on
        # forward+backward; the wall-time figure above is reported beside it.
        met = median_fb >= min_tflops
        lines.append(f"bar                  forward+backward median >= {min_tflops:g} TFLOP/s/GPU: "
                     f"{'met' if met else 'NOT met'} (wall-time median {median:.1f})")
        if not met:
            failures.append(f"forward+backward median {median_fb:.1f} model TFLOP/s/GPU, below the bar of {min_tflops:g}")
    return lines, failures, numbers


def _attention_kinds(records: list[dict]) -> str:
    """Which attention kernels the steps took (``knapray.attention.choose_backend``), with
    the last step's reason."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("attention") or "?"] = counts.get(r.get("attention") or "?", 0) + 1
    last = next((r["attention_reason"] for r in reversed(records) if r.get("attention_reason")), "")
    return ", ".join(f"{k} x{n}" for k, n in counts.items()) + (f" (last: {last})" if last else "")


def run_check(check: Check, work: Path, *, steps: int, nproc: int, topology: str, cpu: bool, timeout: float,
              profile: bool = False) -> tuple[list[str], dict]:
    """Run one check; prints its report and returns its failures and numbers."""
    corpus = work / f"corpus-{check.corpus_key}"
    if not (corpus / "schema.json").exists():
        from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

        t0 = time.perf_counter()
        build_synthetic(SyntheticConfig(mix=check.mix, steps=check.corpus_steps, scale=check.scale,
                                        channels=check.model["in_channels"], text_dim=check.model["text_dim"],
                                        pooled_dim=check.model["pooled_dim"], shards=4, seed=0), corpus, progress=False)
        print(f"corpus: {check.mix} at 1/{check.scale} scale built in {time.perf_counter() - t0:.1f} s", flush=True)
    config = write_config(check, corpus, work, steps=steps, topology=topology, cpu=cpu, profile=profile)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={work / 'torchrun-logs'}",  # not a torchelastic_* folder left in /tmp
           "-m", "knapray.commands.torchrun", "--config", str(config)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", _host_threads(nproc, cpu)))
    print(f"== {check.name}: {json.dumps(check.parallel) if check.parallel else 'eager, no FSDP'}; "
          f"d={check.model['hidden_size']}, {check.model['depth_double']}+{check.model['depth_single']} blocks", flush=True)
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    # Its own session: on a timeout the whole tree goes (torchrun and the rank processes
    # under it, which would otherwise keep the GPU's memory for the next run).
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        _stop_tree(proc)
        rc = 124
        print(f"training stopped: out of the check's time ({timeout:.0f} s were left)", flush=True)
    print(f"training exited with {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
    metrics = work / check.name / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    lines, failures, numbers = judge(records, steps, MMDiTConfig.from_dict(check.model), check.min_tflops)
    if rc != 0:
        failures.insert(0, f"the training run exited with {rc}")
    print("\n".join(lines))
    line, ceiling = ceiling_line(check, records, nproc, cpu)
    if line:
        print(line)
    numbers.update(name=check.name, parallel=check.parallel, model=check.model, exit_code=rc, ceiling=ceiling,
                   seconds=time.perf_counter() - t0)
    summary = work / check.name / "profile" / "rank0.json"
    if profile:
        if summary.exists():
            from knapray.worker.profiling import format_summary

            numbers["profile"] = json.loads(summary.read_text())
            print(f"profile (rank 0):\n{format_summary(numbers['profile'], top=TOP_KERNELS)}")
        else:
            print("profile: none written")
    print(f"{check.name}: {'FAILED: ' + '; '.join(failures) if failures else 'passed'}", flush=True)
    numbers["failures"] = failures
    return [f"{check.name}: {f}" for f in failures], numbers


TOP_KERNELS = 10
"""Kernels listed per profiled run."""


def ceiling_line(check: Check, records: list[dict], nproc: int, cpu: bool) -> tuple[str | None, dict | None]:
    """The run's forward+backward speed over the kernel ceiling measured here, now, at the
    run's shape (``knapray bench kernels`` with the attention training picks): a ratio that
    holds on any GPU, where the bars are absolute."""
    from knapray.testing.kernels import run as kernel_ceiling

    body = records[WARMUP_STEPS:] if len(records) > WARMUP_STEPS + 1 else records
    if not body:
        return None, None
    n = check.samples_per_step * nproc
    length = max(1, round(float(np.median([r["tokens"] for r in body])) / n))
    m = check.model
    import torch

    from knapray.attention import choose_backend

    dtype, device = (torch.float32, torch.device("cpu")) if cpu else (torch.bfloat16, torch.device("cuda"))
    picked = choose_backend((length,) * n, device, dtype, m["num_heads"], m["hidden_size"] // m["num_heads"],
                            remember=False).backend  # as a training step on these sequences picks
    r = kernel_ceiling(hidden=m["hidden_size"], heads=m["num_heads"], lengths=(length,) * n, dtype=dtype,
                       device=device, warmup=1 if cpu else 3, repeat=2 if cpu else 10, backends=[picked])
    ceiling = r["ceiling_tflops"]
    if not ceiling:
        return None, None
    numbers = {"tflops": ceiling, "sequences": n, "length": length, "attention": r["best_attention"], "share": None}
    head = (f"kernel ceiling       {ceiling:.3g} model TFLOP/s: this device's matmuls and attention alone at the "
            f"run's width, {n} sequences of {length} tokens (knapray bench kernels)")
    if cpu:  # thread time of a tiny model against wall time of single ops: no ratio to read
        return head + "; not compared on CPU", numbers
    fb = float(np.median([r["model_tflops_fwd_bwd_per_gpu"] for r in body]))
    numbers["share"] = fb / ceiling
    return head + f"; forward+backward reached {100 * fb / ceiling:.0f}% of it", numbers


def _host_threads(nproc: int, cpu: bool) -> str:
    """CPU threads per rank: on a GPU machine the cores are the ranks' to share (the 3072-wide
    model is built and initialized on the host: ~11 s on one thread), on CPU one each."""
    return "1" if cpu else str(max(1, min(8, (os.cpu_count() or 1) // nproc)))


def _stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it if still there after 10 s."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


GRADIENT_CASES = (("flux", "bf16_params"), ("wan", "bf16_params"), ("flux", "autocast"))
"""What ``--bench`` compares on the device first: FSDP's bf16 parameters (every shipped
cluster config) for both families, and Flux under autocast (the runs without FSDP)."""


def _failed(what: str, e: BaseException) -> None:
    """A stage's failure in the bench's log: one line, then where it was raised (the last
    frames of its traceback: on the GPU machine there is no second look)."""
    import traceback

    print(f"{what}: FAILED to run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    frames = traceback.extract_tb(e.__traceback__)[-6:]
    print("".join("    " + line for line in traceback.format_list(frames)), end="", flush=True)


def gradient_stage(report: dict, *, cpu: bool) -> list[str]:
    """Compiled bf16 gradients against float64 on the device (``knapray.testing.grad_truth``):
    one line per case, the numbers into ``report``; the failures."""
    from knapray.testing.grad_truth import gradient_errors

    print("== gradients: compiled bf16 against a float64 eager copy, every parameter "
          "(knapray.testing.grad_truth)", flush=True)
    failures = []
    # The CPU rehearsal checks the chain with one case (each compiles for 30-90 s here).
    for family, mode in GRADIENT_CASES[1:2] if cpu else GRADIENT_CASES:
        t0 = time.perf_counter()
        try:
            # On CPU (the rehearsal) shorter sequences: the chain, not the numbers, is checked.
            r = gradient_errors(family, mode, device="cpu" if cpu else "cuda", side=32 if cpu else 96)
        except Exception as e:  # noqa: BLE001 - one case's failure is reported, the bench goes on
            _failed(f"{family} {mode}", e)
            failures.append(f"gradients {family} {mode}: {type(e).__name__}")
            report["gradients"].append({"family": family, "mode": mode, "error": repr(e)})
            continue
        print(f"{r.summary()} ({time.perf_counter() - t0:.0f} s)", flush=True)
        report["gradients"].append({"family": family, "mode": mode, "tokens": r.tokens, "yardstick": r.yardstick,
                                    "worst": list(r.worst), "ratio": r.ratio, "passed": r.passed,
                                    "errors": r.errors})
        if not r.passed:
            failures.append(f"gradients {family} {mode}: ratio {r.ratio:.2f}")
    return failures


def fp8_stage(report: dict, *, cpu: bool) -> list[str]:
    """``parallel.fp8`` on the device: its gradient check against float64 (Flux, tensorwise;
    bound ``FP8_YARDSTICK``, ratio ``RATIO_BAR``), then a block's matmuls in float8 against
    bf16 at Wan 14B's width (``knapray.testing.kernels.float8_matmuls``; the speed-up is
    reported against its goal, not failed). Skipped where torchao is not importable."""
    from knapray.testing.grad_truth import RATIO_BAR, gradient_errors
    from knapray.testing.kernels import float8_matmuls, float8_report
    from knapray.worker.float8 import check_available

    missing = check_available()
    print("== fp8: parallel.fp8's gradients against float64, then float8 matmuls against bf16", flush=True)
    if missing:
        print(f"fp8: not run: {missing}")
        report["fp8"] = {"skipped": missing}
        return []
    failures = []
    t0 = time.perf_counter()
    try:
        # The CPU rehearsal checks the chain, eagerly (tests/unit/test_float8.py checks it compiled).
        r = gradient_errors("flux", "bf16_params", device="cpu" if cpu else "cuda", side=32 if cpu else 96,
                            fp8="tensorwise", compile=not cpu)
        print(f"{r.summary()} ({time.perf_counter() - t0:.0f} s)", flush=True)
        ok = r.yardstick < FP8_YARDSTICK and r.ratio <= RATIO_BAR
        report["fp8"] = {"gradients": {"yardstick": r.yardstick, "worst": list(r.worst), "ratio": r.ratio,
                                       "passed": ok}}
        if not ok:
            failures.append(f"fp8 gradients: float8 matmuls {r.yardstick:.3f} (bound {FP8_YARDSTICK}), "
                            f"ratio {r.ratio:.2f}")
        m = float8_matmuls(device="cpu" if cpu else "cuda",
                           **({"hidden": 64, "tokens": 256, "compile": False, "warmup": 1, "repeat": 2} if cpu else {}))
        print(float8_report(m), flush=True)
        report["fp8"]["matmuls"] = m
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on
        _failed("fp8", e)
        failures.append(f"fp8: {type(e).__name__}")
    return failures


FP8_STAGE_S = 90
"""Seconds the fp8 stage needs on a GPU (its gradient check and three compiles); not started with less."""
FP8_YARDSTICK = 0.12
"""``parallel.fp8``'s float8 matmuls' weight gradients against float64: at most this off
(e4m3's 3 mantissa bits; 0.07-0.09 measured on CPU, tests/unit/test_float8.py)."""


SAMPLING_TRUTHS = (("flux", None), ("wan", None), ("wan", {"text_pad_to": 128}))
"""The sampling section's forward truths: each family's small model, and Wan with its text
padded (its cross-attention then adds one key per sequence for the padding rows, with a float
bias in SDPA's mask: a path whose GPU kernels the small config, unpadded, never takes)."""


SAMPLE_REHEARSAL = {"hidden": 64, "heads": 2, "double": 1, "single": 1, "side": 64, "text": 8, "steps": 3}
"""The sampling section's shape on the CPU rehearsal (the chain, not the numbers)."""


def sampling_stage(report: dict, *, cpu: bool, deadline: float | None = None) -> list[str]:
    """Sampling on the device: the forward truth of a compiled bf16 trajectory against
    float64 per family (``knapray.testing.sample_truth``), then a FLUX.1-dev-shaped model at
    1024², 28 steps, knapray beside diffusers' transformer (``sample_bench.flux_side_by_side``;
    diffusers must be importable: carried as wheels, ``GPU_WHEELS``). One line per result, the
    numbers into ``report["sampling"]``; the failures."""
    from knapray.testing.sample_bench import FLUX_DEV, flux_side_by_side
    from knapray.testing.sample_truth import trajectory_errors

    device = "cpu" if cpu else "cuda"
    print("== sampling: compiled bf16 trajectories against float64 (knapray.testing.sample_truth), then "
          "knapray beside diffusers (knapray.testing.sample_bench)", flush=True)
    out = report.setdefault("sampling", {"truth": [], "flux": None})
    failures = []
    for family, config in SAMPLING_TRUTHS:
        name = family + (f" ({', '.join(f'{k} {v}' for k, v in config.items())})" if config else "")
        t0 = time.perf_counter()
        try:
            r = trajectory_errors(family, device=device, compile=True, side=32 if cpu else 96, config=config)
        except Exception as e:  # noqa: BLE001 - reported, the bench goes on
            _failed(name, e)
            failures.append(f"sampling truth {name}: {type(e).__name__}")
            continue
        print(f"{r.summary()}{f' [{name}]' if config else ''} ({time.perf_counter() - t0:.0f} s)", flush=True)
        out["truth"].append({"family": family, "config": config, "tokens": r.tokens, "errors": r.errors,
                             "yardstick": r.yardstick, "ratios": r.ratios, "final_error": r.final_error,
                             "passed": r.passed})
        if not r.passed:
            failures.append(f"sampling truth {name}: ratio {max(r.ratios):.2f}")
    if deadline is not None and deadline - time.monotonic() < 120:
        print("== sampling side by side: not run, too little of the bench's time left", flush=True)
        return failures + ["sampling side by side: not run (out of time)"]
    try:
        load_torchao_quietly()
        import diffusers  # noqa: F401
    except ImportError:
        print("== sampling side by side: not run, diffusers is not importable here (carry its wheels: GPU_WHEELS)")
        return failures + ["sampling side by side: diffusers missing"]
    try:
        out["flux"] = flux_side_by_side(SAMPLE_REHEARSAL if cpu else FLUX_DEV, device, repeats=1 if cpu else 2,
                                        log=lambda line: print(line, flush=True))
    except Exception as e:  # noqa: BLE001
        _failed("sampling side by side", e)
        failures.append(f"sampling side by side: {type(e).__name__}")
    return failures


def attention_packages() -> dict[str, str]:
    """The optional attention packages this Python finds (flash-attn 2, FA3's
    ``flash_attn_interface``, FA4's ``flash_attn.cute``) and what torch's flash kernels are
    routed to once knapray activates what it can (``knapray.attention.activate_flash_impl``)."""
    import importlib.util

    import torch

    from knapray.attention import FLASH_UNUSABLE, activate_flash_impl

    found = {}
    for label, module in (("flash-attn", "flash_attn"), ("FA3", "flash_attn_interface"), ("FA4", "flash_attn.cute")):
        try:
            found[label] = "installed" if importlib.util.find_spec(module) is not None else "absent"
        except (ImportError, ValueError):
            found[label] = "absent"
    impl = activate_flash_impl("cuda") if torch.cuda.is_available() else None
    found["torch flash kernels"] = impl or "torch's own (FA2)"
    for name, why in FLASH_UNUSABLE.items():
        found[f"{name} not loadable"] = why
    return found


def checkout_commit() -> str | None:
    """The checkout's commit (a copy without git: None)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None

