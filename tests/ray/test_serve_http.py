"""``knapray serve`` over real HTTP: a local Ray Serve deployment answers concurrent
requests (good, malformed, oversized, lost by a block once and twice) each as it should,
keeps serving after the bad ones, and counts them in its metrics; a flood of requests (the
extremes of every field, more than its queue holds, a client gone while queued) leaves it
answering; jobs are cancelled (DELETE, a client gone: dropped while queued, stopped between
two steps while running) and deadlines kept; the official ``openai`` client draws from it
and reads its errors; every route but /health wants its key. The gang is a stand-in with the
real one's API (``FakeGang``: continuous blocks in threads, gradient images, a block losing
a job on request), so that this runs in seconds; ``test_the_real_gang_serves_a_trained_run``
serves the real one. Then the Serve config for ``serve deploy`` and the command's checks
before Ray starts."""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
needs_serve = pytest.mark.skipif(
    importlib.util.find_spec("fastapi") is None or getattr(importlib.util.find_spec("ray"), "origin", None) is None,
    reason="needs ray[serve] (the serve extra)")


# ---- the stand-in gang ------------------------------------------------------------------------------


@dataclass
class FakeResult:
    """``knapray.driver.gang.JobResult``'s fields."""

    frames: np.ndarray | None = None
    error: str | None = None
    latent: np.ndarray | None = None
    lost: bool = False
    cancelled: bool = False
    seconds: dict = field(default_factory=dict)
    ranks: tuple = ()


RUN_S = 0.3
HOLD_S = 5.0
SLOW_S = 1.0
STEP_S = 0.05
"""A step of the stand-in's blocks (a cancelled job leaves between two)."""
PACK = 8
"""Jobs a block of the stand-in runs packed in one loop, at most."""
RESTART_S = 0.3
ENCODE_S, DECODE_S = 0.01, 0.04
KEY = "test-key-0123456789"
"""The API key of the stand-in's deployment."""


@dataclass(eq=False)
class FakeJob:
    key: int
    job: object
    future: concurrent.futures.Future
    arrival: float
    state: str = "waiting"
    """waiting, running, done (as ``Gang.state`` says)."""
    stop: bool = False
    started: float = 0.0


class FakeGang:
    """``knapray.driver.gang.Gang``'s API in one process: the run's real rules; one block per
    rank (two), each taking the waiting jobs (up to ``PACK``) as soon as it is free and running
    them packed in one loop of ``STEP_S`` steps, a job leaving after its own time (``RUN_S``;
    a caption with the word "hold" ``HOLD_S``, "slow" ``SLOW_S``; "stubborn": ``HOLD_S`` in one
    step, so that a cancel takes effect only at its end) with a gradient (T, H, W, 3) and its
    stage seconds. ``cancel`` drops a waiting job, or stops a running one between two steps.
    Caption "lose once" is lost by its block at its first step the first time, "lose always"
    every time (only that job: the stand-in is deterministic), and the gang is then ``broken``
    until its running blocks end and ``RESTART_S`` more (it restarts itself); "fail" fails. A
    word "trace:PATH" appends to PATH "drawn" when the job starts, then "stopped" or "done"."""

    def __init__(self, rules, blocks: int) -> None:
        self.rules = rules
        self.broken = False
        self.restarts = 0
        self.seen: collections.Counter = collections.Counter()
        self.cv = threading.Condition()
        self.waiting: collections.deque[FakeJob] = collections.deque()
        self.jobs: dict[int, FakeJob] = {}
        self.next_key = 0
        self.busy = 0
        self.restarting = False
        for b in range(blocks):
            threading.Thread(target=self._block, args=(b,), name=f"fake-block-{b}", daemon=True).start()

    @classmethod
    def start(cls, run_dir, world_size, *, topology=None, device="cpu", checkpoint=None):
        from knapray.driver.run_dir import read_run_config
        from knapray.inference.jobs import run_rules

        assert (world_size, device) == (2, "cpu"), (world_size, device)
        return cls(run_rules(read_run_config(run_dir)), world_size)

    # ---- the API ----

    def submit(self, job, decode=True):
        future = concurrent.futures.Future()
        try:
            self.rules.check(job)
        except ValueError as e:
            future.key = -1
            future.set_result(FakeResult(error=str(e)))
            return future
        with self.cv:
            future.key = key = self.next_key
            self.next_key += 1
            self.jobs[key] = s = FakeJob(key, job, future, time.monotonic())
            self.waiting.append(s)
            self.cv.notify_all()
        return future

    def cancel(self, key):
        with self.cv:
            s = self.jobs.get(key)
            if s is None:
                return "unknown"
            if s.state == "running":
                s.stop = True
                return "stopping"
            self.waiting.remove(s)
        self._resolve(s, FakeResult(error="cancelled", cancelled=True, seconds={"encode": ENCODE_S}))
        return "dropped"

    def state(self, key):
        with self.cv:
            s = self.jobs.get(key)
            return "unknown" if s is None else s.state

    def generate(self, jobs, decode=True):
        return [f.result() for f in [self.submit(job, decode) for job in jobs]]

    def close(self) -> None:
        pass

    # ---- its blocks ----

    def _resolve(self, s: FakeJob, result: FakeResult) -> None:
        with self.cv:
            s.state = "done"
            self.jobs.pop(s.key, None)
        if not s.future.done():  # not cancelled by its awaiter going away (the replica shutting down)
            s.future.set_result(result)

    def _block(self, b: int) -> None:
        while True:
            with self.cv:
                while self.broken or not self.waiting:
                    self.cv.wait()
                loop = [self.waiting.popleft() for _ in range(min(PACK, len(self.waiting)))]
                self.busy += 1
                now = time.monotonic()
                for s in loop:
                    s.state, s.started = "running", now
                    self.seen[s.job.caption] += 1
            for s in loop:
                _trace(s.job.caption, "drawn")
            self._run(b, loop)
            with self.cv:
                self.busy -= 1
                self.cv.notify_all()

    def _run(self, b: int, loop: list[FakeJob]) -> None:
        first = True
        while loop:
            words = {w for s in loop for w in (s.job.caption or "").split()}
            time.sleep(HOLD_S if "stubborn" in words else STEP_S)
            now = time.monotonic()
            for s in list(loop):
                caption, ran = s.job.caption or "", now - s.started
                seconds = {"queue": s.started - s.arrival, "encode": ENCODE_S}
                with self.cv:
                    stop = s.stop
                lost = caption == "lose always" or (caption == "lose once" and self.seen[caption] == 1)
                if stop:
                    result = FakeResult(error="cancelled", cancelled=True, seconds={**seconds, "denoise": ran})
                    _trace(caption, "stopped")
                elif first and lost:
                    result = FakeResult(error="rank 1 died", lost=True, seconds=seconds)
                    self._lose()
                elif first and caption == "fail":
                    result = FakeResult(error="out of memory", seconds=seconds)
                elif ran >= _duration(caption) - 1e-3:
                    ramp = np.linspace(0, 255, s.job.width, dtype=np.float32).astype(np.uint8)
                    frame = np.broadcast_to(ramp[None, :, None], (s.job.height, s.job.width, 3))
                    result = FakeResult(np.stack([frame] * s.job.frames), seconds={
                        **seconds, "denoise": _duration(caption), "decode": DECODE_S})
                    _trace(caption, "done")
                else:
                    continue
                result.ranks = (b,)
                loop.remove(s)
                self._resolve(s, result)
            first = False

    def _lose(self) -> None:
        """Broken until the running blocks end, then restarted ``RESTART_S`` later."""
        with self.cv:
            self.broken = True
            if self.restarting:
                return
            self.restarting = True

        def restart() -> None:
            with self.cv:
                self.cv.wait_for(lambda: self.busy == 0)
            time.sleep(RESTART_S)
            with self.cv:
                self.broken, self.restarting = False, False
                self.restarts += 1
                self.cv.notify_all()

        threading.Thread(target=restart, name="fake-restart", daemon=True).start()


def _duration(caption: str) -> float:
    words = caption.split()
    return HOLD_S if "hold" in words or "stubborn" in words else SLOW_S if "slow" in words else RUN_S


def _trace(caption: str | None, what: str) -> None:
    for word in (caption or "").split():
        if word.startswith("trace:"):
            with open(word[len("trace:"):], "a") as f:
                f.write(what + "\n")


# ---- HTTP --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: bytes | None = None, timeout: float = 60, key: str | None = KEY,
          method: str | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET, or of a POST of ``body`` (``method``: another),
    with the stand-in's key (``key``: another, or None)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, method=method or ("GET" if body is None else "POST"), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _error(body: bytes) -> str:
    doc = json.loads(body)
    assert list(doc) == ["error"], doc
    return doc["error"]


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics:\n{text}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory):
    """A local deployment of the stand-in gang (2 workers: two blocks, a queue of 64, sides up
    to 512, an API key); Serve shut down at the end (Ray is the session's)."""
    from ray import serve

    from dist_utils import sampling_run_dir
    from knapray.driver.serving import ServeOptions, build_app

    run = sampling_run_dir(tmp_path_factory.mktemp("serve"))
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(ServeOptions(run=str(run), world_size=2, device="cpu", max_queue=64, max_side=512,
                                         api_key=KEY, gang="test_serve_http:FakeGang")),
                  name="knapray-test", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def _png_size(body: bytes) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(body)).size


def _check_clip(kind: str, body: bytes) -> None:
    if importlib.util.find_spec("av") is not None:
        assert kind == "video/mp4" and body[4:8] == b"ftyp", (kind, body[:12])
        import av

        with av.open(io.BytesIO(body)) as f:
            frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(frames) == 3 and frames[0].shape == (32, 48, 3)
    else:  # no MP4 encoder: an animated PNG
        assert kind == "image/apng" and body.startswith(PNG) and b"acTL" in body[:200], kind


CASES = {
    # name: (body, query, status, check of (content type, body))
    "image": ({"caption": "a red bicycle", "size": "64x48", "steps": 2, "seed": 1}, "", 200,
              lambda kind, body: kind == "image/png" and body.startswith(PNG) and _png_size(body) == (64, 48)),
    "clip": ({"caption": "a cat", "width": 48, "height": 32, "frames": 3, "steps": 2}, "", 200,
             lambda kind, body: _check_clip(kind, body) is None),
    "not json": (b"{nope", "", 400, lambda kind, body: _error(body).startswith("body: not JSON")),
    "not an object": ([1, 2], "", 400, lambda kind, body: _error(body).startswith("body: a JSON list")),
    "steps 0": ({"caption": "x", "steps": 0}, "", 400,
                lambda kind, body: _error(body) == "steps: 0; an integer in [1, 100] (this server's --max-steps)"),
    "steps a string": ({"steps": "2"}, "", 400, lambda kind, body: _error(body).startswith("steps: '2'; an integer")),
    "size not a multiple": ({"size": "500x512"}, "", 400,
                            lambda kind, body: _error(body).startswith("size: 500x512")
                            and "nearest valid: 496x512 or 512x512" in _error(body)),
    "size not a size": ({"size": "big"}, "", 400,
                        lambda kind, body: "size: 'big': expected WIDTHxHEIGHT" in _error(body)),
    "side too long": ({"size": "9000x512"}, "", 400,
                      lambda kind, body: _error(body) == "size: 9000x512: at most 8192 pixels a side"),
    "side past the server's": ({"size": "528x512"}, "", 400,
                               lambda kind, body: _error(body) == "size: 528x512: at most 512 pixels a side (this "
                               "server's --max-request-side)"),
    "too many frames": ({"width": 512, "height": 512, "frames": 65}, "", 400,
                        lambda kind, body: _error(body).startswith("width x height 512x512 frames 65: 66560 image "
                                                                   "tokens")),
    "guidance NaN": (b'{"guidance": NaN}', "", 400, lambda kind, body: _error(body).startswith("guidance: nan")),
    "unknown field": ({"captoin": "x"}, "", 400, lambda kind, body: _error(body).startswith("captoin: unknown field")),
    "caption a number": ({"caption": 5}, "", 400, lambda kind, body: _error(body).startswith("caption: a JSON int")),
    "body too large": ({"caption": "x" * (2 << 20)}, "", 413, lambda kind, body: _error(body).startswith("body: ")),
    "lost once": ({"caption": "lose once", "size": "32x32"}, "", 200,
                  lambda kind, body: kind == "image/png" and _png_size(body) == (32, 32)),
    "lost twice": ({"caption": "lose always", "size": "32x32"}, "", 503,
                   lambda kind, body: "lost a rank twice" in _error(body)),
    "gang error": ({"caption": "fail", "size": "32x32"}, "", 500,
                   lambda kind, body: _error(body) == "job: out of memory"),
    "async": ({"caption": "later", "size": "16x16", "wait": False}, "", 202,
              lambda kind, body: set(json.loads(body)) == {"job", "poll"}),
    "async by query": ({"caption": "later too", "size": "16x32"}, "?async=1", 202,
                       lambda kind, body: set(json.loads(body)) == {"job", "poll"}),
}
TO_GANG = ("image", "clip", "lost once", "lost once", "lost twice", "lost twice", "gang error", "async",
           "async by query")
"""Jobs submitted to the gang: the lost ones twice."""


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_concurrent_requests_each_get_their_answer(served):
    def send(name):
        doc, query, _, _ = CASES[name]
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        return _call(f"{served}/v1/generate{query}", body)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        answers = dict(zip(CASES, pool.map(send, CASES)))
    for name, (status, kind, body) in answers.items():
        assert status == CASES[name][2], (name, status, body[:300])
        assert CASES[name][3](kind, body), (name, kind, body[:300])

    for name, size in (("async", (16, 16)), ("async by query", (16, 32))):  # polled until answered
        poll = json.loads(answers[name][2])["poll"]
        while (got := _call(served + poll))[0] == 202:
            assert json.loads(got[2])["status"] in ("queued", "running") and time.monotonic() - t0 < 60
            time.sleep(0.1)
        assert got[0] == 200 and got[1] == "image/png" and _png_size(got[2]) == size, got[:2]
    status, _, body = _call(f"{served}/v1/jobs/{'0' * 32}")
    assert status == 404 and _error(body).startswith("job: no job")

    # Still serving after every bad request and the lost block, once the gang has restarted itself.
    status, _, body = _until(lambda: (got := _call(f"{served}/health"))[0] == 200 and got, timeout=10)
    assert json.loads(body)["status"] == "up", body
    status, kind, body = _call(f"{served}/v1/generate", json.dumps({"size": "16x16"}).encode())
    assert status == 200 and kind == "image/png"

    status, kind, text = _call(f"{served}/metrics")
    text = text.decode()
    assert status == 200 and kind.startswith("text/plain"), kind
    by_code = collections.Counter(str(c[2]) for c in CASES.values()) + collections.Counter({"200": 1})
    for code, n in by_code.items():
        assert _metric(text, "knapray_serve_requests_total", f'{{code="{code}",route="generate"}}') == n, code
    jobs = len(TO_GANG) + 1  # and the request after them: every one started on a block
    assert _metric(text, "knapray_serve_latency_seconds_count") == len(set(TO_GANG)) + 1  # one answer each
    assert _metric(text, "knapray_serve_lost_total") == 3
    assert _metric(text, "knapray_serve_retries_total") == 2
    # The retry of "lose always" lost after one restart: a second. Counted from the gang's own
    # count (a look at ``broken`` every 50 ms missed one here when the gang broke again within it).
    assert _until(lambda: _counter(served, "knapray_serve_gang_restarts_total") >= 2, timeout=5)
    assert _metric(text, "knapray_serve_queue_length") == 0 and _metric(text, "knapray_serve_running") == 0
    for stage in ("queue", "encode"):
        assert _metric(text, f"knapray_serve_{stage}_seconds_count") == jobs, stage
    assert _metric(text, "knapray_serve_block_ranks_count") == _metric(text, "knapray_serve_block_ranks_sum") == jobs
    drawn = jobs - 4  # no picture: the three lost attempts and the failed one
    for stage, seconds in (("encode", ENCODE_S * jobs / drawn), ("denoise", RUN_S), ("decode", DECODE_S)):
        assert _metric(text, f"knapray_serve_{stage}_seconds_sum") == pytest.approx(drawn * seconds), stage
    for stage in ("denoise", "decode"):
        assert _metric(text, f"knapray_serve_{stage}_seconds_count") == drawn, stage
    assert _metric(text, "knapray_serve_media_seconds_count") == drawn


# ---- limits, floods, cancelling, deadlines, keys, the openai client -----------------------------------------


def _post(served: str, doc: dict, route: str = "/v1/generate", **kwargs) -> tuple[int, str, bytes]:
    return _call(f"{served}{route}", json.dumps(doc).encode(), **kwargs)


def _until(what, timeout: float = 20, every: float = 0.05):
    """``what()`` once it is truthy, polled for ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(every)
    return got


def _metrics(served: str) -> str:
    return _call(f"{served}/metrics")[2].decode()


def _counter(served: str, name: str, labels: str = "") -> float:
    """A metric's value, 0 where the series has not appeared yet."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", _metrics(served), re.M)
    return float(m.group(1)) if m else 0.0


def _hold(served: str, where: Path, words: str = "hold", blocks: int = 2) -> list[threading.Thread]:
    """Threads whose requests (caption ``words``) hold ``blocks`` of the stand-in's blocks,
    returned once each runs (sent one after another: each takes the block left free)."""
    threads = []
    for i in range(blocks):
        trace = where / f"{words.replace(' ', '-')}-{i}"
        t = threading.Thread(target=_post, args=(served, {"caption": f"{words} trace:{trace}", "size": "16x16"}),
                             daemon=True)
        t.start()
        _until(trace.exists)
        threads.append(t)
    return threads


def _queue(served: str) -> int:
    return json.loads(_call(f"{served}/health", key=None)[2])["queue"]


def _send_and_hang_up(served: str, doc: dict, until) -> None:
    """A client that sends ``doc`` to wait for its answer, and hangs up once ``until()``."""
    from urllib.parse import urlsplit

    url = urlsplit(served)
    body = json.dumps(doc).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        _until(until)


def _gone_while_queued(served: str, doc: dict) -> None:
    """A client that sends ``doc`` to wait for its answer, sees it submitted, and hangs up."""
    queued = _queue(served)
    _send_and_hang_up(served, doc, lambda: _queue(served) > queued)


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_flood_and_the_extremes_leave_the_server_answering(served, tmp_path):
    """A 10^5-step and a 10^9-step request, 200 concurrent small ones against a queue of 64
    and a client gone while queued: the extremes are 400, every small one 200 or 503, the
    gone client's job cancelled (never drawn), /health 200 throughout, and an ordinary
    request after them answers within 3x its time alone."""
    ordinary = {"caption": "ordinary", "size": "32x32", "steps": 2}

    def timed() -> float:
        t = time.monotonic()
        status, _, body = _post(served, ordinary)
        assert status == 200, body[:300]
        return time.monotonic() - t

    alone = sorted(timed() for _ in range(3))[1]

    trace = tmp_path / "drawn"
    holds = _hold(served, tmp_path)
    gone = '{reason="disconnect",state="queued"}'
    cancelled = _counter(served, "knapray_serve_cancelled_total", gone)
    _gone_while_queued(served, {"caption": f"trace:{trace}", "size": "16x16", "steps": 2})
    _until(lambda: _counter(served, "knapray_serve_cancelled_total", gone) == cancelled + 1)
    assert all(t.is_alive() for t in holds)  # it was dropped while both blocks were still busy

    health, flooding = [], threading.Event()

    def watch() -> None:
        while flooding.is_set():
            health.append(_call(f"{served}/health", key=None, timeout=30)[0])
            time.sleep(0.1)

    extremes = [{"caption": "x", "steps": 100_000, "wait": False}, {"caption": "x", "steps": 10**9}]
    small = [{"caption": f"small {i}", "size": "16x16", "steps": 2} for i in range(200)]
    flooding.set()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(extremes) + len(small)) as pool:
        answers = list(pool.map(lambda doc: _post(served, doc, timeout=90), extremes + small))
    flooding.clear()
    watcher.join()
    flood_s = time.monotonic() - t0
    for (status, _, body), doc in zip(answers[:2], extremes):
        assert status == 400 and _error(body) == f"steps: {doc['steps']}; an integer in [1, 100] (this server's " \
                                                  "--max-steps)", (status, body)
    codes = collections.Counter(status for status, _, _ in answers[2:])
    # The queue of 64 bounds the jobs submitted and not answered: the two holding the blocks are two of them.
    assert set(codes) <= {200, 503} and codes[200] >= 64 - len(holds) and codes[503] >= 1, codes
    for status, kind, body in answers[2:]:  # 503: our queue full, or Serve's proxy holding its most
        assert (status, kind) == (200, "image/png") or b"max_queued_requests" in body or \
            _error(body).startswith("queue: "), (status, body[:200])
    assert health and set(health) == {200}, collections.Counter(health)
    after = timed()
    for t in holds:
        t.join()
    assert not trace.exists(), "the job of the client that hung up was drawn"
    assert after <= 3 * alone, (after, alone)
    print(f"\nalone {alone:.2f} s, after the flood {after:.2f} s; flood {flood_s:.1f} s: {dict(codes)}; "
          f"{len(health)} health checks")


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_delete_cancels_a_queued_job_and_answers_what_happened(served, tmp_path):
    trace = tmp_path / "drawn"
    holds = _hold(served, tmp_path)
    status, _, body = _post(served, {"caption": f"trace:{trace}", "size": "16x16", "wait": False})
    assert status == 202, body
    job = json.loads(body)["job"]
    status, _, body = _call(f"{served}/v1/jobs/{job}")
    assert status == 202 and json.loads(body) == {"job": job, "status": "queued"}, (status, body)
    deleted = _call(f"{served}/v1/jobs/{job}", method="DELETE")
    assert deleted[0] == 200 and json.loads(deleted[2]) == {"job": job, "status": "cancelled"}, deleted
    status, _, body = _call(f"{served}/v1/jobs/{job}")
    assert status == 410 and _error(body) == f"job {job}: cancelled before it ran (delete)", (status, body)
    assert _call(f"{served}/v1/jobs/{job}", method="DELETE")[0] == 200  # again: the same answer
    for t in holds:
        t.join()

    status, _, body = _post(served, {"caption": "done soon", "size": "16x16", "wait": False})
    done = json.loads(body)["job"]
    _until(lambda: _call(f"{served}/v1/jobs/{done}")[0] == 200)
    status, _, body = _call(f"{served}/v1/jobs/{done}", method="DELETE")
    assert status == 409 and _error(body) == f"job {done}: already answered (done, HTTP 200); nothing to cancel"
    status, _, body = _call(f"{served}/v1/jobs/{'0' * 32}", method="DELETE")
    assert status == 404 and _error(body).startswith("job: no job")
    assert not trace.exists(), "a cancelled job was drawn"
    assert _counter(served, "knapray_serve_cancelled_total", '{reason="delete",state="queued"}') == 1


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_a_running_job_is_stopped_by_delete_and_by_its_client_gone(served, tmp_path):
    """A job of ``HOLD_S`` running on the stand-in: DELETE answers "stopping", the gang
    stops it between two steps, and its answer is 410 within a second, long before it would
    have finished; a client that hangs up while its job runs stops it too."""
    trace = tmp_path / "deleted"
    t0 = time.monotonic()
    status, _, body = _post(served, {"caption": f"hold trace:{trace}", "size": "16x16", "wait": False})
    job = json.loads(body)["job"]
    _until(trace.exists)
    status, _, body = _call(f"{served}/v1/jobs/{job}")
    assert status == 202 and json.loads(body)["status"] == "running", (status, body)
    t1 = time.monotonic()
    deleted = _call(f"{served}/v1/jobs/{job}", method="DELETE")
    assert deleted[0] == 200 and json.loads(deleted[2]) == {"job": job, "status": "stopping"}, deleted
    status, _, body = _until(lambda: (got := _call(f"{served}/v1/jobs/{job}"))[0] != 202 and got)
    stopped = time.monotonic()
    assert status == 410 and _error(body) == f"job {job}: cancelled while it ran: stopped between two steps " \
                                             "(delete)", (status, body)
    assert stopped - t1 < 1.5 and stopped - t0 < HOLD_S - 1, (stopped - t1, stopped - t0)
    assert trace.read_text() == "drawn\nstopped\n"  # the stand-in stopped it: not drawn to its end
    deleted = _call(f"{served}/v1/jobs/{job}", method="DELETE")
    assert deleted[0] == 200 and json.loads(deleted[2]) == {"job": job, "status": "cancelled"}, deleted

    gone = tmp_path / "gone"
    t0 = time.monotonic()
    _send_and_hang_up(served, {"caption": f"hold trace:{gone}", "size": "16x16"}, gone.exists)
    _until(lambda: gone.read_text() == "drawn\nstopped\n", timeout=HOLD_S + 5)
    assert time.monotonic() - t0 < HOLD_S - 1
    for reason in ("delete", "disconnect"):
        labels = f'{{reason="{reason}",state="running"}}'
        assert _counter(served, "knapray_serve_cancelled_total", labels) == 1, reason


EXTREMES = [
    # (route, body, the field its error names)
    *[("/v1/generate", {"steps": v}, "steps") for v in (101, 100_000, 10**9, 2**63, -1, 1.5, True, None, [1])],
    *[("/v1/generate", {"width": v, "height": 64}, "width") for v in (0, 528, 10**9, -16, 64.0, "64")],
    ("/v1/generate", {"width": 64, "height": 10**18}, "height"),
    *[("/v1/generate", {"size": v}, "size") for v in ("0x0", "99999999x16", "16x" + "9" * 5000, "17x16", 16, "")],
    *[("/v1/generate", {"size": "16x16", "frames": v}, "frames") for v in (0, 65_537, 10**9, 2.0)],
    *[("/v1/generate", {"guidance": v}, "guidance") for v in (1e308, -1, 100.5, "3")],
    *[("/v1/generate", {"shift": v}, "shift") for v in (0, 1e308, -1.0)],
    *[("/v1/generate", {"seed": v}, "seed") for v in (-1, 2**63, 10**30, 0.5)],
    *[("/v1/generate", {"like": v}, "like") for v in (-1, 1.5, "0")],
    ("/v1/generate", {"caption": "x" * 65_537}, "caption"),
    ("/v1/generate", {"wait": "no"}, "wait"),
    ("/v1/generate", {"steps": 1, "nope": 1}, "nope"),
    *[("/v1/images/generations", {"prompt": "x", "n": v}, "n") for v in (0, 5, 10**9, "2", 1.0)],
    ("/v1/images/generations", {"prompt": "x", "n": 2, "seed": 2**63 - 1}, "seed"),
    ("/v1/images/generations", {"prompt": "x", "steps": 10**9}, "steps"),
    ("/v1/images/generations", {"prompt": "x", "size": "9000x9000"}, "size"),
    ("/v1/images/generations", {"prompt": "x" * 65_537}, "prompt"),
    ("/v1/images/generations", {"n": 1}, "prompt"),
    ("/v1/images/generations", {"prompt": 3}, "prompt"),
    ("/v1/images/generations", {"prompt": "x", "model": "dall-e-3"}, "model"),
    ("/v1/images/generations", {"prompt": "x", "response_format": "url"}, "response_format"),
    ("/v1/images/generations", {"prompt": "x", "quality": "hd"}, "quality"),
]


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_the_extremes_of_every_field_are_one_line_400s(served):
    """Past every limit and bound, in each field of both POST routes: 400 naming the field
    (OpenAI's shape on its route), nothing queued; then bodies no parser should expand."""
    def send(case):
        route, doc, _ = case
        return _post(served, doc, route)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, EXTREMES))
    for (route, doc, field), (status, _, body) in zip(EXTREMES, answers):
        assert status == 400, (route, str(doc)[:80], status, body[:200])
        error = json.loads(body)["error"]
        message = error["message"] if route.startswith("/v1/images") else error
        assert message.startswith(f"{field}: ") and "\n" not in message and len(message) < 400, (str(doc)[:80], message)
        if route.startswith("/v1/images"):
            assert error["type"] == "invalid_request_error" and error["param"] == field, error
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"steps": 1' + b"0" * 5000 + b"}"):
        status, _, body = _call(f"{served}/v1/generate", raw)
        assert status == 400 and _error(body).startswith("body: not JSON"), body[:200]
    assert _queue(served) == 0 and _call(f"{served}/health", key=None)[0] == 200


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_every_route_but_health_wants_the_key(served):
    routes = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", f"/v1/jobs/{'0' * 32}", None),
              ("DELETE", f"/v1/jobs/{'0' * 32}", None), ("POST", "/v1/generate", b'{"size": "16x16"}'),
              ("POST", "/v1/images/generations", b'{"prompt": "x"}')]
    for key, words in ((None, "no Authorization header"), ("wrong-key", "a wrong key")):
        for method, route, body in routes:
            status, _, answer = _call(f"{served}{route}", body, key=key, method=method)
            error = json.loads(answer)["error"]
            message = error if isinstance(error, str) else error["message"]
            assert status == 401 and message.startswith(f"authorization: {words}"), (route, status, answer)
            if route in ("/v1/models", "/v1/images/generations"):
                assert error["code"] == "invalid_api_key", error
    assert _call(f"{served}/health", key=None)[0] == 200
    assert _call(f"{served}/v1/models")[0] == 200


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_the_openai_client_draws_and_reads_our_errors(served):
    """The official client against the live server: the model and its limits, two images
    of one request, a 400 as ``BadRequestError`` with our message, a wrong key as
    ``AuthenticationError``."""
    import openai
    from PIL import Image

    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0, timeout=60)
    (model,) = client.models.list().data
    assert model.id == "r" and model.owned_by == "knapray"
    assert model.model_extra["limits"] == {"max_steps": 100, "max_side": 512, "max_frames": 65536,
                                           "max_image_tokens": 65536, "max_n": 4, "request_timeout_s": 300.0,
                                           "size_multiple": [16, 16], "max_queue": 64,
                                           "max_body_bytes": 1 << 20}
    got = client.images.generate(model="r", prompt="a red bicycle", n=2, size="64x48", response_format="b64_json",
                                 extra_body={"steps": 2, "seed": 7, "guidance": 1.0})
    assert len(got.data) == 2 and got.size == "64x48"
    for image in got.data:
        assert Image.open(io.BytesIO(base64.b64decode(image.b64_json))).size == (64, 48)

    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a red bicycle", extra_body={"steps": 100_000})
    assert e.value.status_code == 400 and e.value.param == "steps"
    assert e.value.body == {"message": "steps: 100000; an integer in [1, 100] (this server's --max-steps)",
                            "type": "invalid_request_error", "param": "steps", "code": None}
    with pytest.raises(openai.BadRequestError, match="n: 5; an integer in \\[1, 4\\]"):
        client.images.generate(prompt="a red bicycle", n=5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_deadline_drops_a_queued_job_and_stops_a_running_one(served, tmp_path):
    """``request_timeout_s`` 1.5: jobs running past it are answered 504 at their deadline and
    stopped between two steps (two whose single step lasts ``HOLD_S`` stop at its end; one of
    short steps at once); jobs queued behind the first two are dropped, never drawn, whether
    their client waits or polls."""
    from ray import serve

    from dist_utils import sampling_run_dir
    from knapray.driver.serving import ServeOptions, build_app

    run = sampling_run_dir(tmp_path)
    serve.run(build_app(ServeOptions(run=str(run), world_size=2, device="cpu", request_timeout_s=1.5, api_key=KEY,
                                     gang="test_serve_http:FakeGang")),
              name="knapray-deadline", route_prefix="/deadline")
    short = f"{served}/deadline"
    try:
        trace = tmp_path / "drawn"

        def waited(doc):
            t = time.monotonic()
            status, _, body = _post(short, doc)
            return status, body, time.monotonic() - t

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            blocking = [tmp_path / "b0", tmp_path / "b1"]
            blockers = []
            for path in blocking:  # one on each block, each a single step of HOLD_S
                blockers.append(pool.submit(waited, {"caption": f"stubborn trace:{path}", "size": "16x16"}))
                _until(path.exists)
            queued = pool.submit(waited, {"caption": f"trace:{trace}", "size": "16x16"})
            status, body = _post(short, {"caption": f"trace:{trace}", "size": "16x16", "wait": False})[::2]
            polled = json.loads(body)["job"]
            ran = [b.result() for b in blockers]
            s2, b2, t2 = queued.result()
        for s1, b1, t1 in ran:
            assert s1 == 504 and _error(b1) == "job: running past 1.5 s (--request-timeout); stopped between two steps"
            assert 1.4 < t1 < HOLD_S, t1  # answered at its deadline, before its step ended
        assert s2 == 504 and _error(b2) == "job: still queued after 1.5 s (--request-timeout); dropped, never drawn"
        assert t2 < HOLD_S, t2
        status, _, body = _until(lambda: (got := _call(f"{short}/v1/jobs/{polled}"))[0] != 202 and got)
        assert status == 504 and "still queued" in _error(body)
        for path in blocking:  # stopped at the end of their step
            _until(lambda path=path: path.read_text() == "drawn\nstopped\n", timeout=HOLD_S + 5)

        held = tmp_path / "held"
        status, body, took = waited({"caption": f"hold trace:{held}", "size": "16x16"})
        assert status == 504 and 1.4 < took < HOLD_S and "stopped between two steps" in _error(body), (status, took)
        _until(lambda: held.read_text() == "drawn\nstopped\n", timeout=5)  # stopped by the stand-in, not run out

        # ... and the server goes on answering: an ordinary job is answered. (Its 0.3 s of steps
        # can pass the 1.5 s deadline on a loaded machine; then it is answered 504 by design,
        # and another try is made: a 504 is an answer, a 200 must come.)
        answers = []
        while len(answers) < 3 and 200 not in answers:
            answers.append(_post(short, {"caption": "after", "size": "16x16"})[0])
        assert 200 in answers and set(answers) <= {200, 504}, answers
        text = _metrics(short)
        assert _metric(text, "knapray_serve_expired_total", '{state="running"}') == 3
        assert _metric(text, "knapray_serve_expired_total", '{state="queued"}') == 2
        assert _metric(text, "knapray_serve_media_seconds_count") == 1  # nothing past its deadline was encoded
        assert not trace.exists(), "a job past its deadline in the queue was drawn"
    finally:
        serve.delete("knapray-deadline")


from knapray.driver.gang import Gang  # noqa: E402


class GangLosingALead(Gang):
    """The real gang, whose block about to run the first job of seed 666 loses its lead: the
    lead's actor is killed (``ray.kill``), and known dead, after the scheduler chose the block
    and before the block is started on it. So the block that takes that job fails, whichever
    block it is and however fast the job would have run."""

    def _start_blocks(self):
        import ray

        decide = self.scheduler.decide

        def deciding(now):
            started = decide(now)
            for block, keys in started:
                if not getattr(self, "killed", False) and any(
                        getattr(self._subs[k].job, "seed", None) == 666 for k in keys):
                    self.killed = True
                    lead = self.actors[self.blocks[block][0]]
                    ray.kill(lead)
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:  # until Ray says it is gone
                        try:
                            ray.get(lead.progress.remote(), timeout=10)
                        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                            break
                        time.sleep(0.05)
            return started

        self.scheduler.decide = deciding
        try:
            super()._start_blocks()
        finally:
            self.scheduler.decide = decide


def _trained_run(tmp_path: Path) -> Path:
    """A run directory with a real (untrained) tiny MMDiT checkpoint over a small synthetic
    corpus (no text encoder: jobs borrow a sample's text with ``like``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from knapray.config.run import load_config
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
    from knapray.driver.run_dir import RUN_FORMAT
    from knapray.models.families import build_model
    from knapray.worker.checkpoint import COMPLETE, TRAINER_STATE

    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g4b2i128f1s0", steps=1, scale=4, channels=4, text_dim=16, pooled_dim=16,
                                    max_text_tokens=16, shards=1), corpus, progress=False)
    cfg = load_config(None, [f"data.corpus={corpus}", "model.in_channels=4", "model.text_dim=16",
                             "model.pooled_dim=16", "model.hidden_size=32", "model.num_heads=2",
                             "model.depth_double=1", "model.depth_single=1", "model.rope_axes_dim=[4,6,6]"])
    run = tmp_path / "runs" / "tiny"
    step = run / "checkpoints" / "step-000000001"
    torch.manual_seed(0)
    dcp.save({"model": build_model(cfg.model).state_dict()}, checkpoint_id=str(step), no_dist=True)
    (step / TRAINER_STATE).write_text(json.dumps({"step": 1}))
    (step / COMPLETE).write_text("")
    (run / "config.json").write_text(json.dumps({"format_version": RUN_FORMAT, **cfg.to_dict()}))
    return run


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_real_gang_serves_a_trained_run(served, tmp_path):
    """Two Ray actors (gloo) holding a tiny model answer concurrent requests; the same job
    twice is the same picture (a job's result is its own, whatever block runs it and whatever
    shares it), and a bad one is refused without disturbing the others. Then the lead of the
    block chosen for a job is killed before the block starts: the jobs of that block are
    submitted again once, run on the gang restarted by itself, and answered the same."""
    from ray import serve

    from knapray.driver.serving import ServeOptions, build_app

    run = _trained_run(tmp_path)
    serve.run(build_app(ServeOptions(run=str(run), world_size=2, device="cpu",
                                     gang="test_serve_http:GangLosingALead")),
              name="knapray-real", route_prefix="/real")
    try:
        bodies = [{"like": 0, "size": "32x32", "steps": 2, "seed": 5}, {"like": 1, "size": "64x32", "steps": 3},
                  {"like": 0, "size": "32x32", "steps": 2, "seed": 5}, {"like": 0, "size": "30x32"}]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _call(f"{served}/real/v1/generate", json.dumps(b).encode(), 240),
                                    bodies))
        # No VAE in a synthetic corpus: the picture is the latent's preview, 1/8 of the size asked.
        for (status, kind, body), size in zip(answers[:3], [(4, 4), (8, 4), (4, 4)]):
            assert status == 200 and kind == "image/png", (status, body[:300])
            assert _png_size(body) == size
        assert answers[0][2] == answers[2][2]
        assert answers[3][0] == 400 and _error(answers[3][2]).startswith("size: 30x32"), answers[3]
        assert _call(f"{served}/real/health")[0] == 200

        # The extremes: 10^5 steps (not waited for) and 10^9 are refused at once and never
        # reach the gang (nothing queued, no answer counted), so an ordinary request after them has
        # nothing ahead of it. (The times are printed, not asserted: this machine's load varies.)
        ordinary = json.dumps({"like": 1, "size": "32x32", "steps": 2, "seed": 9}).encode()

        def timed() -> float:
            t = time.monotonic()
            assert _call(f"{served}/real/v1/generate", ordinary, 240)[0] == 200
            return time.monotonic() - t

        def answered() -> float:
            return _metric(_call(f"{served}/real/metrics")[2].decode(), "knapray_serve_latency_seconds_count")

        alone = timed()
        before = answered()
        for steps in (100_000, 10**9):
            status, _, body = _call(f"{served}/real/v1/generate", json.dumps(
                {"like": 0, "size": "32x32", "steps": steps, "wait": steps < 10**9}).encode())
            assert status == 400 and _error(body).startswith(f"steps: {steps}; an integer in [1, 100]"), body
            assert _queue(f"{served}/real") == 0
        assert answered() == before
        after = timed()
        assert answered() == before + 1
        print(f"\nthe real gang: an ordinary request alone {alone:.2f} s, after the extremes {after:.2f} s")

        # The block chosen for the job of seed 666 loses its lead before it starts: that job and
        # the other, if the scheduler packed both into that block, are lost and run again.
        lost = [{"like": 0, "size": "32x32", "steps": 20, "seed": 666},
                {"like": 1, "size": "32x32", "steps": 20, "seed": 3}]
        with concurrent.futures.ThreadPoolExecutor(len(lost)) as pool:
            again = list(pool.map(lambda b: _call(f"{served}/real/v1/generate", json.dumps(b).encode(), 240), lost))
        assert [a[0] for a in again] == [200, 200], [a[2][:300] for a in again]
        text = _call(f"{served}/real/metrics")[2].decode()
        lost_jobs = _metric(text, "knapray_serve_lost_total")
        retries = _metric(text, "knapray_serve_retries_total")
        assert 1 <= lost_jobs <= 2 and retries == lost_jobs, (lost_jobs, retries)
        _until(lambda: _counter(f"{served}/real", "knapray_serve_gang_restarts_total") == 1, timeout=5)
        print(f"the real gang: {lost_jobs:g} of the two jobs lost with their block's lead, submitted again once")
        for body, (status, _, picture) in zip(lost, again):  # the restarted gang draws what the first one would
            assert _call(f"{served}/real/v1/generate", json.dumps(body).encode(), 240)[2] == picture
        assert _call(f"{served}/real/health")[0] == 200
    finally:
        serve.delete("knapray-real")


@contextlib.contextmanager
def _serving_command(tmp_path: Path):
    """``knapray serve`` as a user runs it, on its own embedded Ray, up and answering: (the
    process, its log, its URL, its run). Afterwards, its Ray's processes that are still running
    (a stopped command's may take a moment to go)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    run = _trained_run(tmp_path)
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="kr-", dir="/tmp")  # its own Ray (short: Ray's socket paths)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmp)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "knapray.cli", "serve", "--run", str(run), "--port", str(port)],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    left: list[str] = []
    try:
        _until(lambda: "Ctrl-C stops" in log.read_text() or proc.poll() is not None, timeout=180, every=0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        yield proc, log, f"http://127.0.0.1:{port}", run, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left[:] = _processes_of(ray_tmp)
        for _ in range(50):  # the command waited for Ray's shutdown; a worker may take a moment to go
            if not left:
                break
            time.sleep(0.2)
            left[:] = _processes_of(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@needs_serve
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_command_answers_then_one_ctrl_c_stops_it_with_its_own_lines_alone(tmp_path):
    """``knapray serve`` as a user runs it, on its own embedded Ray: it answers (health, a 400, a
    picture), and one SIGINT stops it with exit 130 and nothing of its Ray left running. Its
    console holds knapray's two lines alone. Before: Serve's start lines ("Connecting to
    existing Serve app" right after starting it), the proxy's and the controller's, and after
    "stopped" the replica's removal and "(raylet) Task ServeController.graceful_shutdown
    failed ... will be retried"."""
    with _serving_command(tmp_path) as (proc, log, url, run, left):
        assert _call(f"{url}/health")[0] == 200
        status, _, body = _call(f"{url}/v1/generate", json.dumps({"like": 0, "steps": 10**9}).encode())
        assert status == 400 and _error(body).startswith("steps: 1000000000; an integer in [1, 100]"), body
        status, kind, body = _call(f"{url}/v1/generate", json.dumps({"like": 0, "size": "32x32", "steps": 2}).encode(),
                                   120)
        assert status == 200 and kind == "image/png" and _png_size(body) == (4, 4), (status, body[:300])
        proc.send_signal(signal.SIGINT)  # once
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith(f"serving {run} ") and "Ctrl-C stops" in lines[0], lines
    assert lines[1] == "knapray serve: stopped (SIGINT)", lines
    assert not left, f"processes of its Ray still running: {left}"


@needs_serve
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_sigterm_to_every_process_of_the_command_stops_it_in_seconds_with_its_line(tmp_path):
    """SIGTERM to every process of ``knapray serve``'s tree (a Slurm step's cgroup gets it so)
    stops its embedded Ray's servers with it: the command says it stopped and exits 143 within
    5 s, without waiting on the servers that are gone (before: Ray's shutdown waited on them,
    7.3-8.3 s after the signal in three runs on a quiet machine)."""
    import psutil

    with _serving_command(tmp_path) as (proc, log, url, run, left):
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) > 3  # the command, its Ray's servers and their processes
        for each in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                each.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
        took = time.monotonic() - signalled
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines[-1] == "knapray serve: stopped (SIGTERM)" and "Traceback" not in log.read_text(), lines
    assert took < 5, took
    assert not left, f"processes of its Ray still running: {left}"


def _processes_of(ray_tmp: str) -> list[str]:
    """The live processes whose command line names ``ray_tmp`` (a Ray's session under it)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and ray_tmp in _cmdline(p)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---- the Serve config and the command's checks (no Ray started) ---------------------------------------------


@needs_serve
def test_the_shipped_serve_config_deploys_knapray(tmp_path):
    """jobs/serve/serve.yaml is a valid Serve config whose application builds from its args;
    ``--config-out`` writes one of the same shape."""
    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from knapray.cli import main
    from knapray.driver.serving import ServeOptions, app_builder

    for path in (REPO / "jobs" / "serve" / "serve.yaml", tmp_path / "out.yaml"):
        if path.name == "out.yaml":
            assert main(["serve", "--run", "/mnt/shared/runs/r", "--world-size", "4", "--max-queue", "20",
                         "--config-out", str(path)]) == 0
            assert "\n# listens on 127.0.0.1 only: this machine's clients alone" in path.read_text()
        doc = yaml.safe_load(path.read_text())
        ServeDeploySchema.model_validate(doc)
        (application,) = doc["applications"]
        assert application["import_path"] == "knapray.driver.serving:app_builder"
        assert isinstance(call_user_app_builder_with_args_if_necessary(app_builder, application["args"]), Application)
        ServeOptions.from_dict(application["args"])
    assert application["args"] == {"run": "/mnt/shared/runs/r", "world_size": 4, "max_queue": 20}
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000}  # what was asked for: the default

    # Every interface when asked, with a key the file never holds: the replica requires one.
    key = "k" * 40
    assert main(["serve", "--run", "/mnt/shared/runs/r", "--host", "0.0.0.0", "--api-key", key, "--max-steps", "50",
                 "--config-out", str(tmp_path / "open.yaml")]) == 0
    text = (tmp_path / "open.yaml").read_text()
    doc = yaml.safe_load(text)
    assert key not in text and "# listens on 0.0.0.0: every interface" in text and "KNAPRAY_API_KEY" in text
    assert doc["http_options"]["host"] == "0.0.0.0"
    assert doc["applications"][0]["args"] == {"run": "/mnt/shared/runs/r", "max_steps": 50, "require_api_key": True}
    assert ServeOptions.from_dict(doc["applications"][0]["args"]).require_api_key
    with pytest.raises(ValueError, match="^world_sise: not an option of knapray serve; valid: run, world_size"):
        ServeOptions.from_dict({"run": "r", "world_sise": 2})
    with pytest.raises(ValueError, match=r"^max_queue: 0; an integer in \[1, 65536\]"):
        ServeOptions(run="r", max_queue=0)
    with pytest.raises(ValueError, match="^window_ms: not an option of knapray serve"):  # no batches: no window
        ServeOptions.from_dict({"run": "r", "window_ms": 50})


@needs_serve
@pytest.mark.parametrize("argv, names", [
    (["--run", "{missing}"], ["--run", "no config.json"]),
    (["--run", "{run}", "--world-size", "3", "--topology", "g2n1"], ["--topology g2n1", "world size 3"]),
    (["--run", "{run}", "--world-size", "5", "--topology", "g5n1"], ["--topology g5n1", "heads"]),
    (["--run", "{run}", "--checkpoint", "/nonexistent/step-1"], ["--checkpoint /nonexistent/step-1"]),
    (["--run", "{run}", "--max-queue", "0"], ["--max-queue", "[1, 65536]"]),
    (["--run", "{run}", "--world-size", "65"], ["--world-size 65", "at most 64"]),
    (["--run", "{run}", "--max-steps", "0"], ["--max-steps", "[1, 10000]", "'0'"]),
    (["--run", "{run}", "--max-steps", "1000000000"], ["--max-steps", "[1, 10000]"]),
    (["--run", "{run}", "--request-timeout", "0"], ["--request-timeout", "(0, 86400]"]),
    (["--run", "{run}", "--request-timeout", "nan"], ["--request-timeout", "'nan'"]),
    (["--run", "{run}", "--max-request-side", "9000"], ["--max-request-side", "[1, 8192]"]),
    (["--run", "{run}", "--max-request-side", "8"], ["--max-request-side 8", "multiples of 16x16"]),
    (["--run", "{run}", "--max-request-frames", "0"], ["--max-request-frames", "[1, 65536]"]),
    (["--run", "{run}", "--max-n", "65"], ["--max-n", "[1, 64]"]),
    (["--run", "{run}", "--max-n", "10", "--max-queue", "5"], ["--max-n 10", "--max-queue 5"]),
    (["--run", "{run}", "--api-key", "a key"], ["--api-key", "not a usable API key (5 characters)"]),
    (["--run", "{run}", "--api-key", ""], ["--api-key", "not a usable API key (0 characters)"]),
    (["--run", "{run}", "--adapter", "x"], ["--adapter x", "NAME=RUN"]),
    (["--run", "{run}", "--adapter", "a=r", "--adapter", "a=s"], ["--adapter a", "given twice"]),
    (["--run", "{run}", "--lora", "a=r"], ["--lora a=r", "--adapter NAME=RUN"]),
])
def test_bad_flags_and_runs_are_one_line_before_ray_starts(argv, names, tmp_path, capsys, monkeypatch):
    from dist_utils import sampling_run_dir
    from knapray.cli import main

    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray started before the flags and the run were checked")

    monkeypatch.setattr(ray, "init", refuse)
    run = sampling_run_dir(tmp_path)
    argv = [a.format(run=run, missing=tmp_path / "missing") for a in argv]
    try:
        code = main(["serve", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("knapray serve: error: "), err
    for name in names:
        assert name in err[0], (name, err[0])


@needs_serve
def test_the_command_and_the_deployment_share_their_bounds():
    from knapray.commands import serve as command
    from knapray.driver import serving

    for name in ("MAX_QUEUE", "MAX_SERVE_STEPS", "MAX_REQUEST_TIMEOUT_S", "API_KEY_ENV"):
        assert getattr(command, name) == getattr(serving, name), name


@needs_serve
def test_a_bad_key_in_the_environment_is_one_line_that_never_shows_it(tmp_path, capsys, monkeypatch):
    from dist_utils import sampling_run_dir
    from knapray.cli import main

    monkeypatch.setenv("KNAPRAY_API_KEY", "secret with spaces")
    code = main(["serve", "--run", str(sampling_run_dir(tmp_path)), "--config-out", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "$KNAPRAY_API_KEY: not a usable API key" in err[0], err
    assert "secret" not in err[0]


@needs_serve
def test_the_served_limits_come_from_the_flags_and_the_run():
    """Sides: the largest square of a request's token bound, at the run's size multiple
    (or the flag's, rounded down to it); frames: 1 for a family of images; the default
    size and steps within the limits."""
    from knapray.driver.serving import ServeLimits, ServeOptions, parse_images_request, parse_job
    from knapray.inference.jobs import RunRules

    rules = RunRules(down=8, patch=(2, 2), text_encoder=True)
    limits = ServeLimits.of(ServeOptions(run="r"), rules, "mmdit")  # a family of clips
    assert (limits.max_side, limits.max_frames, limits.max_steps, limits.max_n) == (4096, 65536, 100, 4)
    limits = ServeLimits.of(ServeOptions(run="r", max_side=1000, max_frames=9, max_steps=10), rules, "flux")
    assert (limits.max_side, limits.max_frames) == (992, 1)
    assert parse_job({}, rules, limits)[0].steps == 10  # 28 by default, within the limit
    small = ServeLimits.of(ServeOptions(run="r", max_side=100), rules, "flux")
    assert parse_job({}, rules, small)[0].width == 96
    with pytest.raises(ValueError, match=r"^frames: 2; an integer in \[1, 1\] \(this server's --max-request-frames\)$"):
        parse_job({"size": "64x64", "frames": 2}, rules, limits)
    with pytest.raises(ValueError, match="^max_side: 8; this run's sizes are multiples of 16x16 pixels: at least 16$"):
        ServeLimits.of(ServeOptions(run="r", max_side=8), rules, "flux")
    jobs = parse_images_request({"prompt": "a cat", "n": 3, "seed": 5, "size": "64x32"}, rules, limits, "r")
    assert [(j.caption, j.seed, j.width, j.height) for j in jobs] == [("a cat", s, 64, 32) for s in (5, 6, 7)]
    (job,) = parse_images_request({"prompt": "ignored", "like": 3, "model": "r"}, rules, limits, "r")
    assert (job.caption, job.like, job.width) == (None, 3, 256)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_several_adapters_of_one_base_served_each_as_alone(served, tmp_path):
    """``--adapter`` beside a served LoRA run, and ``POST /v1/adapters`` while it serves: each
    request's ``model`` picks an adapter, concurrent requests for different ones each come
    back as their run alone draws them; ``/v1/models`` lists them; an unknown model is 400."""
    from ray import serve
    from test_gang import _alone, _three_lora_runs

    from knapray.driver.serving import ServeOptions, build_app
    from knapray.inference.jobs import Job

    _, _, (own, second, third) = _three_lora_runs(tmp_path)
    serve.run(build_app(ServeOptions(run=own, world_size=2, device="cpu", api_key=KEY, adapters={"second": second})),
              name="knapray-lora", route_prefix="/lora")
    url = f"{served}/lora"
    try:
        status, _, body = _call(f"{url}/v1/adapters", json.dumps({"name": "third", "run": third}).encode(), 120)
        assert status == 200, body
        models = [m["id"] for m in json.loads(_call(f"{url}/v1/models")[2])["data"]]
        assert models == ["own", "second", "third"]
        asks = [("own", 11, 0), ("second", 12, 1), ("third", 13, 2), ("second", 11, 0)]
        bodies = [{"model": m, "like": like, "size": "32x32", "steps": 3, "seed": seed} for m, seed, like in asks]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _call(f"{url}/v1/generate", json.dumps(b).encode(), 240), bodies))
        assert [a[0] for a in answers] == [200] * 4, [a[2][:200] for a in answers]
        runs = {"own": own, "second": second, "third": third}
        from PIL import Image

        from knapray.inference.images import preview

        for (model, seed, like), (_, _, png) in zip(asks, answers):
            ref = preview(_alone(runs[model], Job(None, 32, 32, steps=3, seed=seed, like=like)))
            got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            assert np.abs(got.astype(int) - ref[0].astype(int)).max() <= 1, model  # the same picture, rounding aside
        status, _, body = _call(f"{url}/v1/generate", json.dumps({"model": "nope", "like": 0}).encode())
        assert status == 400 and _error(body) == "model: 'nope'; this server serves 'own', 'second', 'third'"
    finally:
        serve.delete("knapray-lora")
