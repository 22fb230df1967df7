"""Coordinator benchmark: the real actor on a local Ray, driven by simulated ranks.

For each world size, a coordinator actor (``create_coordinator``, topology ``g8n{W/8}``)
and a few driver actors, each playing whole nodes of 8 ranks. Per step the coordinator
receives what the trainer's ranks send: each node's submissions of the step's lengths
(the image+video mix of ``knapray.planning.shapes.mix``, new draws each step) with their timing
reports of the step before, in one ``exchange`` call per node, as a node's ``NodeRelay``
forwards them (``--ranks-per-call 1``: one call per rank, as ranks without a relay send);
the answer is a reference, and every simulated node reads the (packed) plan from the
object store once and rebuilds it (Ray moves a plan once per node; the ranks of a node map
it from shared memory and each rebuilds it on its own core). The
ranks' own calls to their node's relay stay on their node and are not simulated. A rank
with no answer within ``timeout_s`` counts as a fallback (a real rank would plan
locally). Reported per world size, over the measured steps (one warm-up step first):

- latency from the step's first submission to the moment the last node holds the plan,
  p50, p90 and max;
- the coordinator process's CPU seconds per step (every thread: Ray's too);
- coordinator calls per step, as the drivers counted them (rank 0's commit included);
- bytes a rank receives from the coordinator (its reply), and the plan's size in the
  object store (fetched once per node: a rank's share is that over 8);
- fallbacks.

The drivers share this machine's cores with the actor, so latencies include the
simulation's own Ray calls; the actor's CPU is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time

import numpy as np

from knapray.planning.shapes.mix import PAPER_MIXES, mix_world_size, parse_mix, sample_step

DEFAULT_RANKS = (32, 128, 512, 1024, 4096)
RANKS_PER_NODE = 8
NAMESPACE = "knapray-bench"


class _Driver:
    """Plays the ranks of some whole nodes: one ``exchange`` per rank (or per
    ``ranks_per_call`` ranks of a node), then one object-store read per node."""

    def __init__(self, name: str, namespace: str, timeout_s: float) -> None:
        import ray

        self.actor = ray.get_actor(name, namespace=namespace)
        self.timeout_s = timeout_s

    def play(self, step: int, ranks: list[int], lens: list[list[int]], ids: list[list[int]],
             ranks_per_call: int) -> dict:
        import ray
        from ray.exceptions import GetTimeoutError, RayTaskError

        from knapray.coordinator.wire import unpack

        t0 = time.time()
        refs, calls = [], 0
        for i in range(0, len(ranks), ranks_per_call):
            group = range(i, min(i + ranks_per_call, len(ranks)))
            subs = [(ranks[j], lens[j], ids[j], False) for j in group]
            timings = [(step - 1, ranks[j], 0.1, 0.01, 0.0) for j in group] if step > 0 else []
            refs.append((len(group), self.actor.exchange.remote(step, 0, subs, timings, 0.9 * self.timeout_s)))
            calls += 1
        if 0 in ranks and step > 0:
            self.actor.commit_step.remote(step - 1)  # rank 0's commit of the step before (a call of its own)
            calls += 1
        fallbacks, reply_bytes, plan_refs = 0, [], []
        deadline = t0 + self.timeout_s
        for n, ref in refs:
            try:
                reply = ray.get(ref, timeout=max(deadline - time.time(), 0.01))
            except (GetTimeoutError, RayTaskError):
                fallbacks += n
                continue
            reply_bytes.append(len(ray.cloudpickle.dumps(reply)))
            plan_refs.append((n, reply[0]))
        plan_bytes = 0
        covered = 0
        for n, plan_ref in plan_refs:  # one read per node (the ranks of a node share it)
            if covered % RANKS_PER_NODE == 0:
                packed = ray.get(plan_ref, timeout=self.timeout_s)
                unpack(packed)  # what each rank does with it (in parallel, on its own core)
                plan_bytes = plan_bytes or len(pickle.dumps(packed, protocol=5))
            covered += n
        return {"first": t0, "last": time.time(), "calls": calls, "fallbacks": fallbacks,
                "reply_bytes": float(np.mean(reply_bytes)) if reply_bytes else 0.0, "plan_bytes": plan_bytes}


def run(ranks: tuple[int, ...] = DEFAULT_RANKS, steps: int = 5, drivers: int = 4, mix: str = "image+video",
        ranks_per_call: int = 8, timeout_s: float = 30.0, seed: int = 0) -> dict:
    """Measure every world size; prints a table and returns ``{"worlds": [...], ...}``."""
    import ray

    codes = parse_mix(PAPER_MIXES.get(mix, mix))
    unit = np.lcm(mix_world_size(codes), RANKS_PER_NODE)
    bad = [w for w in ranks if w < unit or w % unit]
    if bad:
        raise ValueError(f"--ranks {bad}: world sizes must be positive multiples of {unit} (the mix's ranks and "
                         f"{RANKS_PER_NODE} ranks per node)")
    if not 1 <= ranks_per_call <= RANKS_PER_NODE or RANKS_PER_NODE % ranks_per_call:
        raise ValueError(f"ranks_per_call must divide {RANKS_PER_NODE}, got {ranks_per_call}")
    started = not ray.is_initialized()
    if started:
        from knapray.local_ray import init_ray

        init_ray(ray, num_cpus=max(4, drivers), include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
                 configure_logging=False)
    print(f"coordinator protocol: {mix} mix, {steps} steps per world size (after 1 warm-up), {drivers} driver "
          f"actors playing nodes of {RANKS_PER_NODE} ranks, {ranks_per_call} rank(s) per actor call, "
          f"{os.cpu_count()} CPUs")
    header = (f"{'ranks':>6} | {'latency ms p50':>14} {'p90':>7} {'max':>7} | {'actor CPU ms':>12} | "
              f"{'calls/step':>10} | {'reply B/rank':>12} | {'plan KB (per node)':>18} | {'fallbacks':>9}")
    print(header)
    print("-" * len(header))
    out = []
    try:
        for world in ranks:
            r = _measure(int(world), steps, drivers, codes, ranks_per_call, timeout_s, seed)
            out.append(r)
            print(f"{r['ranks']:>6} | {r['latency_ms_p50']:>14.0f} {r['latency_ms_p90']:>7.0f} "
                  f"{r['latency_ms_max']:>7.0f} | {r['actor_cpu_ms']:>12.0f} | {r['calls_per_step']:>10.0f} | "
                  f"{r['reply_bytes_per_rank']:>12.0f} | {r['plan_bytes'] / 1024:>18.1f} | {r['fallbacks']:>9}",
                  flush=True)
    finally:
        if started:
            ray.shutdown()
    return {"worlds": out, "steps": steps, "drivers": drivers, "mix": mix, "ranks_per_call": ranks_per_call,
            "ranks_per_node": RANKS_PER_NODE}


def _measure(world: int, steps: int, drivers: int, codes, ranks_per_call: int, timeout_s: float, seed: int) -> dict:
    import psutil
    import ray

    from knapray.coordinator import create_coordinator

    name = f"bench-coordinator-{world}-{time.monotonic_ns()}"
    handle = create_coordinator(name, NAMESPACE, world_size=world, topology=f"g{RANKS_PER_NODE}n{world // RANKS_PER_NODE}")
    ray.get(handle.begin_run.remote(world))
    proc = psutil.Process(ray.get(handle.__ray_call__.remote(lambda self: os.getpid())))
    nodes = np.array_split(np.arange(world // RANKS_PER_NODE), drivers)
    owned = [[r for n in ns for r in range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)] for ns in nodes if ns.size]
    actor_cls = ray.remote(num_cpus=0)(_Driver)
    players = [actor_cls.remote(name, NAMESPACE, timeout_s) for _ in owned]
    rng = np.random.default_rng(seed)
    latency, cpu, calls, fallbacks, reply, plan_bytes = [], [], [], 0, [], 0
    next_id = 0
    for t in range(steps + 1):
        lens = sample_step(codes, rng, world)
        ids = []
        for rank_lens in lens:
            ids.append(list(range(next_id, next_id + len(rank_lens))))
            next_id += len(rank_lens)
        cpu0 = sum(proc.cpu_times()[:2])
        res = ray.get([p.play.remote(t, own, [lens[r] for r in own], [ids[r] for r in own], ranks_per_call)
                       for p, own in zip(players, owned)])
        cpu1 = sum(proc.cpu_times()[:2])
        if t == 0:
            continue  # warm-up: worker imports, first plan
        latency.append(max(x["last"] for x in res) - min(x["first"] for x in res))
        cpu.append(cpu1 - cpu0)
        calls.append(sum(x["calls"] for x in res) + 0)
        fallbacks += sum(x["fallbacks"] for x in res)
        reply += [x["reply_bytes"] for x in res if x["reply_bytes"]]
        plan_bytes = max([plan_bytes] + [x["plan_bytes"] for x in res])
    for p in players:
        ray.kill(p)
    ray.kill(handle, no_restart=True)
    ms = 1e3 * np.asarray(latency)
    return {
        "ranks": world,
        "latency_ms_p50": float(np.percentile(ms, 50)),
        "latency_ms_p90": float(np.percentile(ms, 90)),
        "latency_ms_max": float(ms.max()),
        "actor_cpu_ms": 1e3 * float(np.median(cpu)),
        "calls_per_step": float(np.median(calls)),
        "reply_bytes_per_rank": float(np.mean(reply)) if reply else 0.0,
        "plan_bytes": int(plan_bytes),
        "plan_bytes_per_rank_share": plan_bytes / RANKS_PER_NODE,
        "fallbacks": int(fallbacks),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, int_list, step_count

    from knapray.limits import MAX_BENCH_COORDINATOR_RANKS

    p.add_argument("--ranks", type=int_list(MAX_BENCH_COORDINATOR_RANKS), default=None,
                   help="world sizes, comma-separated multiples of 32 (default 32,128,512,1024,4096; at most "
                        f"{MAX_BENCH_COORDINATOR_RANKS}: every rank is played on this machine)")
    p.add_argument("--steps", type=step_count, default=5, help="measured steps per world size (default 5)")
    p.add_argument("--drivers", type=int, choices=range(1, 17), default=4, metavar="N",
                   help="driver actors playing the ranks (default 4)")
    p.add_argument("--ranks-per-call", type=int, choices=(1, 2, 4, 8), default=8,
                   help="ranks' submissions per coordinator call: 8 (default) is a node's relay's batch; 1 is "
                        "what ranks without a relay (one rank per node) send")
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    result = run(ranks=tuple(args.ranks) if args.ranks else DEFAULT_RANKS, steps=args.steps, drivers=args.drivers,
                 ranks_per_call=args.ranks_per_call)
    if args.json:
        print(json.dumps(result))
    return 0
