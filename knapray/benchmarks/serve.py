"""Serving benchmark: one seeded request stream (Flux-dev images of 512², 1024², 1024x576
and 2048², Wan 2.1 14B 480p clips; Poisson arrivals) served by knapray's rolling balanced
plan, by static USP (every request over all GPUs, as xDiT runs) and by data parallel (one
request per GPU), side by side: p50 / p99 latency and throughput at each arrival rate, and
each policy's throughput at equal p99 (the highest rate whose p99 meets a target).

The default run is *predicted*: ``knapray.planning.inference.serving`` simulates the three policies
over 8 and 32 H100s with the ``CostModel``'s constants (its module docstring has the
formulas and every choice). ``--measure`` also serves the stream, scaled to a CPU, on 4
local gloo ranks for real, with the code ``knapray serve``'s gang runs
(``knapray.benchmarks.serve_measured``).
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import numpy as np

from knapray.planning.inference.serving import (
    LOOSE_FACTOR, MIX, POLICIES, TIGHT_FACTOR, ServiceTimes, capacity, inference_cost, p99_targets,
    rate_at_p99, request_stream, serve, service_times,
)

DEFAULT_GPUS = (8, 32)
DEFAULT_RATES = (0.3, 0.6, 0.8)
DEFAULT_REQUESTS = 1000
MEASURE_RANKS = 4
MAX_REQUESTS = 100_000
MAX_GPUS = 4096
MAX_RATE = 100.0
ITERATIONS = 10
TARGETS = {"usp": 1.3, "dp": 1.2, "batches": 1.2}
"""The issue's bar: knapray's throughput at equal p99 over static USP's, data parallel's and
the batch-by-batch gang's."""
GPUS_PER_NODE = 8


def describe(gpus_per_node: int = GPUS_PER_NODE) -> list[str]:
    """The lines that say what is simulated: the cost constants and the mix."""
    flux, wan = inference_cost("flux"), inference_cost("wan14b")
    w = np.array([k.weight for k in MIX])
    lines = [
        f"cost model (CostModel defaults, forward only): {flux.flops_per_s / 1e12:.0f} TFLOP/s per H100, NVLink "
        f"{flux.intra_node_bw / 1e9:.0f} GB/s, InfiniBand {flux.inter_node_bw / 1e9:.0f} GB/s, "
        f"{gpus_per_node} GPUs per node, no fixed per-step cost",
        f"  flux: d {flux.d_model}, {flux.layers} blocks, {flux.num_heads} heads, joint attention, "
        f"{flux.ulysses_a2a_per_layer} all-to-alls per layer; wan14b: d {wan.d_model}, {wan.layers} blocks, "
        f"{wan.num_heads} heads, cross-attention to {wan.text_tokens} tokens, {wan.ulysses_a2a_per_layer} "
        "all-to-alls per layer",
        "  request seconds on a bag of g = steps x passes x seq_cost(L, g) (CFG parallel on the halves where faster)",
        "mix (share, model, tokens L, steps x passes):",
    ]
    for k, share in zip(MIX, w / w.sum()):
        lines.append(f"  {share:4.0%} {k.name:<14} {k.model:<7} L={k.tokens:>6} {k.steps} x {k.passes}")
    return lines


def _shares() -> np.ndarray:
    w = np.array([k.weight for k in MIX], dtype=np.float64)
    return w / w.sum()


def _service_lines(times: ServiceTimes) -> list[str]:
    node = max(g for g in times.sizes if g <= times.gpus_per_node)
    j = times.sizes.index(node)
    out = [f"seconds of a request alone: {'kind':<14} {'1 GPU':>8} {f'bag of {node}':>9} {f'all {times.gpus}':>8}"]
    for k, one, bag, gang in zip(MIX, times.on_one, times.on_bag[:, j], times.on_gang):
        out.append(f"{'':28}{k.name:<14} {one:>8.2f} {bag:>9.2f} {gang:>8.2f}")
    return out


def run(
    gpus: Sequence[int] = DEFAULT_GPUS,
    rates: Sequence[float] = DEFAULT_RATES,
    requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    progress: bool = True,
    ulysses_layer_s: float = 0.0,
) -> dict:
    """The predicted tables: for every gang size, every policy at every rate (fractions of
    ``capacity``), then every policy's throughput at each p99 target (``p99_targets``).
    ``ulysses_layer_s``: a bag's extra seconds per layer of a pass (``--ulysses-overhead``)."""
    from knapray.progress import progress_bar

    check(gpus, rates, requests)
    runs = len(gpus) * len(POLICIES) * (len(rates) + len(p99_targets(service_times(gpus[0], GPUS_PER_NODE))) *
                                        (ITERATIONS + 2))
    bar = progress_bar(runs, "bench serve", "runs", disable=not progress)
    out = {"predicted": [], "at_p99": [], "requests": requests, "seed": seed}
    for line in describe():
        print(line)
    print(f"  Ulysses overhead beyond the bytes: {ulysses_layer_s * 1e6:.0f} us per layer of a pass on a bag of "
          "more than one GPU" + (" (fitted to xDiT's published FLUX.1-dev 1024x1024 times: 4.30 s on one H100, "
                                 "1.63 s with Ulysses-4)" if ulysses_layer_s else ""))
    out["ulysses_layer_s"] = ulysses_layer_s
    try:
        for n in gpus:
            times = service_times(n, GPUS_PER_NODE, ulysses_layer_s=ulysses_layer_s)
            cap = capacity(times)
            print(f"\npredicted, {n} H100s: {requests} requests, seed {seed}; capacity (every request on one GPU, "
                  f"no communication) {cap:.4f} req/s")
            for line in _service_lines(times):
                print(line)
            usp_max = 1.0 / float(_shares() @ times.on_gang)
            print(f"static USP serves at most {usp_max:.4f} req/s ({usp_max / cap:.0%} of capacity): where both "
                  f"keep up, knapray's throughput is at most {cap / usp_max:.2f}x USP's")
            out.setdefault("usp_max_rps", {})[n] = usp_max
            header = f"{'load':>5} {'req/s':>7} | " + " | ".join(
                f"{p + ' p50':>12} {'p99':>8} {'thr':>7}" for p in POLICIES)
            print(header)
            print("-" * len(header))
            for load in rates:
                rate = load * cap
                stream = request_stream(requests, rate, seed)
                cells = []
                for policy in POLICIES:
                    served = serve(policy, stream, times)
                    bar.update(1)
                    out["predicted"].append({"gpus": n, "load": load, "rate_rps": rate, **served.summary()})
                    cells.append(f"{served.p50:>12.1f} {served.p99:>8.1f} {served.throughput:>7.4f}")
                print(f"{load:>5.2f} {rate:>7.4f} | " + " | ".join(cells), flush=True)
            for name, target in p99_targets(times).items():
                got = {}
                for policy in POLICIES:
                    used = [0]

                    def one_run() -> None:
                        used[0] += 1
                        bar.update(1)

                    rate, served = rate_at_p99(policy, times, target, requests, seed, iterations=ITERATIONS,
                                               on_run=one_run)
                    bar.update(ITERATIONS + 2 - used[0])  # runs a search did not need
                    got[policy] = (rate, served)
                out["at_p99"].append(_at_p99_row(n, name, target, got, cap))
            _print_at_p99([r for r in out["at_p99"] if r["gpus"] == n])
    finally:
        bar.close()
    print("\nload = arrival rate / capacity; p50, p99 in seconds from arrival to completion; thr = requests served / "
          "(last completion - first arrival).\nat equal p99: each policy's highest arrival rate (bisection, "
          f"{ITERATIONS} halvings, at most capacity) whose p99 meets the target, and the throughput served there; "
          f"tight = {TIGHT_FACTOR:g} x the slowest kind's best time on the gang, loose = {LOOSE_FACTOR:g} x its time "
          "on one GPU;\nat load = the load each of knapray/usp/dp was at (1.00: "
          "capacity, the highest tried; a finite stream's p99 stays bounded there, and the throughput is what the "
          "policy serves overloaded).")
    return out


def _at_p99_row(gpus: int, name: str, target: float, got: dict, cap: float) -> dict:
    thr = {p: (s.throughput if s is not None else 0.0) for p, (_, s) in got.items()}
    row = {"gpus": gpus, "target": name, "p99_target_s": target}
    for p, (rate, s) in got.items():
        row[f"{p}_rate_rps"] = rate
        row[f"{p}_load"] = rate / cap
        row[f"{p}_throughput_rps"] = thr[p]
        row[f"{p}_p99_s"] = s.p99 if s is not None else None
    for p in TARGETS:
        row[f"knapray_over_{p}"] = thr["knapray"] / thr[p] if thr[p] > 0 else float("inf")
    return row


def _print_at_p99(rows: list[dict]) -> None:
    print("throughput at equal p99 (req/s; '-': p99 never meets the target), goal "
          + ", ".join(f">= {v}x {k}" for k, v in TARGETS.items()) + ":")
    header = (f"{'target':<6} {'p99 <= s':>9} | " + " ".join(f"{p:>8}" for p in POLICIES) + f" | {'at load':>19} | "
              + " | ".join(f"{'vs ' + p:>9} {'':>6}" for p in TARGETS))
    print(header)
    print("-" * len(header))
    for r in rows:
        def thr(p: str) -> str:
            return f"{r[f'{p}_throughput_rps']:>8.4f}" if r[f"{p}_rate_rps"] > 0 else f"{'-':>8}"

        def ratio(p: str) -> str:
            x = r[f"knapray_over_{p}"]
            verdict = "met" if x >= TARGETS[p] else "missed"
            return f"{x:>8.2f}x {verdict:>6}" if np.isfinite(x) else f"{'inf':>9} {verdict:>6}"

        loads = "/".join(f"{r[f'{p}_load']:.2f}" if r[f"{p}_rate_rps"] > 0 else "-" for p in POLICIES)
        print(f"{r['target']:<6} {r['p99_target_s']:>9.1f} | " + " ".join(thr(p) for p in POLICIES)
              + f" | {loads:>19} | " + " | ".join(ratio(p) for p in TARGETS), flush=True)


def check(gpus: Sequence[int], rates: Sequence[float], requests: int) -> None:
    for n in gpus:
        if n > GPUS_PER_NODE and n % GPUS_PER_NODE:
            raise ValueError(f"--gpus {n}: more than one node must be whole nodes of {GPUS_PER_NODE} GPUs, "
                             "e.g. 8 16 32")
    for r in rates:
        if r > MAX_RATE:
            raise ValueError(f"--rates {r:g}: a rate is a fraction of the gang's capacity, at most {MAX_RATE:g}")


def measure(loads: Sequence[float], requests: int, seed: int, ranks: int = MEASURE_RANKS, serve_measured=None
            ) -> dict:
    """The measured part: the stream at CPU scale served for real by every policy on
    ``ranks`` local gloo processes (``knapray.benchmarks.serve_measured``: the gang's
    sampling code and the scheduler ``knapray serve`` runs, the tiny model, calibrated once
    for all policies, the same arrivals for each). Per load and policy: p50, p99,
    throughput; and each policy's throughput at the highest measured load whose p99 meets
    each target: ``tight`` = the slowest kind's (the clip's) measured seconds alone on one
    rank, ``loose`` = ``LOOSE_FACTOR`` times that (the predicted part's loose target)."""
    if serve_measured is None:
        from knapray.benchmarks.serve_measured import serve_measured
    rows, served = [], {}
    got = serve_measured(list(POLICIES), list(loads), requests, seed, ranks)
    seconds = got["seconds"]
    for policy in POLICIES:
        for load, sv_ in zip(loads, got["served"][policy]):
            served[(policy, load)] = sv_
            rows.append({"ranks": ranks, "load": load, "capacity_rps": got["capacity"], **sv_.summary()})
            print(f"measured, {ranks} CPU ranks: {policy:<8} load {load:.2f} ({load * got['capacity']:.2f} req/s) "
                  f"p50 {sv_.p50:.3f} s p99 {sv_.p99:.3f} s thr {sv_.throughput:.3f} req/s", flush=True)
    at_p99 = []
    for name, factor in (("tight", 1.0), ("loose", LOOSE_FACTOR)):
        target = factor * float(np.max(seconds))
        at, where = {}, {}
        for policy in POLICIES:
            ok = [load for load in loads if served[(policy, load)].p99 <= target]
            at[policy] = served[(policy, max(ok))].throughput if ok else 0.0
            where[policy] = max(ok) if ok else None
        ratios = {p: (at["knapray"] / at[p] if at[p] > 0 else float("inf")) for p in TARGETS}
        print(f"measured, at equal p99 ({name}: p99 <= {target:.3f} s, the highest load meeting it, "
              + "/".join("-" if where[p] is None else f"{where[p]:.2f}" for p in POLICIES)
              + "): " + ", ".join(f"{p} {at[p]:.3f}" for p in POLICIES) + " req/s; "
              + ", ".join(f"knapray/{p} {ratios[p]:.2f}x (goal {TARGETS[p]}x)" for p in TARGETS), flush=True)
        at_p99.append({"target": name, "p99_target_s": target, "at_load": where, "throughput_rps": at,
                       "knapray_over": ratios})
    return {"rows": rows, "at_p99": at_p99}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, add_seed, float_in, int_at_least

    p.add_argument("--gpus", type=int_at_least(1, MAX_GPUS), nargs="+", default=list(DEFAULT_GPUS), metavar="N",
                   help="gang sizes to predict (H100s; more than 8 in whole nodes of 8), default 8 32")
    p.add_argument("--rates", type=float_in(gt=0), nargs="+", default=list(DEFAULT_RATES), metavar="LOAD",
                   help="arrival rates as fractions of the gang's capacity (requests/s if every request ran on one "
                   "GPU with no communication), default 0.3 0.6 0.8")
    p.add_argument("--requests", type=int_at_least(1, MAX_REQUESTS), default=DEFAULT_REQUESTS,
                   help=f"requests in the stream (default {DEFAULT_REQUESTS})")
    p.add_argument("--ulysses-overhead", choices=("none", "xdit"), default="none",
                   help="predicted part: what a bag of several GPUs pays per layer beyond the all-to-all bytes: none "
                   "(the cost model's defaults), or xdit (fitted to xDiT's published Flux Ulysses-4 time, ~350 us)")
    p.add_argument("--measure", action="store_true",
                   help=f"also serve the stream, at CPU scale, on {MEASURE_RANKS} local CPU ranks for real "
                   "(knapray/benchmarks/serve_measured.py)")
    p.add_argument("--measure-loads", type=float_in(gt=0), nargs="+", default=[0.4, 0.7, 1.0, 1.3], metavar="LOAD",
                   help="loads of the measured part, fractions of its measured capacity (default 0.4 0.7 1.0 1.3)")
    p.add_argument("--measure-requests", type=int_at_least(1, MAX_REQUESTS), default=60, metavar="N",
                   help="requests of each measured stream (default 60)")
    add_seed(p)
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    check(args.gpus, args.rates, args.requests)
    for load in args.measure_loads:
        if load > MAX_RATE:
            raise ValueError(f"--measure-loads {load:g}: a load is a fraction of the measured capacity, at most "
                             f"{MAX_RATE:g}")
    from knapray.planning.inference.serving import ulysses_layer_fit

    overhead = ulysses_layer_fit() if args.ulysses_overhead == "xdit" else 0.0
    out = run(args.gpus, args.rates, args.requests, args.seed, ulysses_layer_s=overhead)
    if args.measure:
        out["measured"] = measure(args.measure_loads, min(args.requests, args.measure_requests), args.seed)
    if args.json:
        print(json.dumps(out))
    return 0
