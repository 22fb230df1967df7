"""The serving simulator (knapray.planning.inference.serving) and `knapray bench serve`: a seeded
stream, policies that never run two requests on one GPU at once, latencies never below a
request's own best time, a balanced plan no longer than either baseline's on one batch,
and bad flags as one line with exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from knapray.cli import main
from knapray.planning.inference import serving as sv


@pytest.fixture(scope="module")
def times8():
    return sv.service_times(8)


def _overlaps(served: sv.Served) -> list[tuple[int, int, int]]:
    """(gpu, request, request) of every two requests that ran on one GPU at once."""
    by_gpu: dict[int, list[int]] = {}
    for i, ranks in enumerate(served.ranks):
        for r in ranks:
            by_gpu.setdefault(r, []).append(i)
    bad = []
    for r, reqs in by_gpu.items():
        reqs.sort(key=lambda i: served.start[i])
        for a, b in zip(reqs, reqs[1:]):
            if served.start[b] < served.finish[a] - 1e-9:
                bad.append((r, a, b))
    return bad


def test_tokens_and_seconds_follow_the_documented_choices(times8):
    kinds = {k.name: k for k in sv.MIX}
    assert kinds["512x512"].tokens == 32 * 32 + 512  # Flux: joint attention, T5 512
    assert kinds["2048x2048"].tokens == 128 * 128 + 512
    assert kinds["1024x576"].tokens == 64 * 36 + 512
    assert kinds["480p 81f clip"].tokens == 52 * 30 * 21  # Wan: cross-attention, visual tokens only
    clip = kinds["480p 81f clip"]
    wan = sv.inference_cost("wan14b")
    assert wan.passes == 1.0 and wan.ulysses_a2a_per_layer == 6
    assert sv.request_seconds(clip, 1, wan) == pytest.approx(50 * 2 * float(wan.seq_cost(clip.tokens, 1)))
    # CFG parallel on the halves of a bag of 8 beats both passes on all 8.
    assert sv.request_seconds(clip, 8, wan) == pytest.approx(50 * float(wan.seq_cost(clip.tokens, 4)))
    assert times8.sizes == (1, 2, 4, 8) and sv.service_times(32).sizes == (1, 2, 4, 8, 16, 32)


def test_the_stream_is_seeded_and_the_rate_only_scales_it():
    a, b = sv.request_stream(400, 0.5, seed=3), sv.request_stream(400, 0.5, seed=3)
    assert np.array_equal(a.kind, b.kind) and np.array_equal(a.arrival, b.arrival)
    fast = sv.request_stream(400, 2.0, seed=3)
    assert np.array_equal(fast.kind, a.kind) and np.allclose(fast.arrival * 4, a.arrival)
    other = sv.request_stream(400, 0.5, seed=4)
    assert not np.array_equal(other.kind, a.kind)
    assert np.all(np.diff(a.arrival) >= 0)
    share = np.bincount(a.kind, minlength=len(sv.MIX)) / 400
    assert np.allclose(share, [k.weight for k in sv.MIX], atol=0.06)
    with pytest.raises(ValueError):
        sv.request_stream(10, 0.0, 0)


@pytest.mark.parametrize("policy", sv.POLICIES)
@pytest.mark.parametrize("load", [0.3, 0.9])
def test_no_gpu_runs_two_requests_at_once_and_no_latency_beats_the_best(policy, load, times8):
    stream = sv.request_stream(150, load * sv.capacity(times8), seed=1)
    served = sv.serve(policy, stream, times8)
    if policy in ("batches", "knapray"):  # a bag's packed loop: its requests start together
        assert all(served.start[a] == served.start[b] for _, a, b in _overlaps(served))
    else:
        assert not _overlaps(served)
    assert np.all(served.start >= stream.arrival - 1e-9)
    assert np.all(served.latency >= served.best - 1e-9)
    assert np.all(np.isfinite(served.finish))
    if policy == "dp":
        assert all(len(r) == 1 for r in served.ranks)
    if policy == "usp":
        assert all(r == tuple(range(8)) for r in served.ranks)
        assert np.all(served.start[1:] >= served.finish[:-1] - 1e-9)  # FIFO, one at a time
    if policy == "knapray":
        assert {len(r) for r in served.ranks} <= set(times8.sizes)
        assert all(r[0] % len(r) == 0 for r in served.ranks)  # aligned blocks
        assert served.plans >= 1


def test_knapray_bags_stay_in_a_node_or_take_whole_nodes():
    times = sv.service_times(32)
    served = sv.serve("knapray", sv.request_stream(120, 0.7 * sv.capacity(times), seed=2), times)
    assert all(served.start[a] == served.start[b] for _, a, b in _overlaps(served))  # packed loops only
    for ranks in served.ranks:
        nodes = {r // 8 for r in ranks}
        assert len(nodes) == 1 or len(ranks) == 8 * len(nodes), ranks
    light = sv.serve("knapray", sv.request_stream(60, 0.05 * sv.capacity(times), seed=2), times)
    assert max(len(r) for r in light.ranks) == 32  # a lone clip takes the gang, as static USP would


def test_the_gangs_blocks_are_the_simulators():
    """``knapray serve``'s gang on ``auto`` forms the blocks the simulator plans over: a
    node's aligned blocks, and whole nodes where the heads split that many ways."""
    from knapray.driver.gang import gang_blocks
    from knapray.planning.shapes.blocks import blocks_of

    blocks, specs, where = gang_blocks(None, 16, 32)
    assert blocks == blocks_of(16, (1, 2, 4, 8, 16), 8) and blocks[0] == (0, 16)
    assert specs[0] == "g16n1" and where[0] == ("g16n1", 0) and len(where) == len(blocks)
    assert gang_blocks(None, 16, 24)[0] == blocks_of(16, (1, 2, 4, 8), 8)  # Flux's 24 heads: no block of 16
    assert gang_blocks(None, 4, 24)[0] == ((0, 4), (0, 2), (2, 2), (0, 1), (1, 1), (2, 1), (3, 1))


def test_a_light_load_runs_wide_and_a_heavy_one_packs_single_ranks():
    """The balanced order plans the waiting requests over every partition of the ranks into
    blocks: one request alone takes the block of four (it finishes soonest there); eight at
    once, each twice as fast on four ranks as on one (half the ranks' time wasted), are
    packed two to a rank (the partition of the smallest makespan)."""
    from knapray.planning.shapes.blocks import blocks_of
    from knapray.planning.inference.scheduler import BagScheduler, partitions

    blocks = blocks_of(4, (1, 2, 4))  # all four, then (0, 1), (2, 3), then ranks 0..3 alone
    assert blocks == ((0, 4), (0, 2), (2, 2), (0, 1), (1, 1), (2, 1), (3, 1))
    assert sorted(partitions(blocks, 4)) == sorted([(3, 4, 5, 6), (1, 5, 6), (3, 4, 2), (1, 2), (0,)])
    seconds = [2.0] + [2.8] * 2 + [4.0] * 4
    alone = BagScheduler(blocks)
    alone.add("one", 0.0, seconds, steps=4)
    assert alone.decide(0.0) == [(0, ["one"])]
    loaded = BagScheduler(blocks)
    for k in range(8):
        loaded.add(k, 0.0, seconds, steps=4)
    started = dict(loaded.decide(0.0))
    assert [blocks[b] for b in sorted(started)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert sorted(len(keys) for keys in started.values()) == [2, 2, 2, 2] and loaded.waiting == []
    assert loaded.decide(0.0) == [] and loaded.finished(5, 8.0) == started[5]


def test_blocks_of_whole_nodes_and_of_a_short_last_node():
    from knapray.planning.shapes.blocks import aligned_blocks, blocks_of

    # 32 ranks in nodes of 8: the gang of all, two of 16, then every node's own blocks
    blocks = blocks_of(32, (1, 2, 4, 8, 16, 32), 8)
    assert blocks[:3] == ((0, 32), (0, 16), (16, 16)) and blocks[3:6] == ((0, 8), (0, 4), (4, 4))
    assert len(blocks) == 3 + 4 * 15
    assert blocks_of(12, (1, 2, 4, 8), 8)[-3:] == ((9, 1), (10, 1), (11, 1))  # ranks 8..11: a short node
    assert list(blocks_of(16, (1, 2, 4, 8), 8)) == aligned_blocks(16, 8)  # training's blocks, the same order
    for bad in ((3,), (24,), (64,)):
        with pytest.raises(ValueError, match=f"block size {bad[0]}"):
            blocks_of(32, bad, 8)


def test_a_packed_loop_ends_each_request_after_its_own_steps():
    from knapray.planning.inference.scheduler import packed_finish

    # 2 s over 4 steps and 7 s over 7 steps: 4 shared steps of 0.5 + 1 s, then 3 of 1 s
    assert packed_finish([2.0, 7.0], [4, 7]).tolist() == pytest.approx([6.0, 9.0])


@pytest.mark.parametrize("policy", ["usp", "dp"])
def test_fifo_on_fixed_blocks_is_first_in_first_out(policy, times8):
    stream = sv.request_stream(80, 0.8 * sv.capacity(times8), seed=2)
    served = sv.serve(policy, stream, times8)
    assert np.all(np.diff(served.start) >= -1e-9)  # requests start in the order they arrived


def test_rate_at_p99_meets_its_target_and_dp_cannot_meet_a_tight_one(times8):
    tight = sv.p99_targets(times8)["tight"]
    rate, served = sv.rate_at_p99("knapray", times8, tight, 60, seed=0, iterations=4)
    assert rate > 0 and served is not None and served.p99 <= tight
    assert sv.rate_at_p99("dp", times8, tight, 60, seed=0, iterations=4) == (0.0, None)


def test_bench_serve_predicts_a_small_stream(capsys):
    assert main(["bench", "serve", "--gpus", "8", "--rates", "0.5", "--requests", "40", "--json"]) == 0
    out = capsys.readouterr().out
    assert "throughput at equal p99" in out and "cost model" in out
    import json

    data = json.loads(out.strip().splitlines()[-1])
    assert {r["policy"] for r in data["predicted"]} == set(sv.POLICIES)
    assert [r["target"] for r in data["at_p99"]] == ["tight", "loose"]


def test_measure_serves_every_policy_and_finds_the_loads_that_meet_the_p99(capsys):
    from knapray.benchmarks.serve import measure

    calls = []
    times = sv.service_times(4)

    def serve_measured(policies, loads, n, seed, ranks):
        calls.append((tuple(policies), ranks))
        cap = sv.capacity(times)
        return {"served": {p: [sv.serve(p, sv.request_stream(n, load * cap, seed), times) for load in loads]
                           for p in policies}, "capacity": cap, "seconds": times.on_one}

    out = measure([0.3, 0.6], 20, 0, serve_measured=serve_measured)
    assert calls == [(sv.POLICIES, 4)] and len(out["rows"]) == 2 * len(sv.POLICIES)
    assert [r["target"] for r in out["at_p99"]] == ["tight", "loose"]
    assert all(set(r["throughput_rps"]) == set(sv.POLICIES) and r["p99_target_s"] > 0 for r in out["at_p99"])
    assert "at equal p99" in capsys.readouterr().out


def _one_line(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("knapray"), (code, err)
    return err[0]


@pytest.mark.parametrize("argv, names", [
    (["--gpus", "0"], ["--gpus", "'0'"]),
    (["--gpus", "12"], ["--gpus 12", "whole nodes"]),
    (["--gpus", "99999"], ["--gpus", "4096"]),
    (["--rates", "-1"], ["--rates", "'-1'"]),
    (["--rates", "nan"], ["--rates", "nan"]),
    (["--rates", "1000"], ["--rates 1000", "capacity"]),
    (["--requests", "0"], ["--requests", "'0'"]),
    (["--steps", "3"], ["unrecognized arguments: --steps"]),
])
def test_bad_flags_are_one_line_and_exit_2(argv, names, capsys):
    line = _one_line(["bench", "serve", *argv], capsys)
    for name in names:
        assert name in line, (name, line)


def test_the_xdit_fitted_overhead_reproduces_the_published_ratio():
    o = sv.ulysses_layer_fit()
    flux = sv.inference_cost("flux")
    kind = next(k for k in sv.MIX if k.name == "1024x1024")
    t1, t4 = (sv.request_seconds(kind, g, flux, ulysses_layer_s=o) for g in (1, 4))
    assert t4 / t1 == pytest.approx(1.63 / 4.30, rel=1e-9)
    assert sv.request_seconds(kind, 1, flux) == t1  # one GPU pays no Ulysses overhead
    assert sv.request_seconds(kind, 4, flux) < t4
    with_o = sv.service_times(8, ulysses_layer_s=o)
    assert np.all(with_o.on_gang > sv.service_times(8).on_gang) and np.all(with_o.on_one == sv.service_times(8).on_one)


def test_a_port_is_refused_while_a_server_listens_and_not_after_it_stopped():
    """``knapray serve`` checks its port before anything starts: refused while another server
    listens on it; taken right after a server on it stopped, its last connection left in
    TIME_WAIT (its side closed first), as Serve's own HTTP server takes it. Before, the check
    refused the port for a minute after a stopped ``knapray serve``."""
    import socket

    from knapray.commands.serve import check_port

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    with pytest.raises(ValueError, match=rf"--port {port}: cannot listen on 127.0.0.1:{port}"):
        check_port("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side first: its end of the connection waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    check_port("127.0.0.1", port)  # no error
