"""Serving benchmark: one seeded request stream (Flux-dev images of 512², 1024², 1024x576
and 2048², Wan 2.1 14B 480p clips; Poisson arrivals) served by knapray's rolling balanced
plan, by static USP (every request over all GPUs, as xDiT runs) and by data parallel (one
request per GPU), side by side: p50 / p99 latency and throughput at each arrival rate, and
each policy's throughput at equal p99 (the highest rate whose p99 meets a target).

The default run is *predicted*: ``knapray.planning.serving`` simulates the three policies
over 8 and 32 H100s with the ``CostModel``'s constants (its module docstring has the
formulas and every choice). ``--measure`` also runs the same stream on 4 CPU ranks through
the gang executor's ``knapray.driver.gang.serve_stream``; where this checkout lacks it, it is
one line and exit 2 before anything runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import numpy as np

from knapray.planning.serving import (
    LOOSE_FACTOR, MIX, POLICIES, TIGHT_FACTOR, ServiceTimes, Served, capacity, inference_cost, p99_targets,
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
TARGETS = {"usp": 1.3, "dp": 1.2}
"""The issue's bar: knapray's throughput at equal p99 over static USP's and data parallel's."""
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
) -> dict:
    """The predicted tables: for every gang size, every policy at every rate (fractions of
    ``capacity``), then every policy's throughput at each p99 target (``p99_targets``)."""
    from knapray.progress import progress_bar

    check(gpus, rates, requests)
    runs = len(gpus) * len(POLICIES) * (len(rates) + len(p99_targets(service_times(gpus[0], GPUS_PER_NODE))) *
                                        (ITERATIONS + 2))
    bar = progress_bar(runs, "bench serve", "runs", disable=not progress)
    out = {"predicted": [], "at_p99": [], "requests": requests, "seed": seed}
    for line in describe():
        print(line)
    try:
        for n in gpus:
            times = service_times(n, GPUS_PER_NODE)
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
    for p in ("usp", "dp"):
        row[f"knapray_over_{p}"] = thr["knapray"] / thr[p] if thr[p] > 0 else float("inf")
    return row


def _print_at_p99(rows: list[dict]) -> None:
    print(f"throughput at equal p99 (req/s; '-': p99 never meets the target), goal >= {TARGETS['usp']}x USP, "
          f">= {TARGETS['dp']}x DP:")
    header = (f"{'target':<6} {'p99 <= s':>9} | {'knapray':>8} {'usp':>8} {'dp':>8} | {'at load':>14} | "
              f"{'vs usp':>7} {'':>6} | {'vs dp':>7} {'':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        def thr(p: str) -> str:
            return f"{r[f'{p}_throughput_rps']:>8.4f}" if r[f"{p}_rate_rps"] > 0 else f"{'-':>8}"

        def ratio(p: str) -> str:
            x = r[f"knapray_over_{p}"]
            verdict = "met" if x >= TARGETS[p] else "missed"
            return f"{x:>6.2f}x {verdict:>6}" if np.isfinite(x) else f"{'inf':>7} {verdict:>6}"

        loads = "/".join(f"{r[f'{p}_load']:.2f}" if r[f"{p}_rate_rps"] > 0 else "-" for p in POLICIES)
        print(f"{r['target']:<6} {r['p99_target_s']:>9.1f} | {thr('knapray')} {thr('usp')} {thr('dp')} | "
              f"{loads:>14} | {ratio('usp')} | {ratio('dp')}", flush=True)


def check(gpus: Sequence[int], rates: Sequence[float], requests: int) -> None:
    for n in gpus:
        if n > GPUS_PER_NODE and n % GPUS_PER_NODE:
            raise ValueError(f"--gpus {n}: more than one node must be whole nodes of {GPUS_PER_NODE} GPUs, "
                             "e.g. 8 16 32")
    for r in rates:
        if r > MAX_RATE:
            raise ValueError(f"--rates {r:g}: a rate is a fraction of the gang's capacity, at most {MAX_RATE:g}")


EXECUTOR = "knapray.driver.gang"
EXECUTOR_FUNCTION = "serve_stream"


def executor_or_none():
    """The gang executor's ``serve_stream`` if this checkout has it, else None."""
    import importlib

    try:
        module = importlib.import_module(EXECUTOR)
    except ModuleNotFoundError as e:
        if e.name not in (EXECUTOR, EXECUTOR.rsplit(".", 1)[0]):
            raise
        return None
    return getattr(module, EXECUTOR_FUNCTION, None)


def measure(rates: Sequence[float], requests: int, seed: int, ranks: int = MEASURE_RANKS, serve_stream=None
            ) -> list[dict]:
    """The measured part: the same stream served by the three policies on ``ranks`` CPU
    ranks by ``serve_stream(policy, stream, mix, ranks) -> Served`` (start and finish in
    measured seconds; default ``knapray.driver.gang.serve_stream``). Raises
    ``ValueError`` if the executor is not there."""
    serve_stream = serve_stream or executor_or_none()
    if serve_stream is None:
        raise ValueError(f"--measure needs {EXECUTOR}.{EXECUTOR_FUNCTION} (the executor that serves a request "
                         f"stream on {ranks} CPU ranks), which this checkout does not have; without --measure "
                         "the bench prints the predicted part")
    rows = []
    times = service_times(ranks, GPUS_PER_NODE)
    for load in rates:
        rate = load * capacity(times)
        stream = request_stream(requests, rate, seed)
        for policy in POLICIES:
            served: Served = serve_stream(policy, stream, MIX, ranks)
            rows.append({"ranks": ranks, "load": load, "rate_rps": rate, **served.summary()})
            print(f"measured, {ranks} CPU ranks: load {load:.2f} {policy:<8} p50 {served.p50:.2f} s p99 "
                  f"{served.p99:.2f} s thr {served.throughput:.4f} req/s", flush=True)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, add_seed, float_in, int_at_least

    p.add_argument("--gpus", type=int_at_least(1, MAX_GPUS), nargs="+", default=list(DEFAULT_GPUS), metavar="N",
                   help="gang sizes to predict (H100s; more than 8 in whole nodes of 8), default 8 32")
    p.add_argument("--rates", type=float_in(gt=0), nargs="+", default=list(DEFAULT_RATES), metavar="LOAD",
                   help="arrival rates as fractions of the gang's capacity (requests/s if every request ran on one "
                   "GPU with no communication), default 0.3 0.6 0.8")
    p.add_argument("--requests", type=int_at_least(1, MAX_REQUESTS), default=DEFAULT_REQUESTS,
                   help=f"requests in the stream (default {DEFAULT_REQUESTS})")
    p.add_argument("--measure", action="store_true",
                   help=f"also serve the stream on {MEASURE_RANKS} CPU ranks (needs the gang executor, "
                   "knapray.driver.gang)")
    add_seed(p)
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    check(args.gpus, args.rates, args.requests)
    serve_stream = executor_or_none() if args.measure else None
    if args.measure and serve_stream is None:  # before the predicted part runs, not after it
        measure(args.rates, args.requests, args.seed)  # raises the one-line error
    out = run(args.gpus, args.rates, args.requests, args.seed)
    if args.measure:
        out["measured"] = measure(args.rates, args.requests, args.seed, serve_stream=serve_stream)
    if args.json:
        print(json.dumps(out))
    return 0
