"""``knapray serve`` over real HTTP: a local Ray Serve deployment answers concurrent
requests (good, malformed, oversized, lost by a worker once and twice) each as it should,
keeps serving after the bad ones, and counts them in its metrics. The gang is a stand-in
with the real one's API (``FakeGang``: gradient images, a worker lost on request), so that
this runs in seconds; ``test_the_real_gang_serves_a_trained_run`` serves the real one.
Then the Serve config for ``serve deploy`` and the command's checks before Ray starts."""

from __future__ import annotations

import collections
import concurrent.futures
import importlib.util
import io
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
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

    frames: np.ndarray | None
    error: str | None = None
    lost: bool = False


class FakeGang:
    """``knapray.driver.gang.Gang``'s API in one process: the run's real rules, a gradient
    (T, H, W, 3) per job after a short wait; caption "lose once" is lost by its worker the
    first time, "lose always" every time, "fail" fails."""

    def __init__(self, rules) -> None:
        self.rules = rules
        self.seen: collections.Counter = collections.Counter()
        self.restarts = 0
        self.lock = threading.Lock()

    @classmethod
    def start(cls, run_dir, world_size, *, topology=None, device="cpu", checkpoint=None):
        from knapray.driver.run_dir import read_run_config
        from knapray.inference.jobs import run_rules

        assert (world_size, device) == (2, "cpu"), (world_size, device)
        return cls(run_rules(read_run_config(run_dir)))

    def generate(self, jobs):
        assert self.lock.acquire(blocking=False), "generate called while a batch runs"
        try:
            time.sleep(0.3)
            out = []
            for job in jobs:
                self.seen[job.caption] += 1
                if job.caption == "lose always" or (job.caption == "lose once" and self.seen[job.caption] == 1):
                    out.append(FakeResult(None, "worker 1 died", lost=True))
                elif job.caption == "fail":
                    out.append(FakeResult(None, "out of memory"))
                else:
                    ramp = np.linspace(0, 255, job.width, dtype=np.float32).astype(np.uint8)
                    frame = np.broadcast_to(ramp[None, :, None], (job.height, job.width, 3))
                    out.append(FakeResult(np.stack([frame] * job.frames)))
            return out
        finally:
            self.lock.release()

    def restart(self) -> None:
        self.restarts += 1

    def close(self) -> None:
        pass


# ---- HTTP --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET, or of a POST of ``body``."""
    req = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
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
    """A local deployment of the stand-in gang (2 workers, a 0.4 s window); Serve shut down
    at the end (Ray is the session's)."""
    from ray import serve

    from dist_utils import sampling_run_dir
    from knapray.driver.serving import ServeOptions, build_app

    run = sampling_run_dir(tmp_path_factory.mktemp("serve"))
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(ServeOptions(run=str(run), world_size=2, device="cpu", window_ms=400, max_batch=8,
                                         gang="test_serve_http:FakeGang")), name="knapray-test", route_prefix="/")
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
                lambda kind, body: _error(body) == "steps: 0; an integer in [1, 1000000000]"),
    "steps a string": ({"steps": "2"}, "", 400, lambda kind, body: _error(body).startswith("steps: '2'; an integer")),
    "size not a multiple": ({"size": "500x512"}, "", 400,
                            lambda kind, body: _error(body).startswith("size: 500x512")
                            and "nearest valid: 496x512 or 512x512" in _error(body)),
    "size not a size": ({"size": "big"}, "", 400,
                        lambda kind, body: "size: 'big': expected WIDTHxHEIGHT" in _error(body)),
    "side too long": ({"size": "9000x512"}, "", 400,
                      lambda kind, body: _error(body) == "size: 9000x512: at most 8192 pixels a side"),
    "too many tokens": ({"width": 8192, "height": 4096}, "", 400,
                        lambda kind, body: _error(body).startswith("width x height 8192x4096: 131072 image tokens")),
    "guidance NaN": (b'{"guidance": NaN}', "", 400, lambda kind, body: _error(body).startswith("guidance: nan")),
    "unknown field": ({"captoin": "x"}, "", 400, lambda kind, body: _error(body).startswith("captoin: unknown field")),
    "caption a number": ({"caption": 5}, "", 400, lambda kind, body: _error(body).startswith("caption: a JSON int")),
    "body too large": ({"caption": "x" * (2 << 20)}, "", 413, lambda kind, body: _error(body).startswith("body: ")),
    "lost once": ({"caption": "lose once", "size": "32x32"}, "", 200,
                  lambda kind, body: kind == "image/png" and _png_size(body) == (32, 32)),
    "lost twice": ({"caption": "lose always", "size": "32x32"}, "", 503,
                   lambda kind, body: "lost twice" in _error(body)),
    "gang error": ({"caption": "fail", "size": "32x32"}, "", 500,
                   lambda kind, body: _error(body) == "job: out of memory"),
    "async": ({"caption": "later", "size": "16x16", "wait": False}, "", 202,
              lambda kind, body: set(json.loads(body)) == {"job", "poll"}),
    "async by query": ({"caption": "later too", "size": "16x32"}, "?async=1", 202,
                       lambda kind, body: set(json.loads(body)) == {"job", "poll"}),
}
TO_GANG = ("image", "clip", "lost once", "lost once", "lost twice", "lost twice", "gang error", "async",
           "async by query")
"""Jobs handed to the gang: the lost ones twice."""


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

    # Still serving after every bad request and the lost worker.
    status, _, body = _call(f"{served}/health")
    assert status == 200 and json.loads(body)["status"] == "up", body
    status, kind, body = _call(f"{served}/v1/generate", json.dumps({"size": "16x16"}).encode())
    assert status == 200 and kind == "image/png"

    status, kind, text = _call(f"{served}/metrics")
    text = text.decode()
    assert status == 200 and kind.startswith("text/plain"), kind
    by_code = collections.Counter(str(c[2]) for c in CASES.values()) + collections.Counter({"200": 1})
    for code, n in by_code.items():
        assert _metric(text, "knapray_serve_requests_total", f'{{code="{code}"}}') == n, code
    jobs = len(TO_GANG) + 1  # and the request after them
    assert _metric(text, "knapray_serve_batch_size_sum") == jobs
    batches = _metric(text, "knapray_serve_batch_size_count")
    assert 3 <= batches <= jobs - 3, batches  # gathered: the concurrent ones shared batches (the lost, retried, later)
    assert _metric(text, "knapray_serve_latency_seconds_count") == len(set(TO_GANG)) + 1  # one answer each
    assert _metric(text, "knapray_serve_retries_total") == 2
    assert _metric(text, "knapray_serve_gang_restarts_total") >= 2
    assert _metric(text, "knapray_serve_queue_length") == 0


from knapray.driver.gang import Gang  # noqa: E402


class GangLosingRank1(Gang):
    """The real gang, whose rank 1 is killed (``ray.kill``) as the first batch holding a
    job of seed 666 starts: that batch loses the jobs of rank 1's bag."""

    def generate(self, jobs, decode=True):
        import ray

        if any(j.seed == 666 for j in jobs) and not getattr(self, "killed", False):
            self.killed = True
            ray.kill(self.actors[1])
        return super().generate(jobs, decode)


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
    twice in one batch is the same picture (a job's result is its own, whatever shares the
    batch), and a bad one is refused without disturbing the others. Then a rank is killed
    as a batch starts: its jobs are retried on a restarted gang and answered the same."""
    from ray import serve

    from knapray.driver.serving import ServeOptions, build_app

    run = _trained_run(tmp_path)
    serve.run(build_app(ServeOptions(run=str(run), world_size=2, device="cpu", window_ms=500, max_batch=8,
                                     gang="test_serve_http:GangLosingRank1")),
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

        # Two jobs, one on each rank's bag; rank 1 dies as their batch starts.
        lost = [{"like": 0, "size": "32x32", "steps": 2, "seed": 666},
                {"like": 1, "size": "32x32", "steps": 2, "seed": 3}]
        with concurrent.futures.ThreadPoolExecutor(len(lost)) as pool:
            again = list(pool.map(lambda b: _call(f"{served}/real/v1/generate", json.dumps(b).encode(), 240), lost))
        assert [a[0] for a in again] == [200, 200], [a[2][:300] for a in again]
        text = _call(f"{served}/real/metrics")[2].decode()
        assert _metric(text, "knapray_serve_retries_total") == 1
        assert _metric(text, "knapray_serve_gang_restarts_total") == 1
        for body, (status, _, picture) in zip(lost, again):  # the restarted gang draws what the first one would
            assert _call(f"{served}/real/v1/generate", json.dumps(body).encode(), 240)[2] == picture
        assert _call(f"{served}/real/health")[0] == 200
    finally:
        serve.delete("knapray-real")


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
            assert main(["serve", "--run", "/mnt/shared/runs/r", "--world-size", "4", "--window-ms", "20",
                         "--config-out", str(path)]) == 0
        doc = yaml.safe_load(path.read_text())
        ServeDeploySchema.model_validate(doc)
        (application,) = doc["applications"]
        assert application["import_path"] == "knapray.driver.serving:app_builder"
        assert isinstance(call_user_app_builder_with_args_if_necessary(app_builder, application["args"]), Application)
        ServeOptions.from_dict(application["args"])
    assert application["args"] == {"run": "/mnt/shared/runs/r", "world_size": 4, "window_ms": 20}
    with pytest.raises(ValueError, match="^world_sise: not an option of knapray serve; valid: run, world_size"):
        ServeOptions.from_dict({"run": "r", "world_sise": 2})
    with pytest.raises(ValueError, match=r"^max_batch: 0; an integer in \[1, 64\]"):
        ServeOptions(run="r", max_batch=0)


@needs_serve
@pytest.mark.parametrize("argv, names", [
    (["--run", "{missing}"], ["--run", "no config.json"]),
    (["--run", "{run}", "--world-size", "3", "--topology", "g2n1"], ["--topology g2n1", "world size 3"]),
    (["--run", "{run}", "--world-size", "5", "--topology", "g5n1"], ["--topology g5n1", "heads"]),
    (["--run", "{run}", "--checkpoint", "/nonexistent/step-1"], ["--checkpoint /nonexistent/step-1"]),
    (["--run", "{run}", "--max-batch", "65"], ["--max-batch", "[1, 64]"]),
    (["--run", "{run}", "--world-size", "65"], ["--world-size 65", "at most 64"]),
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

    assert (command.MAX_QUEUE, command.MAX_WINDOW_MS) == (serving.MAX_QUEUE, serving.MAX_WINDOW_MS)
