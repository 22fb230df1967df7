"""``knapray serve``: a trained run behind HTTP on Ray Serve.

One deployment (one replica) owns a *gang*: N Ray actors forming one process group (NCCL
on GPUs, gloo on CPUs) that hold the model once (``knapray.driver.gang.Gang``). Requests
arriving within a window (``window_ms``, at most ``max_batch`` jobs and
``MAX_SAMPLE_BATCH_TOKENS`` image tokens) are handed to the gang together, which plans and
samples them as one batch; the gang runs in a thread, so the event loop keeps answering.

Routes:

- ``POST /v1/generate``: a JSON object (``caption``, ``size`` "WIDTHxHEIGHT" or
  ``width``/``height``, ``frames``, ``steps``, ``guidance``, ``shift``, ``seed``, ``like``;
  ``"wait": false`` or ``?async=1`` for a job id). The answer is a PNG (``image/png``) for
  an image and an MP4 (``video/mp4``, H.264 by PyAV) for a clip; without PyAV a clip is an
  animated PNG (``image/apng``). A bad request is HTTP 400 with one JSON error naming the
  field and its valid range (``knapray sample``'s bounds: ``knapray.inference.jobs``);
  a full queue 503, a body over ``MAX_BODY_BYTES`` 413.
- ``GET /v1/jobs/{id}``: 202 while a job waits or runs, then its answer as above.
- ``GET /health``: 200 while the gang is up, 503 while it is down or restarting.
- ``GET /metrics``: Prometheus text: ``knapray_serve_queue_length``,
  ``knapray_serve_batch_size``, ``knapray_serve_latency_seconds``,
  ``knapray_serve_requests_total{code}``, ``knapray_serve_retries_total``,
  ``knapray_serve_gang_restarts_total``.

A job whose worker was lost mid-batch (``JobResult.lost``, or the whole ``generate``
raising) is retried once, in a later batch, after ``gang.restart()``; lost a second time it
is answered 503, and only that job: the others of its batch are answered as usual.

``build_app(options)`` is what ``knapray serve`` runs embedded (``serve.run``);
``app_builder(args)`` is the import path of a Serve config for ``serve deploy`` on a
cluster (``jobs/serve/serve.yaml``). The gang class is an import path (``gang``), so a
test can serve a stand-in with the same API.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as types.
import asyncio
import collections
import importlib
import io
import json
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from knapray.inference.jobs import Job, RunRules
from knapray.limits import MAX_SAMPLE_BATCH_TOKENS, MAX_SAMPLE_REQUESTS

DEFAULT_GANG = "knapray.driver.gang:Gang"
"""Import path of the gang class: ``start(run_dir, world_size, topology=, device=,
checkpoint=)``, ``rules``, ``generate(jobs)``, ``restart()``, ``close()``."""
JOB_FIELDS = ("caption", "size", "width", "height", "frames", "steps", "guidance", "shift", "seed", "like", "wait")
"""What a ``POST /v1/generate`` body may hold."""
MAX_BODY_BYTES = 1 << 20
"""A request body: a caption of ``MAX_TEXT_LENGTH`` characters, JSON-escaped, fits."""
MAX_QUEUE = 1 << 16
"""Largest ``max_queue``."""
MAX_WINDOW_MS = 60_000
KEPT_RESULTS = 1024
"""Answers of finished ``wait: false`` jobs kept for polling (the oldest go first)."""
VIDEO_FPS = 16
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# ---- options ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    """What one served run is: the run, its gang, and how requests are gathered."""

    run: str
    """The run directory (``runs/NAME``); on a cluster, a path every node reads."""
    world_size: int = 1
    """Workers of the gang."""
    topology: str | None = None
    """Bags of the gang (``g1n2+g2n1``); None: the gang's choice."""
    device: str = "auto"
    """auto | cpu | cuda (auto: cuda when the cluster has GPUs)."""
    checkpoint: str | None = None
    """A checkpoint directory; None: the run's newest complete one."""
    window_ms: int = 50
    """How long the first request of a batch waits for others."""
    max_batch: int = 16
    """Jobs planned together, at most."""
    max_queue: int = 256
    """Jobs waiting, at most; more are answered 503."""
    gang: str = DEFAULT_GANG
    """Import path ``module:Class`` of the gang."""

    def __post_init__(self) -> None:
        from knapray.limits import MAX_WORLD_SIZE

        if not isinstance(self.run, str) or not self.run:
            raise ValueError(f"run: {self.run!r}; a run directory")
        for name, lo, hi in (("world_size", 1, MAX_WORLD_SIZE), ("window_ms", 0, MAX_WINDOW_MS),
                             ("max_batch", 1, MAX_SAMPLE_REQUESTS), ("max_queue", 1, MAX_QUEUE)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}: {value!r}; an integer in [{lo}, {hi}]")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {self.device!r}; one of auto, cpu, cuda")
        for name in ("topology", "checkpoint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: {getattr(self, name)!r}; a string or null")
        if not isinstance(self.gang, str) or self.gang.count(":") != 1:
            raise ValueError(f"gang: {self.gang!r}; an import path module:Class")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> "ServeOptions":
        """From a Serve config's ``args``; an unknown key is refused with the valid ones."""
        if not isinstance(args, dict):
            raise ValueError(f"args: {type(args).__name__}; a mapping of {', '.join(f.name for f in fields(cls))}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(args) - set(valid))
        if unknown:
            raise ValueError(f"{unknown[0]}: not an option of knapray serve; valid: {', '.join(valid)}")
        return cls(**args)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def resolve_gang_class(path: str) -> type:
    """The class an import path ``module:Class`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# ---- requests -----------------------------------------------------------------------------------


def parse_job(doc: Any, rules: RunRules) -> tuple[Job, bool]:
    """(the job of a request body, whether the client waits for it); ValueError naming the
    first bad field and its valid range."""
    from knapray.inference.requests import parse_size

    if not isinstance(doc, dict):
        raise ValueError(f"body: a JSON {type(doc).__name__}; a JSON object with fields {', '.join(JOB_FIELDS)}")
    unknown = [k for k in doc if k not in JOB_FIELDS]
    if unknown:
        raise ValueError(f"{str(unknown[0])[:60]}: unknown field; valid: {', '.join(JOB_FIELDS)}")
    caption = doc.get("caption")
    if caption is not None and not isinstance(caption, str):
        raise ValueError(f"caption: a JSON {type(caption).__name__}; a string or null")
    wait = doc.get("wait", True)
    if not isinstance(wait, bool):
        raise ValueError(f"wait: {wait!r}; true or false")
    if "size" in doc and ("width" in doc or "height" in doc):
        raise ValueError("size: give size (WIDTHxHEIGHT) or width and height, not both")
    if "size" in doc:
        size = doc["size"]
        if not isinstance(size, str):
            raise ValueError(f"size: {size!r}; a string WIDTHxHEIGHT in pixels, e.g. 512x512")
        try:
            width, height = parse_size(size)
        except ValueError as e:
            raise ValueError(str(e).replace("--size ", "size: ", 1)) from None
    elif "width" in doc or "height" in doc:
        if "width" not in doc or "height" not in doc:
            raise ValueError(f"{'height' if 'width' in doc else 'width'}: missing; give width and height, or size")
        width, height = doc["width"], doc["height"]
    else:
        width = height = 256  # knapray sample's default size
    job = Job(caption=caption, width=width, height=height, frames=doc.get("frames", 1), steps=doc.get("steps", 28),
              guidance=doc.get("guidance"), shift=doc.get("shift"), seed=doc.get("seed", 0), like=doc.get("like"))
    try:
        rules.check(job)
    except ValueError as e:
        text = str(e)
        if "size" in doc:  # the request named it size
            text = text.replace("width x height ", "size: ", 1)
        raise ValueError(text) from None
    return job, wait


def job_tokens(job: Job, rules: RunRules) -> int:
    """Image tokens of a checked job (what bounds a batch)."""
    mw, mh = rules.multiple
    return job.frames * (job.width // mw) * (job.height // mh)


# ---- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    media_type: str

    @classmethod
    def error(cls, status: int, text: str) -> "Answer":
        return cls(status, json.dumps({"error": text}).encode(), "application/json")

    def response(self) -> Response:
        return Response(content=self.body, status_code=self.status, media_type=self.media_type)


def encode_png(frame: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


def encode_clip(frames: Any, fps: int = VIDEO_FPS) -> tuple[bytes, str]:
    """(bytes, media type) of a clip: MP4 (H.264, yuv420p) with PyAV, else an animated PNG."""
    import importlib.util

    if importlib.util.find_spec("av") is None:
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        buf = io.BytesIO()
        images[0].save(buf, format="PNG", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0)
        return buf.getvalue(), "image/apng"
    import av
    import numpy as np

    t, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p halves both sides: pad the last row / column
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue(), "video/mp4"


def media_answer(frames: Any) -> Answer:
    """A PNG for one frame, a clip for several: (T, H, W, 3) uint8."""
    import numpy as np

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] < 1:
        return Answer.error(500, f"result: frames of shape {frames.shape} {frames.dtype}; expected (T, H, W, 3) uint8")
    if frames.shape[0] == 1:
        return Answer(200, encode_png(frames[0]), "image/png")
    body, media_type = encode_clip(frames)
    return Answer(200, body, media_type)


# ---- metrics ------------------------------------------------------------------------------------


class ServeMetrics:
    """This replica's Prometheus metrics, in a registry of its own (``GET /metrics``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("knapray_serve_queue_length", "jobs waiting for a batch", registry=r)
        self.batch = Histogram("knapray_serve_batch_size", "jobs handed to the gang together", buckets=BATCH_BUCKETS,
                               registry=r)
        self.latency = Histogram("knapray_serve_latency_seconds", "a job's arrival to its answer",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("knapray_serve_requests", "POST /v1/generate answers by status code", ["code"],
                                registry=r)
        self.retries = Counter("knapray_serve_retries", "jobs retried after their worker was lost", registry=r)
        self.restarts = Counter("knapray_serve_gang_restarts", "gang restarts after a loss", registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---- the deployment -----------------------------------------------------------------------------


@dataclass(eq=False)
class Pending:
    """A job waiting for (or in) a batch."""

    id: str
    job: Job
    tokens: int
    arrived: float
    future: asyncio.Future
    attempts: int = 0
    state: str = "queued"


api = FastAPI(title="knapray serve")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_QUEUE)
@serve.ingress(api)
class Generator:
    """The ingress: validates requests, gathers them into batches for the gang it owns."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.metrics = ServeMetrics()
        self._pending: collections.deque[Pending] = collections.deque()
        self._jobs: collections.OrderedDict[str, Pending] = collections.OrderedDict()  # wait: false jobs
        self._wake: asyncio.Event | None = None
        self._batcher: asyncio.Task | None = None
        self._gang_up = False
        self._gang = resolve_gang_class(options.gang).start(
            options.run, options.world_size, topology=options.topology, device=self._device(options.device),
            checkpoint=options.checkpoint)
        self.rules: RunRules = self._gang.rules
        self._gang_up = True

    @staticmethod
    def _device(device: str) -> str:
        if device != "auto":
            return device
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    # ---- routes ----

    @api.post("/v1/generate")
    async def generate(self, request: Request) -> Response:
        answer = await self._generate(request)
        self.metrics.requests.labels(code=str(answer.status)).inc()
        return answer.response()

    @api.get("/v1/jobs/{job_id}")
    async def job(self, job_id: str) -> Response:
        p = self._jobs.get(job_id)
        if p is None:
            return Answer.error(404, f"job: no job {job_id[:40]!r} here (unknown, or its answer was dropped: "
                                     f"the newest {KEPT_RESULTS} are kept)").response()
        if not p.future.done():
            return JSONResponse({"job": job_id, "status": p.state}, status_code=202)
        return p.future.result().response()

    @api.get("/health")
    async def health(self) -> Response:
        up = self._gang_up
        return JSONResponse({"status": "up" if up else "down", "queue": len(self._pending),
                             "world_size": self.options.world_size}, status_code=200 if up else 503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        self.metrics.queue.set(len(self._pending))
        return Response(content=self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    # ---- requests in ----

    async def _generate(self, request: Request) -> Answer:
        body = await self._read_body(request)
        if isinstance(body, Answer):
            return body
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as e:
            return Answer.error(400, f"body: not JSON ({str(e)[:100]}); a JSON object with fields "
                                     f"{', '.join(JOB_FIELDS)}")
        try:
            job, wait = parse_job(doc, self.rules)
        except ValueError as e:
            return Answer.error(400, str(e))
        if request.query_params.get("async", "0").lower() in ("1", "true", "yes"):
            wait = False
        if len(self._pending) >= self.options.max_queue:
            return Answer.error(503, f"queue: {len(self._pending)} jobs waiting; at most {self.options.max_queue} "
                                     "(max_queue): try again later")
        p = self._enqueue(job)
        if not wait:
            self._jobs[p.id] = p
            while len(self._jobs) > KEPT_RESULTS:  # the oldest finished answers go first
                old = next((k for k, v in self._jobs.items() if v.future.done()), None)
                if old is None:
                    break
                del self._jobs[old]
            return Answer(202, json.dumps({"job": p.id, "poll": f"/v1/jobs/{p.id}"}).encode(), "application/json")
        return await asyncio.shield(p.future)  # a client gone does not cancel a job its batch holds

    @staticmethod
    async def _read_body(request: Request) -> bytes | Answer:
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return Answer.error(413, f"body: {declared} bytes; at most {MAX_BODY_BYTES}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return Answer.error(413, f"body: over {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES}")
            chunks.append(chunk)
        return b"".join(chunks)

    def _enqueue(self, job: Job) -> Pending:
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.done():
            self._wake = asyncio.Event()
            self._batcher = loop.create_task(self._batches())
        p = Pending(uuid.uuid4().hex, job, job_tokens(job, self.rules), time.monotonic(), loop.create_future())
        self._pending.append(p)
        self.metrics.queue.set(len(self._pending))
        self._wake.set()
        return p

    # ---- batches ----

    async def _next_batch(self) -> list[Pending]:
        """The jobs that arrived within the window after the first (at most ``max_batch``
        and ``MAX_SAMPLE_BATCH_TOKENS`` image tokens; the rest wait for the next batch)."""
        loop = asyncio.get_running_loop()
        while not self._pending:
            self._wake.clear()
            await self._wake.wait()
        deadline = loop.time() + self.options.window_ms / 1000
        while len(self._pending) < self.options.max_batch and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                break
        batch, tokens = [], 0
        while self._pending and len(batch) < self.options.max_batch and (
                not batch or tokens + self._pending[0].tokens <= MAX_SAMPLE_BATCH_TOKENS):
            p = self._pending.popleft()
            batch.append(p)
            tokens += p.tokens
        self.metrics.queue.set(len(self._pending))
        return batch

    async def _batches(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self._run_batch(batch)
            except Exception as e:  # never leave a client waiting on a job this loop dropped
                for p in batch:
                    self._answer(p, Answer.error(500, f"batch: {type(e).__name__}: {str(e)[:300]}"))

    async def _run_batch(self, batch: list[Pending]) -> None:
        if not self._gang_up:  # a restart failed after the last loss: try again before this batch
            await self._restart()
            if not self._gang_up:
                for p in batch:
                    self._answer(p, Answer.error(503, "gang: its workers are down and a restart failed; "
                                                      "try again later"))
                return
        for p in batch:
            p.state = "running"
        self.metrics.batch.observe(len(batch))
        results = await asyncio.to_thread(self._generate_on_gang, [p.job for p in batch])
        lost = []
        for p, result in zip(batch, results):
            if getattr(result, "lost", False):
                lost.append(p)
            elif result.error is not None:
                self._answer(p, Answer.error(500, f"job: {result.error}"))
            else:
                try:
                    answer = await asyncio.to_thread(media_answer, result.frames)
                except Exception as e:
                    answer = Answer.error(500, f"result: could not encode it ({type(e).__name__}: {str(e)[:200]})")
                self._answer(p, answer)
        if lost:
            await self._restart()
        for p in reversed(lost):  # retried once, ahead of the jobs that arrived since
            if p.attempts >= 1:
                self._answer(p, Answer.error(503, "job: its worker was lost twice (retried once after a gang "
                                                  "restart); try again"))
                continue
            p.attempts += 1
            p.state = "queued"
            self.metrics.retries.inc()
            self._pending.appendleft(p)
        self.metrics.queue.set(len(self._pending))

    def _generate_on_gang(self, jobs: list[Job]) -> list[Any]:
        """One result per job; the gang raising (its workers gone) loses every job."""
        try:
            results = list(self._gang.generate(jobs))
            if len(results) != len(jobs):
                raise RuntimeError(f"the gang answered {len(results)} results for {len(jobs)} jobs")
            return results
        except Exception as e:
            return [_Lost(f"{type(e).__name__}: {str(e)[:300]}") for _ in jobs]

    async def _restart(self) -> None:
        self._gang_up = False
        self.metrics.restarts.inc()
        try:
            await asyncio.to_thread(self._gang.restart)
            self._gang_up = True
        except Exception:
            self._gang_up = False

    def _answer(self, p: Pending, answer: Answer) -> None:
        if not p.future.done():
            p.future.set_result(answer)
        p.state = "done"
        self.metrics.latency.observe(time.monotonic() - p.arrived)

    def __del__(self) -> None:
        gang = getattr(self, "_gang", None)
        if gang is not None:
            try:
                gang.close()
            except Exception:
                pass


@dataclass(frozen=True)
class _Lost:
    error: str
    frames: Any = None
    lost: bool = True


# ---- applications -------------------------------------------------------------------------------


def build_app(options: ServeOptions):
    """The Serve application of ``options`` (``serve.run(build_app(...))``)."""
    return Generator.options(max_ongoing_requests=options.max_queue + 64).bind(options)


def app_builder(args: dict):  # plain dict: Serve inspects the annotation (a pydantic model is parsed)
    """Serve's application builder (``import_path: knapray.driver.serving:app_builder``):
    ``args`` are ``ServeOptions``' fields."""
    return build_app(ServeOptions.from_dict(dict(args)))


def serve_config(options: ServeOptions, *, host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    """A Serve config for ``serve deploy`` that serves ``options`` (defaults left out)."""
    defaults = ServeOptions(run=options.run)
    args = {k: v for k, v in options.to_dict().items() if k == "run" or v != getattr(defaults, k)}
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": "knapray", "route_prefix": "/",
                              "import_path": "knapray.driver.serving:app_builder", "args": args}]}

