"""CostModel: predicted seconds of a training step, compute and communication.

Where ``WorkloadModel`` is the paper's relative work estimate, ``CostModel`` predicts
time on a machine, so the planner can trade balance against communication and the
topology search can compare bag layouts. Every constant is a field (override it, or load
a config dict / a profile written by ``knapray calibrate``).

Compute, per sequence of ``L`` tokens on one GPU of speed 1, is its *marginal* cost in the
packed batch a rank runs (what adding the sequence to the batch adds)::

    compute(L) = layers · (s + a·L + b·L²)

and every rank pays, once per step whatever its batch holds, the fixed
``fixed_s = step_overhead_s + layers · layer_overhead_s`` (kernel launches and dispatch are
paid per layer, once for the whole packed batch: never per sequence).

``a`` (seconds per token per layer), ``b`` (seconds per token pair per layer), ``s``
(seconds per sequence per layer, 0 unless calibration shows one) and ``layer_overhead_s``
are fitted to timed packed batches (``knapray calibrate``), or ``a`` and ``b`` derived from
FLOPs: per layer and forward pass a token costs
``24·d²`` FLOPs in projections and MLP (MLP ratio 4; true of Flux's double blocks, whose
text and image tokens have separate weights, and of its single blocks, whose fused
``d -> 7d`` and ``5d -> d`` linears are also ``12·d²`` multiply-adds) and attention
``4·L·d`` (``QKᵀ`` and ``PV``); a training step runs ``1 + backward_factor +
recompute_passes`` forward-equivalents (forward, backward = 2x forward, and the forward
recomputed by activation checkpointing: 4), at ``flops_per_s`` achieved.

Ulysses, for a sequence on a bag of ``g > 1`` GPUs, per attention layer and step, each of
the bag's GPUs takes part in 12 all-to-alls of its ``L/g``-token chunk, ``d`` values of
``activation_bytes`` each per token (``ulysses_a2a_per_layer``):

- forward: q, k, v (sequence-sharded -> head-sharded) and the output (back): 4;
- backward: the output's gradient (in) and the gradients of q, k, v (back): 4;
- the recomputed forward of activation checkpointing: 4 more.

Of each all-to-all a fraction ``(g-1)/g`` of the chunk leaves the GPU: the part bound for
peers on the same node moves at ``intra_node_bw``, the part for peers on other nodes (a
bag larger than a node, or one laid out across a boundary) at ``inter_node_bw``; the
two run on different links, so the slower one sets the time. A sequence on a bag of
``g`` thus costs each of its GPUs ``layers·s + (compute(L) - layers·s)/g + ulysses(L, g)``:
every GPU of the bag runs attention over the whole sequence (for ``1/g`` of the heads), so
each pays the per-sequence term in full.

Routing: route and reverse route of the hidden states (``d`` values per token) in the
forward pass, and the same two in the backward pass: ``route_a2a_per_step = 4``
all-to-alls per step of every token a rank sends to or receives from another rank
(again intra- vs inter-node bandwidth, the busier direction counts).

Speed: rank ``r``'s time is its load divided by ``rank_speed[r]`` (0.5: twice as slow);
a bag runs at the speed of its slowest member (its ranks meet at every all-to-all).

The step time of a plan is ``max over ranks (busy_r / speed + route_r) + fixed_s``;
its ideal is ``sum compute(L) / sum speed + fixed_s`` (perfect balance, no
communication).

Cross-attention (``attention_kind="cross"``, Wan): a sequence's ``L`` counts its visual
tokens only; each also cross-attends to a fixed ``T = text_tokens`` text tokens, which adds
``layers · (b·L·T + k·T)`` to its attention part: ``L·T`` query-key pairs at the
self-attention's seconds per pair ``b``, and the text keys' and values' projections,
``k = text_kv_flops·d²`` FLOPs per text token per layer (at the calibrated per-token rate
``a·text_kv_flops/linear_flops`` when ``a`` is fitted). Both split over a bag like
self-attention (each GPU holds ``heads/g`` heads of the text keys and values). Until a
cross-attention block is calibrated this is the analytic FLOP ratio (docs/calibrate.md).
``MODEL_PRESETS`` holds the fields of named models (``wan14b``).

A profile from ``knapray calibrate`` records the execution mode it was timed in (device,
dtype, compile, activation checkpointing, attention backend, torch version);
``from_profile(path, run_mode=...)`` refuses a profile whose mode differs from the run's
(see ``check_mode``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..shapes.topology import Topology
from .workload import ATTENTION_KINDS


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicted per-GPU seconds of sequences, per-rank speeds, and communication."""

    d_model: int = 3072
    """Transformer width ``d`` (Flux: 3072)."""
    double_blocks: int = 19
    """Double-stream blocks (Flux: 19)."""
    single_blocks: int = 38
    """Single-stream blocks (Flux: 38)."""
    num_heads: int = 24
    """Attention heads (Flux: 24); a bag size must divide it for Ulysses."""
    flops_per_s: float = 400e12
    """Achieved compute per GPU (bf16 on an H100: 400 TFLOP/s)."""
    backward_factor: float = 2.0
    """Backward FLOPs as a multiple of the forward's."""
    recompute_passes: float = 1.0
    """Extra forward passes recomputed in the backward (activation checkpointing: 1)."""
    linear_flops: float = 24.0
    """Forward FLOPs per token per ``d²`` per layer (projections + MLP of ratio 4)."""
    attn_flops: float = 4.0
    """Forward FLOPs per token pair per ``d`` per layer (``QKᵀ`` and ``PV``)."""
    linear_s: float | None = None
    """Fitted seconds per token per layer for a whole step (overrides the FLOP estimate)."""
    attn_s: float | None = None
    """Fitted seconds per token pair per layer for a whole step (overrides the FLOP estimate)."""
    seq_s: float = 0.0
    """Fitted seconds per sequence per layer for a whole step, paid by every GPU that runs
    a chunk of the sequence (per-sequence kernel work, e.g. attention launched per sequence)."""
    seq_s_counts: str = "sequences"
    """What ``seq_s`` is paid per in a packed batch: ``sequences``, or distinct ``lengths``
    (the per-sequence ``sdpa`` attention backend runs all sequences of one length in one
    call). The planner charges it per sequence either way, an upper bound; ``batch_time``
    counts it exactly."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per layer and step on every rank, whatever its batch holds (kernel
    launches and dispatch, paid once per packed batch); fitted by ``knapray calibrate``."""
    step_overhead_s: float = 0.0
    """Fixed seconds per rank and step outside the layers (optimizer, embedding, loss)."""
    activation_bytes: int = 2
    """Bytes per activation value (bf16: 2)."""
    ulysses_a2a_per_layer: int = 12
    """All-to-alls of a chunk per attention layer and step (4 forward, 4 backward, 4 recompute)."""
    route_a2a_per_step: int = 4
    """All-to-alls of a moved token per step (route and reverse route, forward and backward)."""
    route_bytes_per_token: float | None = None
    """Bytes a routed token carries (default: hidden state, ``d · activation_bytes``)."""
    intra_node_bw: float = 300e9
    """Achieved all-to-all bytes/s per GPU and direction inside a node (NVLink)."""
    inter_node_bw: float = 40e9
    """Achieved all-to-all bytes/s per GPU and direction between nodes (InfiniBand)."""
    gpus_per_node: int = 8
    """GPUs per node: ranks ``n·gpus_per_node ..`` share node ``n``."""
    rank_speed: tuple[float, ...] | None = None
    """Relative speed of every rank (1: nominal; 0.5: takes twice as long); None: all 1."""
    attention_kind: str = "joint"
    """``joint`` (Flux: a sequence is its text and visual tokens) or ``cross`` (Wan: its
    visual tokens, cross-attending to ``text_tokens`` text tokens)."""
    text_tokens: int = 512
    """``cross``: text tokens every sequence cross-attends to (Wan pads umT5 to 512)."""
    text_kv_flops: float = 4.0
    """``cross``: forward FLOPs per text token per ``d²`` per layer (text K and V projections)."""

    def __post_init__(self) -> None:
        for name in ("d_model", "num_heads", "activation_bytes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("double_blocks", "single_blocks", "ulysses_a2a_per_layer", "route_a2a_per_step", "text_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.layers < 1:
            raise ValueError("need at least one block (double_blocks + single_blocks >= 1)")
        for name in ("flops_per_s", "intra_node_bw", "inter_node_bw"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in (
            "backward_factor", "recompute_passes", "linear_flops", "attn_flops", "step_overhead_s",
            "seq_s", "layer_overhead_s", "text_kv_flops",
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        for name in ("linear_s", "attn_s", "route_bytes_per_token"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be None or a number >= 0, got {v!r}")
        if self.attention_kind not in ATTENTION_KINDS:
            raise ValueError(f"attention_kind must be one of {ATTENTION_KINDS}, got {self.attention_kind!r}")
        if self.seq_s_counts not in SEQ_COUNTS:
            raise ValueError(f"seq_s_counts must be one of {SEQ_COUNTS}, got {self.seq_s_counts!r}")
        if self.rank_speed is not None:
            speeds = tuple(float(s) for s in self.rank_speed)
            bad = [s for s in speeds if not (np.isfinite(s) and s > 0)]
            if bad or not speeds:
                raise ValueError(f"rank_speed must be a non-empty list of numbers > 0, got {self.rank_speed!r}")
            object.__setattr__(self, "rank_speed", speeds)

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CostModel":
        """Build from a plain mapping (config file); unknown keys raise, naming the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown CostModel keys {unknown}; valid: {valid}")
        values = dict(values)
        if values.get("rank_speed") is not None:
            values["rank_speed"] = tuple(values["rank_speed"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["rank_speed"] is not None:
            d["rank_speed"] = list(d["rank_speed"])
        return d

    @classmethod
    def from_profile(
        cls,
        path: str,
        run_mode: Mapping[str, Any] | None = None,
        allow_mode_mismatch: bool = False,
        **overrides: Any,
    ) -> "CostModel":
        """Load the ``cost_model`` section of a profile JSON (``knapray calibrate``), or a
        JSON file that is such a mapping itself; ``overrides`` replace fields.

        ``run_mode``: the execution mode the plans are for (keys of ``MODE_KEYS``, e.g.
        ``{"device": "cuda", "dtype": "bfloat16", "compile": True, "ac": True}``); the
        profile's recorded mode must match it (``check_mode``), else ValueError, or only a
        warning with ``allow_mode_mismatch``. Profiles of the single-sequence format
        (``knapray-cost-profile/1``) are refused: they price short sequences several times
        too high."""
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object with a 'cost_model' mapping")
        fmt = data.get("format")
        if fmt is not None and fmt != PROFILE_FORMAT:
            raise ValueError(
                f"{path}: profile format {fmt!r} is not {PROFILE_FORMAT!r} (packed-batch timings); "
                "re-run `knapray calibrate` to write a new profile"
            )
        values = data.get("cost_model", data)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: 'cost_model' must be a mapping of CostModel fields")
        if run_mode is not None:
            recorded = data.get("mode")
            if not isinstance(recorded, dict):
                problems = [f"{path} records no execution mode, so it cannot be checked against {dict(run_mode)}"]
            else:
                problems = check_mode(recorded, run_mode)
            if problems and not allow_mode_mismatch:
                raise ValueError(f"{path}: profile does not match the run: " + "; ".join(problems))
            for p in problems:
                warnings.warn(f"{path}: {p}", stacklevel=2)
        return cls.from_dict({**values, **overrides})

    def replace(self, **changes: Any) -> "CostModel":
        return dataclasses.replace(self, **changes)

    def with_rank_speed(self, speeds: Any) -> "CostModel":
        """The same model with per-rank speed factors (None: all 1)."""
        return dataclasses.replace(self, rank_speed=None if speeds is None else tuple(float(s) for s in speeds))

    # ---- compute -------------------------------------------------------------------------

    @property
    def layers(self) -> int:
        return int(self.double_blocks + self.single_blocks)

    @property
    def fixed_s(self) -> float:
        """Fixed seconds every rank spends per step whatever its batch holds."""
        return self.step_overhead_s + self.layers * self.layer_overhead_s

    @property
    def passes(self) -> float:
        """Forward-equivalent passes per step (forward + backward + recompute)."""
        return 1.0 + self.backward_factor + self.recompute_passes

    @property
    def linear_s_per_token(self) -> float:
        """Seconds per token per layer (``a``)."""
        if self.linear_s is not None:
            return float(self.linear_s)
        return self.linear_flops * float(self.d_model) ** 2 * self.passes / self.flops_per_s

    @property
    def attn_s_per_pair(self) -> float:
        """Seconds per token pair per layer (``b``)."""
        if self.attn_s is not None:
            return float(self.attn_s)
        return self.attn_flops * float(self.d_model) * self.passes / self.flops_per_s

    @property
    def text_kv_s_per_token(self) -> float:
        """Seconds per text token per layer of the text K/V projections (``k``): the
        per-token rate scaled by the FLOP ratio ``text_kv_flops / linear_flops`` when it is
        fitted, else from FLOPs."""
        if self.linear_s is not None:
            return float(self.linear_s) * self.text_kv_flops / self.linear_flops if self.linear_flops else 0.0
        return self.text_kv_flops * float(self.d_model) ** 2 * self.passes / self.flops_per_s

    def linear(self, tokens: np.ndarray | float) -> np.ndarray:
        """Seconds of the per-token part for ``tokens`` tokens (all layers)."""
        return self.layers * self.linear_s_per_token * np.asarray(tokens, dtype=np.float64)

    def self_attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Seconds of self-attention of whole sequences (all layers, one GPU)."""
        length = np.asarray(seq_len, dtype=np.float64)
        return self.layers * self.attn_s_per_pair * length * length

    def cross_attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Seconds of cross-attention of whole sequences (all layers, one GPU; 0 for
        ``joint``): ``layers·(b·L·T + k·T)``."""
        length = np.asarray(seq_len, dtype=np.float64)
        if self.attention_kind == "joint":
            return np.zeros_like(length)
        t = float(self.text_tokens)
        return self.layers * (self.attn_s_per_pair * length * t + self.text_kv_s_per_token * t)

    def attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Seconds of the part of whole sequences that splits over a bag's heads (all
        layers, one GPU): self-attention, plus cross-attention for ``cross``."""
        if self.attention_kind == "joint":
            return self.self_attention(seq_len)
        return self.self_attention(seq_len) + self.cross_attention(seq_len)

    def per_sequence(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Seconds of the per-sequence part (all layers), paid by every GPU of a bag."""
        return np.full(np.shape(seq_len), self.layers * self.seq_s, dtype=np.float64)

    def compute(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Marginal seconds of forward + backward of whole sequences in a packed batch on
        one GPU of speed 1 (the step's fixed cost ``fixed_s`` excluded)."""
        return self.per_sequence(seq_len) + self.linear(seq_len) + self.attention(seq_len)

    def batch_time(self, seq_lens: np.ndarray | list[int]) -> float:
        """Predicted seconds of one packed batch on one GPU of speed 1 (a bag of one, no
        communication): the fixed cost, every sequence's per-token and attention parts, and
        the per-sequence part counted as ``seq_s_counts`` says."""
        lens = np.asarray(seq_lens, dtype=np.float64)
        calls = lens.size if self.seq_s_counts == "sequences" else np.unique(lens).size
        split = float((self.linear(lens) + self.attention(lens)).sum())
        return self.fixed_s + split + self.layers * self.seq_s * calls

    def __call__(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Work estimate for balancing (compute seconds, no communication): what the
        KnapFormer greedy balances when it plans with a cost model."""
        return self.compute(seq_len)

    def chunk(self, chunk_len: np.ndarray, seq_len: np.ndarray, bag_size: np.ndarray) -> np.ndarray:
        """Compute seconds of one chunk (its tokens' per-token part, ``1/g`` of attention,
        the whole per-sequence part)."""
        return (
            self.per_sequence(seq_len) + self.linear(chunk_len)
            + self.attention(seq_len) / np.asarray(bag_size, dtype=np.float64)
        )

    # ---- communication ----------------------------------------------------------------------

    @property
    def hidden_bytes(self) -> float:
        return float(self.d_model * self.activation_bytes)

    def ulysses_token_s(self, bag_size: int, off_node_peers: int = 0) -> float:
        """Ulysses seconds per chunk token on a GPU of a bag of ``bag_size`` with
        ``off_node_peers`` of its ``bag_size - 1`` peers on other nodes."""
        g = int(bag_size)
        if g <= 1:
            return 0.0
        on_node = g - 1 - off_node_peers
        per_a2a = self.hidden_bytes * max(on_node / g / self.intra_node_bw, off_node_peers / g / self.inter_node_bw)
        return self.ulysses_a2a_per_layer * self.layers * per_a2a

    def ulysses(self, seq_len: np.ndarray | float, bag_size: int, off_node_peers: int = 0) -> np.ndarray:
        """Ulysses seconds per GPU of a bag for whole sequences (``L/g`` tokens each)."""
        return np.asarray(seq_len, dtype=np.float64) / bag_size * self.ulysses_token_s(bag_size, off_node_peers)

    def seq_cost(self, seq_len: np.ndarray | float, bag_size: int, off_node_peers: int = 0) -> np.ndarray:
        """Seconds each GPU of a bag spends on a sequence: ``compute(L)/g + ulysses(L, g)``,
        but the per-sequence part in full."""
        split = (self.linear(seq_len) + self.attention(seq_len)) / bag_size
        return self.per_sequence(seq_len) + split + self.ulysses(seq_len, bag_size, off_node_peers)

    def route_token_s(self, inter_node: bool) -> float:
        """Routing seconds per token a rank sends (or receives) per step."""
        nbytes = self.hidden_bytes if self.route_bytes_per_token is None else float(self.route_bytes_per_token)
        bw = self.inter_node_bw if inter_node else self.intra_node_bw
        return self.route_a2a_per_step * nbytes / bw

    # ---- topology-dependent terms ------------------------------------------------------

    def speeds(self, world_size: int) -> np.ndarray:
        """(W,) speed of every rank."""
        if self.rank_speed is None:
            return np.ones(world_size)
        if len(self.rank_speed) != world_size:
            raise ValueError(
                f"rank_speed lists {len(self.rank_speed)} ranks, but the world has {world_size}"
            )
        return np.asarray(self.rank_speed, dtype=np.float64)

    def bag_speed(self, topology: Topology) -> np.ndarray:
        """(bags,) speed of every bag: its slowest member's."""
        return np.minimum.reduceat(self.speeds(topology.world_size), topology.bag_starts)

    def off_node_peers(self, topology: Topology) -> np.ndarray:
        """(bags,) the most peers on other nodes that any GPU of the bag has."""
        node = np.arange(topology.world_size) // self.gpus_per_node
        out = np.zeros(topology.num_bags, dtype=np.int64)
        for b, (start, g) in enumerate(zip(topology.bag_starts.tolist(), topology.bags)):
            if g == 1:
                continue
            lo, hi = node[start], node[start + g - 1]
            if lo == hi:
                continue
            counts = np.bincount(node[start : start + g] - lo)
            out[b] = g - int(counts[counts > 0].min())
        return out

    def bag_ulysses_token_s(self, topology: Topology) -> np.ndarray:
        """(bags,) Ulysses seconds per chunk token on each bag."""
        off = self.off_node_peers(topology)
        cache: dict[tuple[int, int], float] = {}
        out = np.empty(topology.num_bags)
        for b, (g, o) in enumerate(zip(topology.bags, off.tolist())):
            key = (g, o)
            if key not in cache:
                cache[key] = self.ulysses_token_s(g, o)
            out[b] = cache[key]
        return out

    def ideal_step_time(self, seq_lens: np.ndarray, world_size: int) -> float:
        """Total compute over the ranks' total speed, no communication, plus the fixed cost."""
        total = float(self.compute(np.asarray(seq_lens)).sum())
        return total / float(self.speeds(world_size).sum()) + self.fixed_s

    def step_times(self, plan) -> "StepTimes":
        """Predicted per-rank times of a ``BalancePlan`` (any solver, any model)."""
        return rank_times(
            self, plan.topology, plan.seq_lens, plan.home_rank, plan.chunk_seq, plan.chunk_rank, plan.chunk_len,
            plan.bag_size_of_seq,
        )


@dataclass(frozen=True)
class StepTimes:
    """Predicted seconds per rank of one step under a plan."""

    compute: np.ndarray
    """(W,) forward + backward compute, divided by the bag's speed."""
    ulysses: np.ndarray
    """(W,) Ulysses all-to-alls, divided by the bag's speed."""
    route: np.ndarray
    """(W,) route + reverse route all-to-alls."""
    overhead: float = 0.0
    """Fixed seconds per rank."""

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.ulysses + self.route + self.overhead

    @property
    def step_time(self) -> float:
        return float(self.total.max()) if self.total.size else self.overhead


def rank_times(
    model: CostModel,
    topology: Topology,
    seq_lens: np.ndarray,
    home_rank: np.ndarray,
    chunk_seq: np.ndarray,
    chunk_rank: np.ndarray,
    chunk_len: np.ndarray,
    bag_size_of_seq: np.ndarray,
    rank_offset: int = 0,
    bag_token_s: np.ndarray | None = None,
    bag_speed: np.ndarray | None = None,
) -> StepTimes:
    """Per-rank predicted times from chunk arrays (ranks relative to ``rank_offset`` in the
    world, which sets their nodes; ``topology`` is the one the ranks index into).

    ``bag_token_s`` / ``bag_speed`` (per bag of ``topology``) can be passed precomputed."""
    w = topology.world_size
    if bag_token_s is None or bag_speed is None:
        token_s, speed = _bag_terms(model, topology)
        bag_token_s = token_s if bag_token_s is None else bag_token_s
        bag_speed = speed if bag_speed is None else bag_speed
    seq_len_c = seq_lens[chunk_seq].astype(np.float64)
    g_c = bag_size_of_seq[chunk_seq].astype(np.float64)
    comp = model.linear(chunk_len)
    if model.seq_s:  # (0 + x is x: without a per-sequence term the sum is the same)
        comp = model.per_sequence(seq_len_c) + comp
    comp += model.attention(seq_len_c) / g_c
    bag_of_rank = topology.bag_of_rank
    # A chunk of a bag of several pays its bag's all-to-alls; a solo sequence (whole on a
    # rank of a larger bag: g 1) none.
    uly = chunk_len * bag_token_s[bag_of_rank[chunk_rank]] * (g_c > 1)
    speed = bag_speed[bag_of_rank]
    compute = np.bincount(chunk_rank, weights=comp, minlength=w) / speed
    ulysses = np.bincount(chunk_rank, weights=uly, minlength=w) / speed
    src = home_rank[chunk_seq]
    moved = src != chunk_rank
    route = np.zeros(w)
    if moved.any():
        gpn = model.gpus_per_node
        s, d, n = src[moved], chunk_rank[moved], chunk_len[moved].astype(np.float64)
        inter = (s + rank_offset) // gpn != (d + rank_offset) // gpn
        t_intra, t_inter = model.route_token_s(False), model.route_token_s(True)
        parts = []
        for mask, t in ((~inter, t_intra), (inter, t_inter)):
            sent = np.bincount(s[mask], weights=n[mask], minlength=w)
            recv = np.bincount(d[mask], weights=n[mask], minlength=w)
            parts.append(np.maximum(sent, recv) * t)
        route = np.maximum(parts[0], parts[1])
    return StepTimes(compute, ulysses, route, model.fixed_s)


_BAG_TERMS: dict[tuple[int, Topology], tuple[CostModel, np.ndarray, np.ndarray]] = {}
_BAG_TERMS_MAX = 1024


def _bag_terms(model: CostModel, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """``(model.bag_ulysses_token_s(topology), model.bag_speed(topology))``, kept per model
    object and topology: a search scores many plans on the same few topologies. Only
    ``rank_times`` reads them, and it only indexes them (the arrays are never written)."""
    key = (id(model), topology)
    hit = _BAG_TERMS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1], hit[2]
    if len(_BAG_TERMS) >= _BAG_TERMS_MAX:
        _BAG_TERMS.clear()
    terms = (model.bag_ulysses_token_s(topology), model.bag_speed(topology))
    _BAG_TERMS[key] = (model, *terms)
    return terms


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "flux": {},
    "wan14b": {
        "d_model": 5120, "double_blocks": 0, "single_blocks": 40, "num_heads": 40,
        # per visual token: self-attention q, k, v, o (4 d²), cross-attention q, o (2 d²),
        # FFN 2·d·13824 (5.4 d²), at 2 FLOPs per multiply-add
        "linear_flops": 2.0 * (6.0 + 2.0 * 13824 / 5120),
        "attention_kind": "cross", "text_tokens": 512,
    },
    # Qwen-Image (20B): d 3072, 24 heads, 60 double-stream blocks (each token through its
    # stream's projections and MLP of 4·d, as Flux's), joint attention over text and image.
    "qwen_image": {"double_blocks": 60, "single_blocks": 0},
    # FLUX.2 [dev] (32B): d 6144, 48 heads, 8 + 48 blocks, joint attention; per token q, k,
    # v, o (4 d²) and a SwiGLU MLP of 3·d (gate, value, output: 9 d²), at 2 FLOPs per
    # multiply-add (knapray.models.flops: 8 + 6·3)
    "flux2": {"d_model": 6144, "double_blocks": 8, "single_blocks": 48, "num_heads": 48,
              "linear_flops": 2.0 * (4.0 + 3.0 * 3.0)},
}
"""``CostModel`` fields of named models (``knapray simulate --model``): ``flux`` is the
defaults (Flux.1: d 3072, 19 + 38 blocks, 24 heads, joint attention); ``wan14b`` is Wan 2.1
14B (d 5120, 40 blocks, 40 heads, FFN 13824, cross-attention to 512 umT5 tokens);
``qwen_image`` is Qwen-Image (d 3072, 60 double-stream blocks, 24 heads, joint attention);
``flux2`` is FLUX.2 [dev] (d 6144, 8 + 48 blocks, 48 heads, SwiGLU MLPs of 3·d, joint
attention)."""


# ---- execution mode -------------------------------------------------------------------------

SEQ_COUNTS = ("sequences", "lengths")
"""What a per-sequence cost can be paid per (``CostModel.seq_s_counts``)."""

PROFILE_FORMAT = "knapray-cost-profile/2"
"""Format of the profiles ``knapray calibrate`` writes (packed-batch timings, a ``mode``)."""

MODE_KEYS = ("device", "dtype", "compile", "ac", "attention_backend", "device_name", "torch")
"""What a profile's ``mode`` records: device type (cpu, cuda), dtype, torch.compile on or
off, activation checkpointing on or off, attention backend, device name, torch version."""

MODE_MUST_MATCH = ("device", "dtype", "compile", "ac", "attention_backend")
"""Keys whose mismatch makes a profile unusable: each changes step time by a large factor
(compiled vs eager 1.6-1.8x, activation checkpointing about +1/3, bf16 vs fp32 several
times, fused vs per-sequence attention), and with them what the planner trades off."""


def check_mode(recorded: Mapping[str, Any], run_mode: Mapping[str, Any]) -> list[str]:
    """Why a profile recorded in mode ``recorded`` does not fit a run in ``run_mode``: one
    line per key of ``MODE_MUST_MATCH`` the run gives and the profile records differently,
    and (suffixed "(warning)") per differing device name or torch version, which change
    kernels less. Keys the run leaves out are not checked. Raises on unknown keys."""
    unknown = sorted(set(run_mode) - set(MODE_KEYS))
    if unknown:
        raise ValueError(f"unknown execution-mode keys {unknown}; valid: {list(MODE_KEYS)}")
    hard, soft = [], []
    for key in MODE_KEYS:
        if key not in run_mode:
            continue
        want, got = run_mode[key], recorded.get(key)
        if got != want:
            line = f"{key} is {got!r} in the profile but {want!r} in the run"
            (hard if key in MODE_MUST_MATCH else soft).append(line)
    return hard + [f"{line} (warning)" for line in soft]
