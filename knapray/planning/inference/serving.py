"""Serving a mixed request stream, simulated: knapray's balanced plan against static USP and
data parallel, predicted by the ``CostModel`` (no GPU, no torch).

**The stream** (``request_stream``): ``n`` requests drawn from a mix of kinds (``MIX``,
weights by count), Poisson arrivals at ``rate`` requests/s. The kinds and the unit-rate
gaps come from ``seed`` alone; the gaps are divided by ``rate``, so every rate serves the
same requests in the same order, only closer together.

**A request's tokens** (VAE downsample 8, patch 2x2, so ``H/16 · W/16`` tokens per latent
frame):

- images are Flux.1-dev (``MODEL_PRESETS["flux"]``: joint attention, so the sequence is
  its visual tokens plus 512 T5 tokens), 28 sampling steps, 1 pass per step (Flux-dev's
  guidance is embedded, no classifier-free guidance): 512x512 -> 1,024 + 512 tokens,
  1024x1024 -> 4,096 + 512, 1024x576 -> 2,304 + 512, 2048x2048 -> 16,384 + 512;
- 480p clips are Wan 2.1 T2V 14B (``MODEL_PRESETS["wan14b"]``: cross-attention to 512
  umT5 tokens, so the sequence is its visual tokens): 832x480, 81 frames -> 21 latent
  frames (temporal downsample 4), 52·30·21 = 32,760 tokens, 50 steps, 2 passes per step
  (classifier-free guidance: conditional and unconditional).

Every GPU holds both models' weights (bf16: 24 + 28 GB), so any bag can run any request.
Text encoding and VAE decoding are left out (they are the same for every policy).

**Seconds of a request** on a bag of ``g`` GPUs: ``steps · passes · seq_cost(L, g, off)``,
with the model's ``CostModel`` turned to inference (``inference_cost``: forward only, no
backward, no recompute; Ulysses moves q, k, v and the output per layer, 4 all-to-alls, and
for cross-attention the cross-attention's query and output too, 6). ``seq_cost`` is per-GPU
seconds of one sequence split over the bag, Ulysses communication included (intra-node at
``intra_node_bw``, peers on other nodes at ``inter_node_bw``; ``off`` = peers on other
nodes). The constants are the ``CostModel`` defaults: 400 TFLOP/s bf16 per H100, 300 GB/s
NVLink, 40 GB/s InfiniBand, 8 GPUs per node, no fixed per-step or per-layer overhead (no
H100 profile has been calibrated yet). A 2-pass request on a bag of even ``g`` may run its
passes on the two halves at once (CFG parallel: ``steps · seq_cost(L, g/2)``, the small
exchange that combines them left out); every policy takes whichever is faster.

**Policies** over ``N`` GPUs (``gpus_per_node`` to a node):

- ``usp`` (static USP, as xDiT runs): every request over all ``N`` GPUs, FIFO, one after
  another. Where ``N`` does not divide the heads (Flux 24, Wan 40; e.g. ``N = 32``) xDiT
  combines Ulysses with ring attention; it is priced here by the same Ulysses formula at
  ``N``, with ``N - gpus_per_node`` peers off the node: the baseline gets no penalty for it.
- ``dp`` (data parallel): every request on one GPU, FIFO: to the lowest idle rank, or
  when none is idle to the GPU that frees first.
- ``knapray``: ``knapray serve``'s gang (``serve_on_blocks``: ``planning.inference.scheduler``'s
  ``BagScheduler`` in its balanced order). Its blocks are every aligned power-of-two block
  of a node whose size divides both models' heads, and of 2, 4, ... whole nodes (16 and 32
  GPUs, priced as static USP is: 24 and 40 heads do not split that many ways, xDiT mixes in
  ring attention there, and the real gang forms no such block for these models). At every
  arrival and completion with a GPU free, the oldest waiting requests are planned over
  every partition of the gang into blocks (largest first to the block where each would
  finish earliest; the partition of the smallest makespan wins); every block of the winner
  that is free now runs its requests packed in one loop, the rest are planned again at the
  next event. So at a light load a request gets a big block (as fast as USP), and as the
  queue grows requests pack onto single GPUs (no communication).
- ``batches``: the batch-by-batch gang ``knapray serve`` ran before: when the whole gang is
  free, the waiting requests are planned over the halving bags, and the next batch waits
  for the batch's slowest bag.

A request's latency is its completion minus its arrival; throughput is the requests served
over the time from the first arrival to the last completion. ``ServiceTimes.best`` is the
fastest any bag of the gang could run a request alone: no policy's latency is below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..costs.cost import MODEL_PRESETS, CostModel

POLICIES = ("knapray", "usp", "dp", "batches")
"""The serving policies (see the module docstring)."""

VAE_DOWNSAMPLE = 8
PATCH = 2
TOKENS_PER_SIDE = VAE_DOWNSAMPLE * PATCH


@dataclass(frozen=True)
class RequestKind:
    """One kind of request of the mix."""

    name: str
    width: int
    height: int
    latent_frames: int
    """1 for an image; ``1 + (frames - 1) / 4`` for a clip (Wan's VAE: 81 frames -> 21)."""
    model: str
    """Key of ``MODEL_PRESETS``: ``flux`` (joint attention) or ``wan14b`` (cross)."""
    steps: int
    """Sampling steps."""
    passes: int
    """Transformer passes per step: 2 with classifier-free guidance, else 1."""
    weight: float
    """Share of the stream's requests (normalized over the mix)."""
    text_tokens: int = 512

    @property
    def visual_tokens(self) -> int:
        return (self.height // TOKENS_PER_SIDE) * (self.width // TOKENS_PER_SIDE) * self.latent_frames

    @property
    def tokens(self) -> int:
        """Sequence length ``L`` the cost model sees: visual + text tokens for joint
        attention, visual tokens for cross-attention (the text is priced by the model)."""
        joint = MODEL_PRESETS[self.model].get("attention_kind", "joint") == "joint"
        return self.visual_tokens + (self.text_tokens if joint else 0)


MIX = (
    RequestKind("512x512", 512, 512, 1, "flux", 28, 1, 0.30),
    RequestKind("1024x1024", 1024, 1024, 1, "flux", 28, 1, 0.30),
    RequestKind("1024x576", 1024, 576, 1, "flux", 28, 1, 0.20),
    RequestKind("2048x2048", 2048, 2048, 1, "flux", 28, 1, 0.10),
    RequestKind("480p 81f clip", 832, 480, 21, "wan14b", 50, 2, 0.10),
)
"""The issue's mix: three image sizes of 1 MP or less, one of 4 MP, and 480p clips."""


def inference_cost(model: str, **overrides) -> CostModel:
    """A named model's ``CostModel`` for sampling: one forward pass (no backward, no
    recomputation), 4 Ulysses all-to-alls per layer for joint attention (q, k, v, output),
    6 for cross-attention (also the cross-attention's query and output)."""
    preset = dict(MODEL_PRESETS[model])
    cross = preset.get("attention_kind", "joint") == "cross"
    return CostModel(**{**preset, "backward_factor": 0.0, "recompute_passes": 0.0,
                        "ulysses_a2a_per_layer": 6 if cross else 4, **overrides})


def bag_sizes(mix=MIX, gpus_per_node: int = 8, costs: dict[str, CostModel] | None = None) -> tuple[int, ...]:
    """Bag sizes knapray may use: powers of two up to a node that divide every model's heads."""
    costs = costs or {k.model: inference_cost(k.model) for k in mix}
    heads = [c.num_heads for c in costs.values()]
    out, g = [], 1
    while g <= gpus_per_node:
        if all(h % g == 0 for h in heads):
            out.append(g)
        g *= 2
    return tuple(out)


def _off_node(g: int, gpus_per_node: int) -> int:
    """Peers on other nodes of a GPU in a bag of ``g`` laid out over whole nodes."""
    return 0 if g <= gpus_per_node else g - gpus_per_node


def request_seconds(kind: RequestKind, g: int, cost: CostModel, gpus_per_node: int = 8,
                    ulysses_layer_s: float = 0.0) -> float:
    """Predicted seconds of one request of ``kind`` alone on a bag of ``g`` GPUs:
    ``steps · passes · seq_cost``, or with CFG parallel (2 passes, even ``g``) the two
    passes at once on the halves, whichever is faster. ``ulysses_layer_s``: seconds every
    layer of a pass costs on a bag of more than one GPU beyond ``seq_cost`` (0: none; see
    ``ulysses_layer_fit``)."""
    def one_pass(bag: int) -> float:
        return float(cost.seq_cost(kind.tokens, bag, _off_node(bag, gpus_per_node))) + (
            cost.layers * ulysses_layer_s if bag > 1 else 0.0)

    t = kind.steps * kind.passes * one_pass(g)
    if kind.passes == 2 and g % 2 == 0:
        t = min(t, kind.steps * one_pass(g // 2))
    return t


XDIT_FLUX_1024 = {"kind": "1024x1024", "steps": 28, "one_gpu_s": 4.30, "ulysses4_s": 1.63}
"""xDiT's published FLUX.1-dev time at 1024x1024, 28 steps, on H100s with torch.compile: one
GPU and Ulysses over 4 (the issue quotes it)."""


def ulysses_layer_fit(mix=MIX) -> float:
    """The ``ulysses_layer_s`` at which the cost model's Ulysses-4 over one-GPU time of a
    1024x1024 Flux request is xDiT's published ratio (1.63 / 4.30 s = 0.379; the model
    alone gives 0.25 plus its all-to-all bytes): what a bag of several GPUs really pays per
    layer beyond the bytes (collective latency, kernels on a quarter of the tokens). One
    published point, so a sensitivity, not a calibration."""
    kind = next(k for k in mix if k.name == XDIT_FLUX_1024["kind"])
    flux = inference_cost(kind.model)
    t1, t4 = (float(flux.seq_cost(kind.tokens, g, 0)) for g in (1, 4))
    ratio = XDIT_FLUX_1024["ulysses4_s"] / XDIT_FLUX_1024["one_gpu_s"]
    return max(0.0, (ratio * t1 - t4) / flux.layers)


@dataclass(frozen=True)
class ServiceTimes:
    """Seconds of every kind on every bag size the policies use, for a gang of ``gpus``."""

    gpus: int
    gpus_per_node: int
    sizes: tuple[int, ...]
    """knapray's bag sizes (``bag_sizes``)."""
    on_bag: np.ndarray
    """(kinds, len(sizes)) seconds of a request alone on a bag of each size."""
    on_gang: np.ndarray
    """(kinds,) seconds of a request over all ``gpus`` (static USP)."""
    on_one: np.ndarray
    """(kinds,) seconds of a request on one GPU (data parallel)."""

    @property
    def best(self) -> np.ndarray:
        """(kinds,) the fastest a request of each kind can run on this gang."""
        usable = [j for j, g in enumerate(self.sizes) if g <= self.gpus]
        return np.minimum(self.on_gang, self.on_bag[:, usable].min(axis=1))


def service_times(gpus: int, gpus_per_node: int = 8, mix=MIX, costs: dict[str, CostModel] | None = None,
                  ulysses_layer_s: float = 0.0) -> ServiceTimes:
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"gpus and gpus_per_node must be >= 1, got {gpus} and {gpus_per_node}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs: more than one node must be whole nodes of {gpus_per_node}")
    costs = costs or {k.model: inference_cost(k.model) for k in mix}
    node = min(gpus, gpus_per_node)
    sizes = tuple(g for g in bag_sizes(mix, gpus_per_node, costs) if g <= node)
    whole = node
    while whole * 2 <= gpus:  # bags of whole nodes, priced as static USP is
        whole *= 2
        if gpus % whole == 0:
            sizes += (whole,)
    if gpus > node and gpus not in sizes:
        sizes += (gpus,)
    def seconds(k: RequestKind, g: int) -> float:
        return request_seconds(k, g, costs[k.model], gpus_per_node, ulysses_layer_s)

    on_bag = np.array([[seconds(k, g) for g in sizes] for k in mix])
    on_gang = np.array([seconds(k, gpus) for k in mix])
    on_one = np.array([seconds(k, 1) for k in mix])
    return ServiceTimes(gpus, gpus_per_node, sizes, on_bag, on_gang, on_one)


@dataclass(frozen=True)
class Stream:
    kind: np.ndarray
    """(n,) index into the mix of every request."""
    arrival: np.ndarray
    """(n,) arrival second of every request, ascending."""
    rate: float


def request_stream(n: int, rate: float, seed: int, mix=MIX) -> Stream:
    """``n`` requests of ``mix`` with Poisson arrivals at ``rate`` per second; the same
    ``seed`` gives the same kinds and the same gaps (scaled by ``1/rate``) at every rate."""
    if n < 1 or not (np.isfinite(rate) and rate > 0):
        raise ValueError(f"need n >= 1 requests and a rate > 0, got {n} and {rate}")
    rng = np.random.default_rng(seed)
    w = np.array([k.weight for k in mix], dtype=np.float64)
    kind = rng.choice(len(mix), size=n, p=w / w.sum())
    gaps = rng.standard_exponential(n)
    return Stream(kind.astype(np.int64), np.cumsum(gaps) / rate, float(rate))


@dataclass(frozen=True)
class Served:
    """What a policy did with a stream."""

    policy: str
    gpus: int
    arrival: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    ranks: tuple[tuple[int, ...], ...]
    """The GPUs that ran every request."""
    best: np.ndarray
    """(n,) ``ServiceTimes.best`` of every request's kind: a floor under its latency."""
    plans: int = 0
    """knapray: how many times the planner ran."""
    latency: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency", self.finish - self.arrival)

    @property
    def p50(self) -> float:
        return float(np.percentile(self.latency, 50))

    @property
    def p99(self) -> float:
        return float(np.percentile(self.latency, 99))

    @property
    def throughput(self) -> float:
        """Requests per second from the first arrival to the last completion."""
        return len(self.finish) / float(self.finish.max() - self.arrival.min())

    def summary(self) -> dict:
        return {"policy": self.policy, "gpus": self.gpus, "p50_s": self.p50, "p99_s": self.p99,
                "throughput_rps": self.throughput, "requests": len(self.finish)}


def bag_seconds(times: ServiceTimes, sizes: tuple[int, ...]) -> np.ndarray:
    """(kinds, bags) seconds of every kind alone on every bag of sizes ``sizes``."""
    cols = []
    for g in sizes:
        if g == times.gpus:
            cols.append(times.on_gang)
        elif g in times.sizes:
            cols.append(times.on_bag[:, times.sizes.index(g)])
        else:
            raise ValueError(f"a bag of {g} GPUs: not a size this gang prices ({list(times.sizes)}, or all {times.gpus})")
    return np.stack(cols, axis=1)


def knapray_blocks(times: ServiceTimes) -> tuple[tuple[int, int], ...]:
    """The blocks ``knapray serve``'s gang forms on this gang: every aligned power-of-two
    block of a node whose size every model's heads divide, and of 2, 4, ... whole nodes
    (``times.sizes`` but a gang of whole nodes that is not a power of two of them)."""
    from ..shapes.blocks import blocks_of

    sizes = tuple(g for g in times.sizes if not g & (g - 1))
    return blocks_of(times.gpus, sizes, min(times.gpus, times.gpus_per_node))


def serve_on_blocks(stream: Stream, times: ServiceTimes, blocks: tuple[tuple[int, int], ...], order: str,
                    policy: str, window: int | None = None, mix=MIX) -> Served:
    """``stream`` served on ``blocks`` ((first rank, size), see ``planning.inference.scheduler``) by
    ``BagScheduler`` in ``order``, as ``knapray serve``'s gang serves: a decision at every
    arrival and completion, a block running one packed loop at a time."""
    from .scheduler import BagScheduler, packed_finish

    n = len(stream.kind)
    secs = bag_seconds(times, tuple(g for _, g in blocks))[stream.kind]  # (n, blocks)
    steps = np.array([k.steps for k in mix])[stream.kind]
    start, finish = np.full(n, np.nan), np.full(n, np.nan)
    ranks: list[tuple[int, ...]] = [()] * n
    sched = BagScheduler(blocks, order, window)
    ends: dict[int, float] = {}
    nxt, now = 0, 0.0
    while nxt < n or ends or sched.waiting:
        while nxt < n and stream.arrival[nxt] <= now + 1e-12:
            sched.add(nxt, float(stream.arrival[nxt]), secs[nxt], int(steps[nxt]))
            nxt += 1
        for b in [b for b, t in ends.items() if t <= now + 1e-12]:
            del ends[b]
            sched.finished(b, now)
        for b, keys in sched.decide(now):
            done = now + packed_finish(secs[keys, b], steps[keys])
            first, g = blocks[b]
            for i, t in zip(keys, done):
                start[i], finish[i] = now, t
                ranks[i] = tuple(range(first, first + g))
            ends[b] = float(done.max())
        events = ([float(stream.arrival[nxt])] if nxt < n else []) + list(ends.values())
        if not events:
            if sched.waiting:  # cannot happen: a free gang always starts a request
                raise RuntimeError(f"{policy} serving stalled with requests waiting")
            break
        now = max(now, min(events))
    return Served(policy, times.gpus, stream.arrival, start, finish, tuple(ranks), times.best[stream.kind],
                  plans=sched.decisions)


def serve_usp(stream: Stream, times: ServiceTimes) -> Served:
    """Every request over all GPUs, FIFO."""
    return serve_on_blocks(stream, times, ((0, times.gpus),), "fifo", "usp")


def serve_dp(stream: Stream, times: ServiceTimes) -> Served:
    """Every request on one GPU, FIFO to the GPU that frees first (lowest rank on ties)."""
    return serve_on_blocks(stream, times, tuple((r, 1) for r in range(times.gpus)), "fifo", "dp")


def serve_knapray(stream: Stream, times: ServiceTimes, window: int | None = None) -> Served:
    """knapray serve's policy: every request on the aligned block where it would finish
    earliest (``knapray_blocks``, ``BagScheduler``'s balanced order)."""
    return serve_on_blocks(stream, times, knapray_blocks(times), "balanced", "knapray", window)


def serve_batches(stream: Stream, times: ServiceTimes, window: int = 16) -> Served:
    """The batch-by-batch gang (``knapray serve`` before continuous batching): when the whole
    gang is free, the waiting requests (at most ``window``) are planned over the halving bags
    (largest first to the bag where they finish earliest); a bag runs its requests packed
    in one loop (a request ends after its own steps: the others' share of each step it
    shares counts), and the next batch waits for the batch's last bag."""
    from .sampling import halving_topology
    from .scheduler import packed_finish
    from ..shapes.topology import Topology

    node = min(times.gpus, times.gpus_per_node)
    heads = max(g for g in times.sizes if g <= node)
    sizes: tuple[int, ...] = ()
    for begin in range(0, times.gpus, node):  # the halving bags, node by node
        sizes += tuple(Topology.parse(halving_topology(min(node, times.gpus - begin), heads)).bags)
    secs = bag_seconds(times, sizes)
    steps = np.array([k.steps for k in MIX])
    first = np.cumsum((0,) + sizes)[:-1]
    n = len(stream.kind)
    start, finish = np.full(n, np.nan), np.full(n, np.nan)
    ranks: list[tuple[int, ...]] = [()] * n
    nxt, now, plans = 0, 0.0, 0
    while nxt < n:
        now = max(now, float(stream.arrival[nxt]))
        batch = []
        while nxt < n and stream.arrival[nxt] <= now + 1e-12 and len(batch) < window:
            batch.append(nxt)
            nxt += 1
        plans += 1
        cost = secs[stream.kind[batch]]  # (q, bags)
        load = np.zeros(len(sizes))
        bag_of = np.empty(len(batch), dtype=np.int64)
        for r in np.argsort(-cost.min(axis=1), kind="stable"):
            b = int(np.argmin(load + cost[r]))
            load[b] += cost[r, b]
            bag_of[r] = b
        end = now
        for b in range(len(sizes)):
            mine = [r for r in range(len(batch)) if bag_of[r] == b]
            if not mine:
                continue
            done = now + packed_finish(cost[mine, b], steps[stream.kind[[batch[r] for r in mine]]])
            for r, t in zip(mine, done):
                i = batch[r]
                start[i], finish[i] = now, t
                ranks[i] = tuple(range(int(first[b]), int(first[b]) + sizes[b]))
            end = max(end, float(done.max()))
        now = end
    return Served("batches", times.gpus, stream.arrival, start, finish, tuple(ranks), times.best[stream.kind],
                  plans=plans)


SERVERS = {"knapray": serve_knapray, "usp": serve_usp, "dp": serve_dp, "batches": serve_batches}


def serve(policy: str, stream: Stream, times: ServiceTimes) -> Served:
    if policy not in SERVERS:
        raise ValueError(f"unknown policy {policy!r}; valid: {list(SERVERS)}")
    return SERVERS[policy](stream, times)


def capacity(times: ServiceTimes, mix=MIX) -> float:
    """Requests/s the gang could serve if every request ran on one GPU with no
    communication at all: ``gpus / mean seconds on one GPU`` over the mix's weights, an
    upper bound on every policy's sustained throughput."""
    w = np.array([k.weight for k in mix], dtype=np.float64)
    return times.gpus / float((w / w.sum()) @ times.on_one)


TIGHT_FACTOR = 3.0
LOOSE_FACTOR = 2.0


def p99_targets(times: ServiceTimes) -> dict[str, float]:
    """The p99 latencies at which throughputs are compared: ``tight`` is 3x the slowest
    kind's best time on the gang (the clip's; data parallel, whose clip takes its time on
    one GPU, cannot meet it), ``loose`` 2x the slowest kind's time on one GPU (every policy
    can meet it at a low enough rate)."""
    return {"tight": TIGHT_FACTOR * float(times.best.max()), "loose": LOOSE_FACTOR * float(times.on_one.max())}


def rate_at_p99(policy: str, times: ServiceTimes, target_p99: float, n: int, seed: int, mix=MIX,
                iterations: int = 10, on_run=None) -> tuple[float, Served | None]:
    """The highest arrival rate at which ``policy``'s p99 latency over ``n`` requests
    stays at or under ``target_p99``, and what it served there: ``capacity`` itself if it
    meets the target there, else bisection in log space between ``capacity/1000`` and
    ``capacity`` (``iterations`` halvings); ``(0, None)`` if even ``capacity/1000`` misses
    it. ``on_run()`` is called after every simulated run (progress)."""
    def run(rate: float) -> Served:
        served = serve(policy, request_stream(n, rate, seed, mix), times)
        if on_run is not None:
            on_run()
        return served

    hi = capacity(times, mix)
    at_hi = run(hi)
    if at_hi.p99 <= target_p99:
        return hi, at_hi
    lo = hi / 1000.0
    found = run(lo)
    if found.p99 > target_p99:
        return 0.0, None
    for _ in range(iterations):
        mid = float(np.sqrt(lo * hi))
        served = run(mid)
        if served.p99 <= target_p99:
            lo, found = mid, served
        else:
            hi = mid
    return lo, found
