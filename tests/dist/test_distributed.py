"""knapray.distributed against single-process references.

Pure checks (validation, route and Ulysses layouts simulated in numpy) run in-process.
The collective checks run in ONE spawned world of 4 gloo ranks (``dist_results``): the
worker runs every check for every topology and returns plain numbers and flags, and the
tests below assert on them per rank. Every rank builds the same global data from fixed
seeds, so each one can compute the reference of what it should hold.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from knapray.attention import reference_attention
from knapray.distributed import (
    BagGroups,
    TopologyDims,
    RoutePlan,
    UlyssesAttention,
    UlyssesLayout,
    all_to_all_packed,
    all_to_all_varsize,
    check_heads,
    reverse_route,
    route,
    route_plan,
    route_sequence_features,
)
from knapray.planning import BalancePlan, Topology, WorkloadModel, identity_plan, plan_balance

WORLD = 4
TOPOLOGIES = ("g1n4", "g2n2", "g4n1", "g1n2+g2n1")
REPLICATED = "g2n1x2"  # g2n1 replicated into two balance groups of 2 ranks
HEADS, HEAD_DIM = 4, 8
MODEL = WorkloadModel(d_model=64)  # small width: attention dominates, sequences get split
RTOL, ATOL = 1e-5, 1e-6


# ---- plans and data every rank can rebuild -------------------------------------------


def _topology(spec: str) -> Topology:
    return Topology.parse("g2n1", world_size=WORLD) if spec == REPLICATED else Topology.parse(spec)


def _random_lens(seed: int, min_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    counts = [3, 0, 2, 4]  # rank 1 holds no sequence
    return [rng.integers(min_len, 40, size=c).tolist() for c in counts]


def _manual_plan(lens_per_rank: list[list[int]], topology: Topology, bag: list[int]) -> BalancePlan:
    """A plan with a given bag per sequence. plan_balance rejects sequences shorter than
    their bag; this one keeps them, giving chunks of 0 tokens and ranks with none."""
    from knapray.planning.balance.solver import _flatten, _make_chunks

    lens, home, local = _flatten(lens_per_rank, topology)
    bags = np.asarray(bag, dtype=np.int64)
    chunks = _make_chunks(lens, home, bags, topology)
    return BalancePlan(topology, MODEL, lens, home, local, bags, *chunks, solver="manual")


def _plans(spec: str) -> dict[str, BalancePlan]:
    topo = _topology(spec)
    seed = (TOPOLOGIES + (REPLICATED,)).index(spec)
    largest = max(topo.bags)
    plans = {
        "random": plan_balance(_random_lens(seed, largest), topo, MODEL),
        "one_seq": plan_balance([[7], [], [], []], topo, MODEL),
    }
    if largest > 1:
        # Each sequence on the largest bag of its home's balance group.
        per_group = len(topo.group_bags)
        big = [grp * per_group + int(np.argmax(topo.group_bags)) for grp in (0, 2 // topo.group_size)]
        plans["short"] = _manual_plan([[1], [], [2], []], topo, big)
    else:
        plans["identity"] = identity_plan(_random_lens(seed, 1), MODEL)
    return plans


def _global_data(plan: BalancePlan, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, s = int(plan.seq_lens.sum()), plan.num_sequences

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def big_ints(*shape: int) -> torch.Tensor:  # far beyond what float64 holds exactly
        return torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)

    return {
        "x": randn(n, 3, 2),
        "w": randn(n, 3, 2),
        "h": randn(n, 5).to(torch.bfloat16),
        "wh": randn(n, 5).to(torch.bfloat16).float(),  # bf16-exact weights: exact bf16 grads
        "pos": big_ints(n, 3),
        "is_text": torch.rand(n, generator=gen) < 0.3,
        "q": randn(n, HEADS, HEAD_DIM),
        "k": randn(n, HEADS, HEAD_DIM),
        "v": randn(n, HEADS, HEAD_DIM),
        "wo": randn(n, HEADS, HEAD_DIM),
        "vec": randn(s, 4),
        "wvec": randn(WORLD, s, 4),  # weight of sequence s's row on each receiving rank
        "sample_id": big_ints(s),
    }


def _seq_start(plan: BalancePlan) -> np.ndarray:
    return np.cumsum(plan.seq_lens) - plan.seq_lens


def _home_rows(plan: BalancePlan, rank: int) -> torch.Tensor:
    start, lo, hi = _seq_start(plan), plan.seq_offsets[rank], plan.seq_offsets[rank + 1]
    first = int(start[lo]) if hi > lo else 0
    return torch.arange(first, first + int(plan.seq_lens[lo:hi].sum()))


def _routed_chunks(plan: BalancePlan, rank: int) -> list[int]:
    """Chunks ``rank`` computes, in global sequence order (the documented routed order)."""
    mine = [c for c in range(plan.chunk_seq.size) if plan.chunk_rank[c] == rank]
    return sorted(mine, key=lambda c: int(plan.chunk_seq[c]))


def _routed_rows(plan: BalancePlan, rank: int) -> torch.Tensor:
    start = _seq_start(plan)
    rows = []
    for c in _routed_chunks(plan, rank):
        first = int(start[plan.chunk_seq[c]] + plan.chunk_start[c])
        rows.extend(range(first, first + int(plan.chunk_len[c])))
    return torch.tensor(rows, dtype=torch.int64)


def _close_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / (ATOL + RTOL |b|): <= 1 means allclose at (RTOL, ATOL)."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


# ---- the spawned worker --------------------------------------------------------------


def _guard(out: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        out[key] = fn()
    except Exception:
        out[key] = "error:\n" + traceback.format_exc()


def _comms_checks(rank: int, group: dist.ProcessGroup | None, peers: list[int], seed: int) -> dict:
    n = len(peers)
    me = peers.index(rank)
    rng = np.random.default_rng(seed)
    splits = rng.integers(0, 4, size=(n, n))  # splits[i, j]: rows group rank i sends to j
    splits[n - 1, :] = 0  # one rank sends nothing
    splits[0, 0] = 0

    def randn(rows: int, s: int) -> torch.Tensor:
        return torch.randn(rows, 2, 3, generator=torch.Generator().manual_seed(s), dtype=torch.float64)

    xs = [randn(int(splits[i].sum()), seed * 10 + i) for i in range(n)]
    ws = [randn(int(splits[:, j].sum()), seed * 100 + j) for j in range(n)]

    def delivered(inputs: list[torch.Tensor]) -> torch.Tensor:
        """What group rank ``me`` should receive: from each source, its block for ``me``."""
        return torch.cat([inputs[i][int(splits[i, :me].sum()) :][: int(splits[i, me])] for i in range(n)])

    # d/dx of sum(w_j * out_j) over all ranks: each row sent to j meets the row of w_j it
    # landed on, i.e. the weights permuted back into this rank's send order.
    expected_grad = torch.cat([ws[j][int(splits[:me, j].sum()) :][: int(splits[me, j])] for j in range(n)])

    res: dict[str, Any] = {}
    send, recv = splits[me].tolist(), splits[:, me].tolist()
    x = xs[me].clone().requires_grad_()
    out = all_to_all_varsize(x, send, recv, group)
    (grad,) = torch.autograd.grad((out * ws[me]).sum(), x)
    res["fwd_exact"] = torch.equal(out, delivered(xs))
    res["bwd_exact"] = torch.equal(grad, expected_grad)

    ints = [(x * 1e6).long() + 2**50 for x in xs]
    out_int = all_to_all_varsize(ints[me], send, recv, group)
    res["int_exact"] = out_int.dtype == torch.int64 and torch.equal(out_int, delivered(ints))

    flags = [x[:, 0, 0] > 0 for x in xs]
    halves = [x[:, :, 0].to(torch.bfloat16) for x in xs]
    x32 = xs[me].float().requires_grad_()
    h16 = halves[me].clone().requires_grad_()
    p32, pint, pflag, p16 = all_to_all_packed([x32, ints[me], flags[me], h16], send, recv, group)
    res["packed_fwd_exact"] = (
        torch.equal(p32, delivered([x.float() for x in xs]))
        and torch.equal(pint, delivered(ints))
        and torch.equal(pflag, delivered(flags))
        and torch.equal(p16, delivered(halves))
    )
    w16 = ws[me][:, :, 0].to(torch.bfloat16)
    g32, g16 = torch.autograd.grad((p32 * ws[me].float()).sum() + (p16 * w16).sum(), (x32, h16))
    res["packed_bwd_exact"] = (
        torch.equal(g32, expected_grad.float())
        and g16.dtype == torch.bfloat16
        and torch.equal(g16, expected_grad[:, :, 0].to(torch.bfloat16))
        and not pint.requires_grad
        and not pflag.requires_grad
    )

    zero = torch.zeros(0, 2, requires_grad=True)
    zout = all_to_all_varsize(zero, [0] * n, [0] * n, group)
    (zgrad,) = torch.autograd.grad(zout.sum(), zero)
    res["all_zero_ok"] = zout.shape == (0, 2) and zgrad.shape == (0, 2)
    return res


def _route_checks(plan: BalancePlan, rank: int, group: dist.ProcessGroup | None, data: dict) -> dict:
    home, routed = _home_rows(plan, rank), _routed_rows(plan, rank)
    res: dict[str, Any] = {"n_home": len(home), "n_loc": len(routed)}

    def features() -> dict:
        x = data["x"][home].clone().requires_grad_()
        h = data["h"][home].clone().requires_grad_()
        feats = {"x": x, "h": h, "pos": data["pos"][home], "is_text": data["is_text"][home]}
        out = route(plan, rank, feats, group)
        exact = all(torch.equal(out[k], data[k][routed]) for k in feats)
        dtypes = all(out[k].dtype == feats[k].dtype for k in feats)
        back = reverse_route(plan, rank, out, group)
        roundtrip = all(torch.equal(back[k], feats[k]) for k in feats)
        loss = (out["x"] * data["w"][routed]).sum() + (out["h"].float() * data["wh"][routed]).sum()
        gx, gh = torch.autograd.grad(loss, (x, h))
        grads = torch.equal(gx, data["w"][home]) and torch.equal(gh, data["wh"][home].to(torch.bfloat16))
        no_int_grad = not out["pos"].requires_grad and not out["is_text"].requires_grad
        return {"exact": exact and dtypes, "roundtrip": roundtrip, "grads": grads, "no_int_grad": no_int_grad}

    def tensor() -> dict:
        x = data["x"][home].clone().requires_grad_()
        out = route(plan, rank, x, group)
        (gx,) = torch.autograd.grad((out * data["w"][routed]).sum(), x)
        y = data["x"][routed].clone().requires_grad_()
        z = reverse_route(plan, rank, y, group)
        (gy,) = torch.autograd.grad((z * data["w"][home]).sum(), y)
        return {
            "exact": torch.equal(out, data["x"][routed]),
            "route_grad": torch.equal(gx, data["w"][home]),
            "reverse_exact": torch.equal(z, data["x"][home]),
            "reverse_grad": torch.equal(gy, data["w"][routed]),
        }

    def meta() -> bool:
        rp = route_plan(plan, rank, group)
        chunks = _routed_chunks(plan, rank)
        seq_global = [int(plan.chunk_seq[c]) for c in chunks for _ in range(plan.chunk_len[c])]
        seq_local = [i for i, c in enumerate(chunks) for _ in range(plan.chunk_len[c])]
        offset = [int(plan.chunk_start[c]) + t for c in chunks for t in range(plan.chunk_len[c])]
        return (
            rp.token_seq_global.tolist() == seq_global
            and rp.token_seq_local.tolist() == seq_local
            and rp.token_offset.tolist() == offset
            and rp.recv_seq_ids.tolist() == [int(plan.chunk_seq[c]) for c in chunks]
        )

    def sequences() -> dict:
        lo, hi = int(plan.seq_offsets[rank]), int(plan.seq_offsets[rank + 1])
        chunks = _routed_chunks(plan, rank)
        recv_seq = torch.tensor([int(plan.chunk_seq[c]) for c in chunks], dtype=torch.int64)
        vec = data["vec"][lo:hi].clone().requires_grad_()
        out = route_sequence_features(plan, rank, {"vec": vec, "sample_id": data["sample_id"][lo:hi]}, group)
        only_vec = route_sequence_features(plan, rank, vec, group)
        exact = (
            torch.equal(out["vec"], data["vec"][recv_seq])
            and torch.equal(out["sample_id"], data["sample_id"][recv_seq])
            and torch.equal(only_vec, data["vec"][recv_seq])
        )
        (grad,) = torch.autograd.grad((out["vec"] * data["wvec"][rank, recv_seq]).sum(), vec)
        expected = torch.zeros(hi - lo, 4)
        split = 0
        for s in range(lo, hi):
            holders = plan.chunk_rank[plan.chunk_seq == s]
            split += int(np.any(holders != rank) and holders.size > 1)
            for r in holders:
                expected[s - lo] += data["wvec"][int(r), s]
        return {"exact": exact, "grad": _close_ratio(grad, expected), "split_home_seqs": split}

    _guard(res, "features", features)
    _guard(res, "tensor", tensor)
    _guard(res, "meta", meta)
    _guard(res, "sequences", sequences)
    return res


def _ulysses_checks(
    plan: BalancePlan, rank: int, groups: BagGroups, data: dict
) -> dict:
    home, routed = _home_rows(plan, rank), _routed_rows(plan, rank)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(plan.seq_lens)]), dtype=torch.int32)
    ref_in = [data[n].clone().requires_grad_() for n in "qkv"]
    ref_out = reference_attention(*ref_in, cu)
    ref_grads = torch.autograd.grad((ref_out * data["wo"]).sum(), ref_in)
    ref_out = ref_out.detach()
    res: dict[str, Any] = {"n_loc": len(routed), "bag_size": groups.bag_size}

    def routed_attention() -> dict:
        attn = UlyssesAttention(plan, rank, groups.bag_group)
        q, k, v = (data[n][routed].clone().requires_grad_() for n in "qkv")
        out = attn(q, k, v)
        grads = torch.autograd.grad((out * data["wo"][routed]).sum(), (q, k, v))
        return {
            "out": _close_ratio(out, ref_out[routed]),
            "grad": max(_close_ratio(g, rg[routed]) for g, rg in zip(grads, ref_grads)),
        }

    def pipeline() -> dict:
        attn = UlyssesAttention(plan, rank, groups.bag_group)
        q, k, v = (data[n][home].clone().requires_grad_() for n in "qkv")
        moved = route(plan, rank, {"q": q, "k": k, "v": v}, groups.balance_group)
        out = reverse_route(plan, rank, attn(moved["q"], moved["k"], moved["v"]), groups.balance_group)
        grads = torch.autograd.grad((out * data["wo"][home]).sum(), (q, k, v))
        return {
            "out": _close_ratio(out, ref_out[home]),
            "grad": max(_close_ratio(g, rg[home]) for g, rg in zip(grads, ref_grads)),
        }

    def bad_heads() -> str | None:
        if groups.bag_size == 1:
            return None
        attn = UlyssesAttention(plan, rank, groups.bag_group)
        q = torch.zeros(len(routed), 3, HEAD_DIM)
        try:
            attn(q, q, q)
        except ValueError as e:
            return str(e)
        return "no error"

    _guard(res, "routed", routed_attention)
    _guard(res, "pipeline", pipeline)
    _guard(res, "bad_heads", bad_heads)
    return res


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    world = list(range(world_size))
    out["comms/world"] = _comms_checks(rank, None, world, seed=1)
    for spec in TOPOLOGIES + (REPLICATED,):
        topo = _topology(spec)
        groups = BagGroups.build(topo)
        bag_group = groups.bag_group
        out[f"groups/{spec}"] = {
            "bag_size": groups.bag_size,
            "rank_in_bag": groups.rank_in_bag,
            "bag_group_size": None if bag_group is None else dist.get_world_size(bag_group),
            "bag_group_ranks": None if bag_group is None else dist.get_process_group_ranks(bag_group),
            "balance_ranks": dist.get_process_group_ranks(groups.balance_group),
        }
        if spec == "g2n2":
            out["comms/bag"] = _comms_checks(rank, groups.bag_group, list(groups.layout.bag_ranks), seed=2)
        for c, (case, plan) in enumerate(_plans(spec).items()):
            data = _global_data(plan, seed=100 + c)
            # One balance group: route with the default (None = world); several: their group.
            route_group = groups.balance_group if topo.num_groups > 1 else None
            out[f"route/{spec}/{case}"] = _route_checks(plan, rank, route_group, data)
            out[f"ulysses/{spec}/{case}"] = _ulysses_checks(plan, rank, groups, data)
    for name, kwargs in {"world": {}, "heads": {"num_heads": 3}}.items():
        try:
            BagGroups.build(Topology.parse("g2n1") if name == "world" else Topology.parse("g2n2"), **kwargs)
            out[f"groups_error/{name}"] = "no error"
        except ValueError as e:
            out[f"groups_error/{name}"] = str(e)
    return out


@pytest.fixture(scope="module")
def dist_results() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD)


def _no_error(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("error:"):
        pytest.fail(value)
    if isinstance(value, dict):
        for v in value.values():
            _no_error(v)
    return value


def _cases(results: list[dict], prefix: str) -> dict[str, list[Any]]:
    """{case: [result of rank 0, ..., rank W-1]} for keys ``prefix/case``."""
    keys = [k for k in results[0] if k.startswith(prefix + "/")]
    assert keys, f"no results under {prefix!r}"
    return {k[len(prefix) + 1 :]: [_no_error(r[k]) for r in results] for k in keys}


# ---- multi-process tests -------------------------------------------------------------

ALL_SPECS = TOPOLOGIES + (REPLICATED,)


@pytest.mark.dist
@pytest.mark.parametrize("which", ["world", "bag"])
def test_all_to_all_varsize_matches_reference(dist_results: list[dict], which: str) -> None:
    for rank, r in enumerate(dist_results):
        res = _no_error(r[f"comms/{which}"])
        keys = ("fwd_exact", "bwd_exact", "int_exact", "packed_fwd_exact", "packed_bwd_exact", "all_zero_ok")
        for key in keys:
            assert res[key] is True, f"rank {rank}, {which} group: {key} failed"


@pytest.mark.dist
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_route_is_exact_and_reversible(dist_results: list[dict], spec: str) -> None:
    for case, per_rank in _cases(dist_results, f"route/{spec}").items():
        for rank, res in enumerate(per_rank):
            where = f"{spec}/{case} rank {rank}"
            assert res["features"]["exact"], f"{where}: routed features differ from the plan's chunks"
            assert res["features"]["roundtrip"], f"{where}: reverse_route(route(x)) != x"
            assert res["features"]["no_int_grad"], where
            assert res["tensor"]["exact"] and res["tensor"]["reverse_exact"], where
            assert res["meta"], f"{where}: token sequence ids / offsets disagree with the plan"
    # The cases cover ranks without sequences and ranks that compute nothing.
    cases = _cases(dist_results, f"route/{spec}")
    assert any(res["n_home"] == 0 for per_rank in cases.values() for res in per_rank)
    assert any(res["n_loc"] == 0 for per_rank in cases.values() for res in per_rank)


@pytest.mark.dist
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_route_gradients_are_reverse_routes(dist_results: list[dict], spec: str) -> None:
    for case, per_rank in _cases(dist_results, f"route/{spec}").items():
        for rank, res in enumerate(per_rank):
            where = f"{spec}/{case} rank {rank}"
            assert res["features"]["grads"], f"{where}: grads of routed features"
            assert res["tensor"]["route_grad"], f"{where}: grad of route"
            assert res["tensor"]["reverse_grad"], f"{where}: grad of reverse_route"


@pytest.mark.dist
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_route_sequence_features_forward_and_summed_grads(dist_results: list[dict], spec: str) -> None:
    split = 0
    for case, per_rank in _cases(dist_results, f"route/{spec}").items():
        for rank, res in enumerate(per_rank):
            where = f"{spec}/{case} rank {rank}"
            assert res["sequences"]["exact"], f"{where}: per-sequence rows"
            err = res["sequences"]["grad"]
            assert err <= 1.0, f"{where}: summed home grads off ({err:.3g} x tol)"
            split += res["sequences"]["split_home_seqs"]
    if max(_topology(spec).bags) > 1:
        assert split > 0, "no sequence was split over several ranks: the summing path went untested"


@pytest.mark.dist
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_ulysses_matches_full_sequence_attention(dist_results: list[dict], spec: str) -> None:
    for case, per_rank in _cases(dist_results, f"ulysses/{spec}").items():
        for rank, res in enumerate(per_rank):
            where = f"{spec}/{case} rank {rank}"
            for path in ("routed", "pipeline"):
                assert res[path]["out"] <= 1.0, f"{where} {path}: output off ({res[path]['out']:.3g} x tol)"
                err = res[path]["grad"]
                assert err <= 1.0, f"{where} {path}: q/k/v grads off ({err:.3g} x tol)"


@pytest.mark.dist
def test_ulysses_covers_idle_ranks(dist_results: list[dict]) -> None:
    # g4n1/short: a bag of 4 with 3 tokens, so some rank of a working bag holds none.
    per_rank = _cases(dist_results, "ulysses/g4n1")["short"]
    n_loc = [res["n_loc"] for res in per_rank]
    assert 0 in n_loc and sum(n_loc) == 3, n_loc
    # g2n2/one_seq: one bag runs the only sequence, both ranks of the other hold nothing.
    n_loc = [res["n_loc"] for res in _cases(dist_results, "ulysses/g2n2")["one_seq"]]
    assert sorted(n_loc) == [0, 0, 3, 4], n_loc


@pytest.mark.dist
def test_ulysses_rejects_heads_not_divisible(dist_results: list[dict]) -> None:
    for spec in ALL_SPECS:
        for case, per_rank in _cases(dist_results, f"ulysses/{spec}").items():
            for res in per_rank:
                if res["bag_size"] == 1:
                    assert res["bad_heads"] is None
                else:
                    msg = res["bad_heads"]
                    assert "3 heads" in msg and f"bag of {res['bag_size']} ranks" in msg, msg


@pytest.mark.dist
def test_bag_groups(dist_results: list[dict]) -> None:
    expected_bags = {
        "g1n4": [[0], [1], [2], [3]],
        "g2n2": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "g4n1": [[0, 1, 2, 3]] * 4,
        "g1n2+g2n1": [[0], [1], [2, 3], [2, 3]],
        REPLICATED: [[0, 1], [0, 1], [2, 3], [2, 3]],
    }
    for spec, bags in expected_bags.items():
        for rank, r in enumerate(dist_results):
            got = r[f"groups/{spec}"]
            assert got["bag_size"] == len(bags[rank])
            assert got["rank_in_bag"] == bags[rank].index(rank)
            if len(bags[rank]) == 1:
                assert got["bag_group_size"] is None
            else:
                assert got["bag_group_size"] == len(bags[rank])
                assert got["bag_group_ranks"] == bags[rank]
            if spec == REPLICATED:
                balance = [0, 1] if rank < 2 else [2, 3]
            else:
                balance = [0, 1, 2, 3]
            assert got["balance_ranks"] == balance


@pytest.mark.dist
def test_bag_groups_errors(dist_results: list[dict]) -> None:
    for r in dist_results:
        world = r["groups_error/world"]
        assert "covers 2 ranks" in world and "world has 4" in world, world
        heads = r["groups_error/heads"]
        assert "3 attention heads" in heads and "bag of 2" in heads and "[1, 3]" in heads, heads


# ---- single-process tests (no process group) -----------------------------------------


def test_check_heads() -> None:
    check_heads(24, Topology.parse("g1n2+g2n1+g8n1"))
    with pytest.raises(ValueError) as err:
        check_heads(6, Topology.parse("g1n2+g4n1"))
    msg = str(err.value)
    assert "6 attention heads" in msg and "bag of 4 ranks" in msg and "[1, 2, 3, 6]" in msg
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        check_heads(0, Topology.parse("g1n1"))


def test_parallel_dims_validation() -> None:
    with pytest.raises(ValueError, match=r"covers 4 ranks, but the world has 3"):
        TopologyDims(Topology.parse("g2n2"), 3)
    with pytest.raises(ValueError, match=r"12 attention heads .* bag of 8"):
        TopologyDims(Topology.parse("g8n1"), 8, num_heads=12)
    with pytest.raises(ValueError, match=r"bad topology term 'g2x2'"):
        TopologyDims(Topology.parse("g2x2"), 4)
    with pytest.raises(TypeError, match="Topology.parse"):
        TopologyDims("g2n2", 4)  # type: ignore[arg-type]
    dims = TopologyDims(Topology.parse("g1n2+g2n1", world_size=8), 8, num_heads=4)
    lay = dims.layout(7)
    assert (lay.bag, lay.bag_ranks, lay.rank_in_bag, lay.bag_size) == (5, (6, 7), 1, 2)
    assert (lay.balance_group, lay.balance_ranks) == (1, (4, 5, 6, 7))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 8\)"):
        dims.layout(8)


def test_bag_groups_without_a_process_group_is_a_world_of_one() -> None:
    assert not dist.is_initialized()
    groups = BagGroups.build(Topology.parse("g1n1"))
    assert groups.bag_group is None and groups.balance_group is None and groups.rank == 0
    with pytest.raises(ValueError, match="the world has 1"):
        BagGroups.build(Topology.parse("g2n1"))


def test_group_of_one_needs_no_process_group() -> None:
    x = torch.randn(5, 2, requires_grad=True)
    assert all_to_all_varsize(x, [5], [5]) is x
    assert all_to_all_packed([x, torch.arange(5)], [5], [5])[0] is x
    with pytest.raises(ValueError, match="receives what it sends"):
        all_to_all_varsize(x, [5], [4])
    with pytest.raises(ValueError, match="not initialized"):
        all_to_all_varsize(x, [2, 3], [2, 3])
    with pytest.raises(ValueError, match="sum to 4, but the input has 5 rows"):
        all_to_all_varsize(x, [4], [4])


def test_single_rank_route_and_attention() -> None:
    plan = plan_balance([[3, 6, 2]], Topology.parse("g1n1"), MODEL)
    x = torch.randn(11, 4)
    assert torch.equal(route(plan, 0, x), x) and torch.equal(reverse_route(plan, 0, x), x)
    feats = route(plan, 0, {"x": x, "pos": torch.arange(11)})
    assert torch.equal(feats["pos"], torch.arange(11))
    rp = route_plan(plan, 0)
    assert rp.local_only and rp.token_seq_local.tolist() == [0] * 3 + [1] * 6 + [2] * 2
    with pytest.raises(ValueError, match="expected 11 rows"):
        route(plan, 0, torch.randn(10, 4))
    q, k, v = (torch.randn(11, 2, 8, requires_grad=True) for _ in range(3))
    out = UlyssesAttention(plan, 0, None)(q, k, v)
    ref = reference_attention(q, k, v, torch.tensor([0, 3, 9, 11], dtype=torch.int32))
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_route_plans_simulated(spec: str) -> None:
    """Run every rank's RoutePlan in one process: splits agree pairwise, and an emulated
    all-to-all (concatenation by source) delivers exactly the plan's chunks."""
    for case, plan in _plans(spec).items():
        global_rows = torch.arange(int(plan.seq_lens.sum()))
        topo = plan.topology
        dims = TopologyDims(topo, WORLD)
        rps = [RoutePlan.build(plan, r, dims.layout(r).balance_ranks) for r in range(WORLD)]
        sent = {}
        for r, rp in enumerate(rps):
            buf = global_rows[_home_rows(plan, r)][rp.send_index]
            sent[r] = dict(zip(rp.peers, torch.split(buf, list(rp.send_splits))))
            assert torch.equal(buf[rp.home_index], global_rows[_home_rows(plan, r)])
        for r, rp in enumerate(rps):
            got = torch.cat([sent[p][r] for p in rp.peers])
            assert [len(sent[p][r]) for p in rp.peers] == list(rp.recv_splits), (case, r)
            assert torch.equal(got, _routed_rows(plan, r)), (case, r)


def test_route_plan_rejects_peers_outside_the_plan() -> None:
    plan = plan_balance(_random_lens(0, 4), Topology.parse("g4n1"), MODEL)
    with pytest.raises(ValueError, match=r"outside the routing group \[0, 1\]"):
        RoutePlan.build(plan, 0, peers=(0, 1))
    with pytest.raises(ValueError, match="ascending distinct ranks"):
        RoutePlan.build(plan, 0, peers=(1, 0, 2, 3))


@pytest.mark.parametrize("spec", TOPOLOGIES)
def test_ulysses_layout_reassembles_whole_sequences(spec: str) -> None:
    """Emulate the head-scatter exchange by concatenating each bag rank's routed rows:
    ``seq_order`` must put them in whole-sequence order, ``rank_order`` undo it."""
    for case, plan in _plans(spec).items():
        topo = plan.topology
        for bag in range(topo.num_bags):
            ranks = list(topo.bag_ranks(bag))
            received = torch.cat([_routed_rows(plan, r) for r in ranks])  # grouped by source rank
            seq_start = _seq_start(plan)
            whole = [int(seq_start[s]) + t for s in plan.bag_sequences(bag) for t in range(plan.seq_lens[s])]
            for r in ranks:
                lay = UlyssesLayout.build(plan, r)
                assert list(lay.recv_splits) == [len(_routed_rows(plan, p)) for p in ranks], (case, r)
                assert received[lay.seq_order].tolist() == whole, (case, r)
                assert torch.equal(received[lay.seq_order][lay.rank_order], received)
                bag_lens = plan.seq_lens[plan.bag_sequences(bag)]
                assert lay.cu_seqlens.tolist() == [0, *np.cumsum(bag_lens).tolist()]
