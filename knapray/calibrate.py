"""``knapray calibrate``: time the model's blocks on this device and fit the cost model.

For each length ``L`` it runs forward + backward of ``MMDiT.blocks`` (every double- and
single-stream block, attention through ``knapray.attention``) on one sequence of ``L``
tokens (1/8 text), takes the fastest of ``repeats`` runs, and fits by least squares on
relative error (every length counts alike)::

    t(L) = overhead + layers · (a·L + b·L²),   a, b, overhead >= 0

The profile JSON it writes carries the fit as a ``cost_model`` section that
``CostModel.from_profile`` loads (``linear_s = a``, ``attn_s = b``,
``step_overhead_s = overhead``, the model's width, depth and heads), the measurements,
the fit's mean absolute percentage error, and what it was measured on (device, dtype,
threads, torch version, attention backend). Communication constants are not measured
here; they keep the ``CostModel`` defaults unless overridden.

Timing: on CPU, one intra-op thread and the calling thread's CPU time
(``time.thread_time``: other processes sharing the cores do not inflate it); on CUDA,
wall time between synchronizations. ``recompute=True`` adds a forward pass without
gradients per step, as activation checkpointing would.
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from typing import Sequence

import numpy as np
import torch

from knapray.attention import LocalAttention, _resolve_backend
from knapray.models import MMDiT, MMDiTConfig

CPU_LENGTHS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
GPU_LENGTHS = (512, 1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)
FORMAT = "knapray-cost-profile/1"


def calibration_config(hidden: int, heads: int, depth_double: int, depth_single: int) -> MMDiTConfig:
    """An MMDiT of the given size with RoPE channels split over (t, h, w)."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}")
    head_dim = hidden // heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim {head_dim} (hidden/heads) must be even and >= 6")
    side = (head_dim * 3 // 8) // 2 * 2
    return MMDiTConfig(
        in_channels=4, patch_size=(1, 2, 2), hidden_size=hidden, num_heads=heads,
        depth_double=depth_double, depth_single=depth_single, text_dim=16, pooled_dim=16,
        rope_axes_dim=(head_dim - 2 * side, side, side),
    )


def fit(lengths: Sequence[int], seconds: Sequence[float], layers: int) -> dict:
    """Least squares on relative error of ``t = c + layers·(a·L + b·L²)``, coefficients >= 0."""
    L = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if L.size < 3 or L.size != t.size:
        raise ValueError(f"need >= 3 (length, seconds) pairs to fit 3 coefficients, got {L.size} and {t.size}")
    if np.any(t <= 0):
        raise ValueError("measured times must be > 0")
    basis = np.stack([np.ones_like(L), layers * L, layers * L * L], axis=1)
    w = 1.0 / t
    best = None
    # Non-negative least squares by trying every subset of free coefficients (3 of them).
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(basis[:, cols] * w[:, None], np.ones_like(t), rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(3)
        full[cols] = coef
        pred = basis @ full
        err = float(np.mean(((pred - t) / t) ** 2))
        if best is None or err < best[0]:
            best = (err, full, pred)
    _, (c, a, b), pred = best
    ape = np.abs(pred - t) / t
    return {
        "linear_s_per_token_per_layer": float(a),
        "attn_s_per_pair_per_layer": float(b),
        "overhead_s": float(c),
        "mape": float(ape.mean()),
        "max_ape": float(ape.max()),
        "fit_seconds": pred.tolist(),
    }


def calibrate(
    hidden: int = 128,
    heads: int = 4,
    depth_double: int = 1,
    depth_single: int = 1,
    lengths: Sequence[int] | None = None,
    repeats: int = 3,
    device: str | None = None,
    dtype: str | None = None,
    out: str | None = None,
    recompute: bool = False,
    seed: int = 0,
) -> dict:
    """Measure, fit, and (if ``out``) write the profile; returns it."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = dev.type == "cuda"
    dtype = dtype or ("bfloat16" if on_gpu else "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    lengths = sorted(set(int(x) for x in (lengths or (GPU_LENGTHS if on_gpu else CPU_LENGTHS))))
    if len(lengths) < 3 or lengths[0] < 8:
        raise ValueError(f"need >= 3 distinct lengths, each >= 8, got {lengths}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cfg = calibration_config(hidden, heads, depth_double, depth_single)
    layers = depth_double + depth_single
    torch.manual_seed(seed)
    model = MMDiT(cfg).to(device=dev, dtype=torch_dtype)
    model.init_weights(std=0.02)  # non-degenerate: no all-zero modulation shortcuts
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        runs = []
        for L in lengths:
            run, backend = _step_fn(model, cfg, L, dev, torch_dtype, recompute)
            run()  # warm-up (allocations, kernel selection)
            runs.append(run)
        # Round robin over lengths, so a burst of load elsewhere hits one repeat of every
        # length rather than every repeat of one; the fastest repeat is the least disturbed.
        samples: list[list[float]] = [[] for _ in lengths]
        for _ in range(repeats):
            for i, run in enumerate(runs):
                samples[i].append(_timed(run, dev, on_gpu))
        seconds = [min(x) for x in samples]
    finally:
        torch.set_num_threads(threads)
    result = fit(lengths, seconds, layers)
    device_name = torch.cuda.get_device_name(dev) if on_gpu else (platform.processor() or platform.machine())
    profile = {
        "format": FORMAT,
        "measured_on": {
            "device": str(dev),
            "device_name": device_name,
            "dtype": dtype,
            "threads": torch.get_num_threads() if on_gpu else 1,
            "timer": "wall time between CUDA synchronizations" if on_gpu else "thread CPU time (time.thread_time)",
            "attention_backend": backend,
            "torch": torch.__version__,
            "host": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "model": {
            "hidden_size": hidden, "num_heads": heads, "depth_double": depth_double, "depth_single": depth_single,
            "mlp_ratio": cfg.mlp_ratio,
        },
        "passes": "forward + backward of all blocks" + (" + a recomputed forward" if recompute else ""),
        "repeats": repeats,
        "lengths": lengths,
        "seconds": seconds,
        "fit": result,
        "cost_model": {
            "d_model": hidden,
            "num_heads": heads,
            "double_blocks": depth_double,
            "single_blocks": depth_single,
            "linear_s": result["linear_s_per_token_per_layer"],
            "attn_s": result["attn_s_per_pair_per_layer"],
            "step_overhead_s": result["overhead_s"],
            "activation_bytes": torch.tensor([], dtype=torch_dtype).element_size(),
        },
        "command": _command(hidden, heads, depth_double, depth_single, lengths, repeats, str(dev), dtype, out, recompute),
    }
    if out:
        with open(out, "w") as f:
            json.dump(profile, f, indent=1)
    return profile


def print_report(profile: dict) -> None:
    m, f = profile["measured_on"], profile["fit"]
    print(f"calibration on {m['device']} ({m['device_name']}), {m['dtype']}, attention {m['attention_backend']}, "
          f"{profile['model']}")
    print(f"{'length':>8} {'measured s':>12} {'fit s':>12} {'error':>8}")
    for L, t, p in zip(profile["lengths"], profile["seconds"], f["fit_seconds"]):
        print(f"{L:>8} {t:>12.6f} {p:>12.6f} {(p - t) / t:>+8.2%}")
    print(f"fit: t(L) = {f['overhead_s']:.3e} + {profile['cost_model']['double_blocks'] + profile['cost_model']['single_blocks']}"
          f" x ({f['linear_s_per_token_per_layer']:.3e} L + {f['attn_s_per_pair_per_layer']:.3e} L^2) s")
    print(f"mean abs. error {f['mape']:.2%}, worst {f['max_ape']:.2%}")
    print(f"command: {profile['command']}")


def _timed(run, dev, on_gpu: bool) -> float:
    if on_gpu:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0
    t0 = time.thread_time()
    run()
    return time.thread_time() - t0


def _step_fn(model: MMDiT, cfg: MMDiTConfig, L: int, dev, dtype, recompute: bool):
    """A closure running forward + backward of the blocks on one sequence of ``L`` tokens."""
    n_txt = L // 8
    d = cfg.hidden_size
    gen = torch.Generator().manual_seed(L)
    h0 = torch.randn(L, d, generator=gen).to(device=dev, dtype=dtype)
    vec = torch.randn(1, d, generator=gen).to(device=dev, dtype=dtype)
    seq_index = torch.zeros(L, dtype=torch.long, device=dev)
    is_text = torch.zeros(L, dtype=torch.bool, device=dev)
    is_text[:n_txt] = True
    side = max(1, int(np.sqrt(L - n_txt)))
    img = torch.arange(L - n_txt, device=dev)
    pos = torch.zeros(L, 3, dtype=torch.long, device=dev)
    pos[n_txt:, 1], pos[n_txt:, 2] = img // side, img % side
    cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
    attn = LocalAttention(cu, L)
    probe = torch.zeros(1, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
    backend = _resolve_backend("auto", probe)

    def run() -> None:
        h = h0.detach().requires_grad_(True)
        out = model.blocks(h, vec, seq_index, pos, is_text, attn)
        out.float().square().mean().backward()
        if recompute:
            with torch.no_grad():
                model.blocks(h0, vec, seq_index, pos, is_text, attn)
        model.zero_grad(set_to_none=True)

    return run, backend


def _command(hidden, heads, dd, ds, lengths, repeats, device, dtype, out, recompute) -> str:
    parts = [
        "knapray calibrate", f"--hidden {hidden}", f"--heads {heads}", f"--depth-double {dd}",
        f"--depth-single {ds}", "--lengths " + ",".join(str(x) for x in lengths), f"--repeats {repeats}",
        f"--device {device}", f"--dtype {dtype}",
    ]
    if recompute:
        parts.append("--recompute")
    if out:
        parts.append(f"--out {out}")
    return " ".join(parts)
