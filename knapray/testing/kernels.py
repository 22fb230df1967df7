"""Kernel ceiling: what a transformer block's matrix products and attention reach alone.

A DiT block's model FLOPs (``knapray.models.flops``: ``24*L*d^2 + 4*L^2*d`` forward, x3 for
forward + backward) are four matrix products per token (q/k/v, output projection, the MLP's
two) and attention per sequence. This benchmark times exactly those, forward + backward,
at a run's shape (width, heads, packed sequence lengths) in the run's dtype:

- each matrix product alone, as ``x @ w`` with both inputs requiring gradients;
- varlen attention over the packed sequences, per available backend
  (``knapray.attention``: ``torch_varlen``, ``flash`` where installed, ``sdpa``);

and prints each piece's model TFLOP/s beside the *ceiling*: the block's model FLOPs over
the summed times of its pieces (the best attention backend), i.e. the speed a step would
reach if everything else (norms, RoPE, modulation, activations, the optimizer, the host)
were free. A training run's model TFLOP/s over this ceiling is the share of the device's
reachable speed it gets; ``knapray.testing.gpu_check`` prints its runs' numbers for the
same shape.

    knapray bench kernels                       # the GPU check's Flux-width shape, bf16
    knapray bench kernels --hidden 5120 --heads 40 --seq-lens 32760   # a Wan 14B 81-frame 720p clip

Timed with CUDA events on a GPU (median of ``--repeat`` after ``--warmup``), wall clock on CPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from knapray.quiet_imports import load_torchao_quietly

DEFAULT_HIDDEN = 3072
DEFAULT_HEADS = 24
MAX_REPEAT = 1000
"""Largest --warmup / --repeat."""
DEFAULT_LENGTHS = (4292, 4292, 4292, 4292)
"""The GPU check's ``fsdp-compile`` steps: four 1024x1024 images, 4096 visual tokens each
plus their text (17,166 tokens per step)."""


def _timer(device: torch.device) -> Callable[[Callable[[], None], int, int], float]:
    """A function timing ``fn`` (seconds, the median over ``repeat`` after ``warmup``)."""

    def cuda_time(fn: Callable[[], None], warmup: int, repeat: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def wall_time(fn: Callable[[], None], warmup: int, repeat: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cuda_time if device.type == "cuda" else wall_time


def matmul_shapes(hidden: int, mlp_ratio: float = 4.0) -> list[tuple[str, int, int]]:
    """(name, in, out) of a block's matrix products per token: 24*d^2 FLOPs forward in all."""
    m = int(hidden * mlp_ratio)
    return [("qkv", hidden, 3 * hidden), ("out", hidden, hidden), ("mlp_up", hidden, m), ("mlp_down", m, hidden)]


def run(*, hidden: int = DEFAULT_HIDDEN, heads: int = DEFAULT_HEADS, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
        dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", warmup: int = 3,
        repeat: int = 10, backends: list[str] | None = None) -> dict:
    """Time the pieces; ``backends``: the attention backends to time (default: every one
    available; ``["auto"]``: the one training picks)."""
    from knapray.attention import (activate_flash_impl, available_backends, choose_backend, flash_impl,
                                   restore_flash_impl, varlen_attention)

    device = torch.device(device)
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not a multiple of --heads {heads}")
    timed = _timer(device)
    tokens = sum(lengths)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=dtype)

    pieces = []
    for name, k, n in matmul_shapes(hidden):
        x, w, g = rand(tokens, k).requires_grad_(), rand(k, n).requires_grad_(), rand(tokens, n)

        def step(x=x, w=w, g=g) -> None:
            (x @ w).backward(g)
            x.grad = w.grad = None

        seconds = timed(step, warmup, repeat)
        flops = 3 * 2 * tokens * k * n
        pieces.append({"piece": f"matmul {name} ({tokens}x{k} @ {k}x{n})", "kind": "matmul", "seconds": seconds,
                       "model_flops": flops})

    head_dim = hidden // heads
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    attn_flops = 3 * 4 * sum(L * L for L in lengths) * hidden
    if backends is None:
        backends = available_backends(device) if device.type == "cuda" and dtype != torch.float32 else ["sdpa"]
    runs = [(backend, None) for backend in backends]
    if "torch_varlen" in backends and flash_impl() is None:
        # torch's flash kernels routed to FA3 / FA4 where installed: timed as one more backend
        impl = activate_flash_impl(device)
        if impl is not None and restore_flash_impl():  # (torch 2.10 cannot restore FA2: timed as it is)
            runs.append(("torch_varlen", impl))
    for backend, impl in runs:
        if impl is not None:
            activate_flash_impl(device)
        q, k_, v = (rand(tokens, heads, head_dim).requires_grad_() for _ in range(3))
        g = rand(tokens, heads, head_dim)

        def step(q=q, k_=k_, v=v, g=g, backend=backend) -> None:
            varlen_attention(q, k_, v, cu, max(lengths), backend=backend).backward(g)
            q.grad = k_.grad = v.grad = None

        label = backend if impl is None else f"{backend}+{impl}"
        try:
            seconds = timed(step, warmup, repeat)
        except (RuntimeError, NotImplementedError) as e:  # a backend that refuses this shape or dtype
            pieces.append({"piece": f"attention {label}", "kind": "attention", "error": str(e).splitlines()[0]})
            continue
        finally:
            if impl is not None:
                restore_flash_impl()
        pieces.append({"piece": f"attention {label} ({len(lengths)} seqs, {heads}x{head_dim})", "kind": "attention",
                       "backend": label, "seconds": seconds, "model_flops": attn_flops})
    choice = choose_backend(lengths, device, dtype, heads, head_dim, remember=False)
    mm = sum(p["seconds"] for p in pieces if p["kind"] == "matmul")
    attn = [p for p in pieces if p["kind"] == "attention" and "seconds" in p]
    best = min(attn, key=lambda p: p["seconds"]) if attn else None
    block_flops = 3 * (24 * tokens * hidden * hidden + 4 * sum(L * L for L in lengths) * hidden)
    ceiling = block_flops / (mm + best["seconds"]) / 1e12 if best else None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "hidden": hidden, "heads": heads,
            "lengths": list(lengths), "pieces": pieces, "best_attention": best["backend"] if best else None,
            "ceiling_tflops": ceiling, "step_choice": {"backend": choice.backend, "reason": choice.reason},
            "attention_share": best["seconds"] / (mm + best["seconds"]) if best else None}


FP8_SHAPE = {"hidden": 5120, "tokens": 16384}
"""Wan 2.1 14B's width (40 heads of 128) and a step's ~16k tokens per GPU: where ``make
gpu-bench`` sets float8 against bf16."""
FP8_GOAL = 1.25
"""The speed-up over bf16 the float8 matmuls should reach there (issue goal, a GPU's)."""


def float8_matmuls(*, hidden: int = FP8_SHAPE["hidden"], tokens: int = FP8_SHAPE["tokens"],
                   device: str | torch.device = "cuda", warmup: int = 3, repeat: int = 10,
                   compile: bool = True) -> dict:
    """A block's four matrix products (``matmul_shapes``), forward + backward over ``tokens``
    rows, as the training run computes them: ``nn.Linear`` in bf16 against torchao's
    ``Float8Linear`` as ``parallel.fp8`` configures it (``knapray.worker.float8``: forward and
    input gradient in float8, the weight gradient in bf16), each scaling; the four compiled
    together (one compile per variant: torchao's casts fuse only compiled; ``compile=False``:
    eager, the chain alone, as the CPU rehearsal runs it). The seconds of each variant and the
    ratios bf16 / float8."""
    import torch.nn as nn
    load_torchao_quietly()
    from torchao.float8 import convert_to_float8_training

    from knapray.worker.float8 import SCALINGS, _config

    device = torch.device(device)
    timed = _timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = matmul_shapes(hidden)
    weights = [(torch.randn(n, k, generator=gen) * k ** -0.5, torch.zeros(n)) for _, k, n in shapes]
    xs = [(torch.randn(tokens, k, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16).requires_grad_()
          for _, k, _ in shapes]
    gs = [torch.randn(tokens, n, generator=gen).to(device=device, dtype=torch.bfloat16) for _, _, n in shapes]
    seconds = {}
    for label, scaling in (("bf16", None), *((s, s) for s in SCALINGS)):
        layers = nn.ModuleList(nn.Linear(k, n) for _, k, n in shapes)
        with torch.no_grad():
            for layer, (w, b) in zip(layers, weights):
                layer.weight.copy_(w)
                layer.bias.copy_(b)
        layers = layers.to(device=device, dtype=torch.bfloat16)
        if scaling is not None:
            convert_to_float8_training(layers, config=_config(scaling, fsdp=False))
        def block(xs, layers=layers):
            return [layer(x) for layer, x in zip(layers, xs)]

        if compile:
            torch._dynamo.reset()  # each variant compiled afresh
            block = torch.compile(block)

        def step(block=block) -> None:
            torch.autograd.backward(block(xs), gs)
            for x in xs:
                x.grad = None

        seconds[label] = timed(step, warmup, repeat)
    flops = sum(3 * 2 * tokens * k * n for _, k, n in shapes)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "hidden": hidden, "tokens": tokens, "compiled": compile,
            "shapes": [f"{name} {k}x{n}" for name, k, n in shapes], "model_flops": flops, "seconds": seconds,
            "speedup": {s: seconds["bf16"] / seconds[s] for s in SCALINGS}, "goal": FP8_GOAL}


def float8_report(r: dict) -> str:
    from knapray.worker.float8 import SCALINGS

    cells = ", ".join(f"{label} {t * 1e3:.3f} ms ({r['model_flops'] / t / 1e12:.1f} model TFLOP/s)"
                      for label, t in r["seconds"].items())
    return (f"float8 against bf16 on {r['device']} (torch {r['torch']}): a block's four matmuls "
            f"({', '.join(r['shapes'])}) over {r['tokens']} tokens, forward + backward, "
            f"{'compiled' if r.get('compiled', True) else 'eager'}: {cells}\n"
            "bf16 / float8: " + ", ".join(f"{s} {r['speedup'][s]:.2f}x" for s in SCALINGS)
            + f" (goal >= {r['goal']:g}x on a GPU; forward and input gradient in float8, the weight gradient in "
            "bf16: knapray.worker.float8)")


def report(r: dict) -> str:
    lines = [f"kernel ceiling on {r['device']} (torch {r['torch']}, {r['dtype']}): d={r['hidden']}, "
             f"{r['heads']} heads, sequences {r['lengths']} ({sum(r['lengths'])} tokens)",
             f"{'piece':<58} {'ms':>8} {'model TFLOP/s':>14}"]
    for p in r["pieces"]:
        if "error" in p:
            lines.append(f"{p['piece']:<58} {'-':>8} {'refused: ' + p['error'][:60]}")
            continue
        lines.append(f"{p['piece']:<58} {p['seconds'] * 1e3:8.3f} {p['model_flops'] / p['seconds'] / 1e12:14.1f}")
    if r["ceiling_tflops"] is not None:
        lines.append(f"ceiling: {r['ceiling_tflops']:.1f} model TFLOP/s = 3 x (24*N*d^2 + 4*sum(L^2)*d) over the "
                     f"pieces' summed time (attention: {r['best_attention']}, {100 * r['attention_share']:.0f}% of it); "
                     "everything else in a step counted as free")
    choice = r.get("step_choice")
    if choice:
        lines.append(f"a training step on these sequences takes: {choice['backend']} ({choice['reason']}; "
                     "knapray.attention.choose_backend, shapes as if new)")
    return "\n".join(lines)
