"""Data path benchmark: how fast one training worker receives corpus rows as tensors, from
the Ray Data reader and from the torchrun reader, beside the rate one GPU consumes them.

Each reader reads the whole corpus once, as one worker (a world of one), through the
trainer's own pieces: rows -> ``StepStream`` (decode, validate) -> a float32 tensor per
payload (what ``build_packed_batch`` packs). Measured per reader: rows/s, MB/s of corpus
bytes as stored (latent and pooled fp32, text in the corpus's dtype), the time to the
first step and the consumer process's CPU seconds. rows/s and MB/s cover the whole read,
first step included (Ray Data spends ~2 s planning and listing files before any row, and a
shuffle buffer fills before the first step); "after 1st" is MB/s after the first step (from
the buffer, when the buffer holds the whole corpus). ``old`` rows repeat the readers as they
were before the zero-copy change, in this process: the torchrun reader's ``to_pylist``
rows, Ray Data's numpy batches with a 256-row shuffle buffer, and a writable copy of every
payload before it became a tensor (the finiteness check they decode with is today's).
The ``v2`` row is today's Ray reader through Ray Data's V2 parquet datasource (Ray's default,
which indexes the files' footers on a pool of actors first) instead of V1, which knapray uses.

The rate one GPU needs: a GPU training at ``--tflops`` model TFLOP/s a model of
``--params`` parameters, ``--layers`` attention layers of width ``--width``, takes
    tokens/s = tflops / (6·params + 12·layers·width·L)
tokens per second (6·N: forward and backward of the weights; 12·layers·width·L: attention
scores and values at the token-weighted mean sequence length L = sum(L²)/sum(L)), and
    MB/s = tokens/s x corpus bytes per token.
Defaults: a 12B Flux-size MMDiT (57 attention layers of width 3072) at 400 TF/s (an H100).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_MIX = "g4b4i256f1s0,g2b2i512f1s0,g1b1i1024f1s0"
"""256² images mostly, some 512² and 1024² (latents 16x32x32 to 16x128x128); with 0-512
T5-XXL tokens per caption the text is ~95% of the bytes, as in the issue's corpora."""
READERS = ("torchrun", "ray")
MAX_BENCH_STEPS = 64
"""Steps of a built corpus (its files go to the temp directory)."""
OLD_SHUFFLE_ROWS = 256
BATCH_ROWS = 8


def build_corpora(out: Path, steps: int, text_dtypes: Iterable[str], seed: int = 0) -> dict[str, Path]:
    """One synthetic corpus per text dtype at realistic widths (16 latent channels, 4096-wide
    T5-XXL text, 768-wide CLIP pooled), same samples in each."""
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    paths = {}
    for dtype in text_dtypes:
        path = out / f"corpus-{dtype}"
        build_synthetic(SyntheticConfig(mix=DEFAULT_MIX, steps=steps, scale=1, channels=16, text_dim=4096,
                                        pooled_dim=768, max_text_tokens=512, shards=4, seed=seed,
                                        text_dtype=dtype), path, progress=False)
        paths[dtype] = path
    return paths


def corpus_bytes_and_tokens(path: Path) -> dict[str, float]:
    """Stored payload bytes, rows, tokens and the token-weighted mean length of a corpus."""
    from knapray.corpus import read_corpus
    from knapray.data import corpus_info

    info = corpus_info(path)
    t = read_corpus(path, ["channels", "frames", "height", "width", "text_tokens", "seq_len"])
    c = {n: t.column(n).to_numpy().astype(np.int64) for n in t.column_names}
    text_bytes = 2 if info.text_dtype == "bf16" else 4
    payload = (4 * c["channels"] * c["frames"] * c["height"] * c["width"]
               + text_bytes * c["text_tokens"] * info.text_dim + 4 * info.pooled_dim)
    seq = c["seq_len"]
    return {"rows": float(seq.size), "bytes": float(payload.sum()), "tokens": float(seq.sum()),
            "length_weighted": float((seq.astype(np.float64) ** 2).sum() / max(1, seq.sum()))}


def _copy_tensor(array: np.ndarray) -> torch.Tensor:
    """The hand-off before the change: a writable float32 copy, then a tensor."""
    return torch.from_numpy(np.require(array, dtype=np.float32, requirements="W"))


def _consume(rows: Iterable[Any], info: Any, to_tensor: Callable[[np.ndarray], torch.Tensor]) -> dict[str, float]:
    from knapray.data import StepStream

    start_wall, start_cpu = time.perf_counter(), time.process_time()
    first = None
    samples = first_samples = 0
    for step in StepStream.for_corpus(rows, info, samples_per_step=BATCH_ROWS):
        for s in step.samples:
            for name in ("latent", "text", "pooled"):
                to_tensor(s[name])
        samples += len(step.samples)
        if first is None:
            first, first_samples = time.perf_counter() - start_wall, samples
    seconds = time.perf_counter() - start_wall
    return {"seconds": seconds, "cpu_s": time.process_time() - start_cpu, "first_step_s": first or 0.0,
            "samples": samples, "steady_samples": samples - first_samples,
            "steady_seconds": seconds - (first or 0.0)}


def measure_torchrun(path: Path, variant: str) -> dict[str, float]:
    from knapray.data import _as_tensor, corpus_info, local_rows

    info = corpus_info(path)
    if variant == "old":
        rows: Iterable[Any] = (row for batch in local_rows(path, 0, 1) for row in batch.to_pylist())
        return _consume(rows, info, _copy_tensor)
    return _consume(local_rows(path, 0, 1), info, _as_tensor)


def measure_ray(path: Path, variant: str, shuffle_buffer_mb: int) -> dict[str, float]:
    from knapray.data import (_as_tensor, corpus_dataset, corpus_info, epoch_seed, mean_row_bytes,
                              shard_batches, shuffle_rows)

    info = corpus_info(path)
    it = corpus_dataset(path, rows_per_block=BATCH_ROWS, parquet_v2=variant == "v2").iterator()
    seed = epoch_seed(0, 0)
    if variant == "old":
        batches = it.iter_batches(batch_format="numpy", batch_size=BATCH_ROWS, prefetch_batches=2,
                                  local_shuffle_buffer_size=OLD_SHUFFLE_ROWS, local_shuffle_seed=seed)
        out = _consume(batches, info, _copy_tensor)
        out["shuffle_rows"] = OLD_SHUFFLE_ROWS
        return out
    rows = shuffle_rows(shuffle_buffer_mb, mean_row_bytes(path))
    out = _consume(shard_batches(it, batch_size=BATCH_ROWS, shuffle_buffer=rows, shuffle_seed=seed), info, _as_tensor)
    out["shuffle_rows"] = rows
    return out


def gpu_need(stats: dict[str, float], *, params: float, tflops: float, layers: int, width: int) -> dict[str, float]:
    """Tokens/s, rows/s and MB/s one GPU consumes (the module docstring's formula)."""
    flops_per_token = 6 * params + 12 * layers * width * stats["length_weighted"]
    tokens_s = tflops * 1e12 / flops_per_token
    bytes_per_token = stats["bytes"] / stats["tokens"]
    return {"flops_per_token": flops_per_token, "tokens_s": tokens_s,
            "rows_s": tokens_s * stats["rows"] / stats["tokens"], "bytes_per_token": bytes_per_token,
            "mb_s": tokens_s * bytes_per_token / 1e6}


def run(*, corpus: str | None = None, steps: int = 3, text_dtypes: tuple[str, ...] = ("fp32", "bf16"),
        readers: tuple[str, ...] = READERS, old: bool = True, shuffle_buffer_mb: int = 256,
        params: float = 12e9, tflops: float = 400.0, layers: int = 57, width: int = 3072,
        directory: str | None = None) -> dict:
    """Measure each (corpus, reader, variant); prints a table and returns the rows and the need."""
    tmp = None
    try:
        if corpus is not None:
            from knapray.data import corpus_info

            corpora = {corpus_info(corpus).text_dtype: Path(corpus)}
        else:
            tmp = Path(tempfile.mkdtemp(prefix="knapray-data-bench-", dir=directory))
            t0 = time.perf_counter()
            corpora = build_corpora(tmp, steps, text_dtypes)
            print(f"built {len(corpora)} synthetic corpora ({DEFAULT_MIX} x {steps} steps, 16 latent channels, "
                  f"T5-XXL 4096-wide text, 0-512 tokens) in {time.perf_counter() - t0:.0f} s under {tmp}")
        if "ray" in readers:
            import ray
            from ray.data import DataContext

            from knapray.local_ray import init_ray

            if not ray.is_initialized():
                init_ray(ray, num_cpus=4, include_dashboard=False, log_to_driver=False)
            DataContext.get_current().enable_progress_bars = False
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        results, needs = [], {}
        header = (f"{'reader':<9} {'text':<5} {'path':<4} | {'rows/s':>7} {'MB/s':>7} {'after 1st':>9} | "
                  f"{'first step s':>12} {'consumer CPU s':>14} {'shuffle rows':>12} | {'x one GPU':>9}")
        for dtype, path in corpora.items():
            stats = corpus_bytes_and_tokens(path)
            for shard in path.glob("part-*.parquet"):  # into the page cache: no variant reads a cold file
                shard.read_bytes()
            need = gpu_need(stats, params=params, tflops=tflops, layers=layers, width=width)
            needs[dtype] = {**stats, **need}
            print(f"\ncorpus {path} (text {dtype}): {stats['rows']:.0f} rows, {stats['bytes'] / 1e6:.0f} MB, "
                  f"{stats['bytes'] / stats['tokens'] / 1e3:.1f} KB per token; one GPU at {tflops:g} TF/s on "
                  f"{params / 1e9:g}B params: {need['tokens_s']:,.0f} tokens/s = {need['rows_s']:.2f} rows/s "
                  f"= {need['mb_s']:.1f} MB/s")
            print(header)
            print("-" * len(header))
            for reader in readers:
                for variant in (("old", "new") if old else ("new",)) + (("v2",) if reader == "ray" else ()):
                    if reader == "torchrun":
                        r = measure_torchrun(path, variant)
                    else:
                        r = measure_ray(path, variant, shuffle_buffer_mb)
                    # steady: after the first step (Ray's ~2 s of planning and listing files is in the first)
                    steady = r["steady_samples"] / r["steady_seconds"] if r["steady_seconds"] > 0 else math.nan
                    r.update(reader=reader, text_dtype=dtype, variant=variant, rows_s=steady,
                             mb_s=steady * stats["bytes"] / stats["rows"] / 1e6,
                             mb_s_overall=stats["bytes"] / r["seconds"] / 1e6)
                    r["x_gpu_need"] = r["mb_s_overall"] / need["mb_s"]
                    results.append(r)
                    print(f"{reader:<9} {dtype:<5} {variant:<4} | {r['samples'] / r['seconds']:>7.1f} "
                          f"{r['mb_s_overall']:>7.1f} {r['mb_s']:>9.1f} | "
                          f"{r['first_step_s']:>12.2f} {r['cpu_s']:>14.2f} {str(r.get('shuffle_rows', '-')):>12} | "
                          f"{r['x_gpu_need']:>8.1f}x", flush=True)
        return {"results": results, "need": needs, "params": params, "tflops": tflops, "layers": layers,
                "width": width, "mix": DEFAULT_MIX if corpus is None else None, "batch_rows": BATCH_ROWS}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, float_in, int_at_least, step_count
    from knapray.limits import MAX_SHUFFLE_BUFFER_MB

    p.add_argument("--corpus", default=None, help="measure this corpus (default: build fp32 and bf16 synthetic "
                   "corpora at realistic widths in a temporary directory)")
    p.add_argument("--steps", type=step_count, default=3,
                   help=f"steps of the mix {DEFAULT_MIX} in a built corpus (21 rows each, ~85 MB fp32; at most "
                        f"{MAX_BENCH_STEPS}; default 3)")
    p.add_argument("--reader", choices=(*READERS, "both"), default="both", help="which readers (default both)")
    p.add_argument("--no-old", action="store_true", help="skip the before-the-change variants")
    p.add_argument("--shuffle-buffer-mb", type=int_at_least(0, MAX_SHUFFLE_BUFFER_MB), default=256,
                   help="the Ray reader's data.shuffle_buffer_mb (default 256)")
    p.add_argument("--params", type=float_in(gt=0), default=12e9, help="model parameters (default 12e9)")
    p.add_argument("--tflops", type=float_in(gt=0), default=400.0, help="model TFLOP/s one GPU trains at (default 400)")
    p.add_argument("--layers", type=int_at_least(0, 1 << 12), default=57, help="attention layers (default 57, Flux)")
    p.add_argument("--width", type=int_at_least(1, 1 << 16), default=3072, help="model width (default 3072)")
    p.add_argument("--dir", default=None, help="where built corpora go (default: the temp directory)")
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    if args.steps > MAX_BENCH_STEPS:  # a built corpus is ~28 MB a step, in the temp directory
        raise ValueError(f"--steps {args.steps}: at most {MAX_BENCH_STEPS} steps of corpus")
    if args.corpus is not None and not Path(args.corpus, "schema.json").is_file():
        raise ValueError(f"--corpus {args.corpus!r}: no schema.json there")
    readers = READERS if args.reader == "both" else (args.reader,)
    result = run(corpus=args.corpus, steps=args.steps, readers=readers, old=not args.no_old,
                 shuffle_buffer_mb=args.shuffle_buffer_mb, params=args.params, tflops=args.tflops,
                 layers=args.layers, width=args.width, directory=args.dir)
    if args.json:
        print(json.dumps(result, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v))
    return 0
