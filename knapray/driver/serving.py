"""``knapray serve``: a trained run behind HTTP on Ray Serve.

One deployment (one replica) owns a *gang*: N Ray actors forming one process group (NCCL
on GPUs, gloo on CPUs) that hold the model once (``knapray.driver.gang.Gang``). Every job a
request brings goes to the gang as soon as it is accepted (``gang.submit``: a future per
job); the gang's own scheduler (``knapray.planning.inference.scheduler``) runs it on a block of ranks,
each block taking the next jobs as soon as it finishes. The replica never batches: it awaits
each job's future, answers it, and cancels it (``gang.cancel``) at its deadline, on DELETE or
when its client goes.

A served run has limits no request may pass (``ServeLimits``: steps, image side, frames,
images per request, a deadline), set at start and shown by ``GET /v1/models``; what a
request may cost is bounded before it is submitted, and so are the jobs submitted and not
yet answered (``max_queue``).

Routes (docs/serving.md has them in full):

- ``POST /v1/generate``: a JSON object (``caption``, ``size`` "WIDTHxHEIGHT" or
  ``width``/``height``, ``frames``, ``steps``, ``guidance``, ``shift``, ``seed``, ``like``;
  ``image``, a base64 PNG or JPEG for a model with a time per token (Wan 2.2 TI2V: image
  to video, its latent the first frame); ``"wait": false`` or ``?async=1`` for a job id). The answer is a PNG (``image/png``) for
  an image and an MP4 (``video/mp4``, H.264 by PyAV) for a clip; without PyAV a clip is an
  animated PNG (``image/apng``). A bad request is HTTP 400 with one JSON error naming the
  field and its valid range (the served limits, then ``knapray sample``'s bounds:
  ``knapray.inference.jobs``); a full queue 503, a body over ``MAX_BODY_BYTES`` 413
  (``MAX_IMAGE_BODY_BYTES`` where the run takes an image), a job past its deadline 504.
- ``POST /v1/images/generations``: OpenAI's images API (``model``, ``prompt``, ``n``,
  ``size``, ``response_format`` ``b64_json``; knapray's ``steps``, ``guidance``, ``shift``,
  ``seed``, ``like`` as extra fields); errors in OpenAI's shape.
- ``GET /v1/models``: the served model and its limits, in OpenAI's list shape.
- ``GET /v1/jobs/{id}``: 202 while a job is queued, running or stopping, then its answer as
  above; ``DELETE /v1/jobs/{id}``: a queued job is dropped, a running one stopped between two
  of its steps.
- ``GET /health``: 200 while the gang is up, 503 while it restarts.
- ``GET /metrics``: Prometheus text (``ServeMetrics``).

With an API key (``api_key``, or ``KNAPRAY_API_KEY`` in the replica's environment) every
route but ``/health`` answers 401 without ``Authorization: Bearer KEY``. A client that
disconnects cancels its jobs, waiting or running.

A job whose block lost a rank (``JobResult.lost``) is submitted again once (the gang
restarts itself); lost a second time it is answered 503, and only that job.

``build_app(options)`` is what ``knapray serve`` runs embedded (``serve.run``);
``app_builder(args)`` is the import path of a Serve config for ``serve deploy`` on a
cluster (``jobs/serve/serve.yaml``). The gang class is an import path (``gang``), so a
test can serve a stand-in with the same API.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as types.
import asyncio
import base64
import collections
import hmac
import importlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from knapray.inference.images import encode_clip, encode_png
from knapray.inference.jobs import Job, RunRules
from knapray.limits import MAX_IMAGE_SIDE, MAX_IMAGE_TOKENS, MAX_SAMPLE_REQUESTS

DEFAULT_GANG = "knapray.driver.gang:Gang"
"""Import path of the gang class: ``start(run_dir, world_size, topology=, device=,
checkpoint=)``, ``rules``, ``submit(job)`` (a future with a ``key``), ``cancel(key)``,
``broken``, ``restarts`` (how many times it restarted itself), ``close()``; ``state(key)`` where
it has one (what a poll says)."""
JOB_FIELDS = ("caption", "size", "width", "height", "frames", "steps", "guidance", "shift", "seed", "like", "wait",
              "model", "image")
"""What a ``POST /v1/generate`` body may hold."""
IMAGES_FIELDS = ("model", "prompt", "n", "size", "response_format", "output_format", "user", "steps", "guidance",
                 "shift", "seed", "like")
"""What a ``POST /v1/images/generations`` body may hold (OpenAI's fields, then knapray's)."""
API_KEY_ENV = "KNAPRAY_API_KEY"
"""The environment variable a replica reads its API key from when its options give none."""
MAX_BODY_BYTES = 1 << 20
"""A request body: a caption of ``MAX_TEXT_LENGTH`` characters, JSON-escaped, fits."""
MAX_IMAGE_BODY_BYTES = 1 << 23
"""A ``POST /v1/generate`` body where the run takes a conditioning image: an image of 6 MiB
in base64 fits (a 1280x704 frame, Wan 2.2 TI2V-5B's size, is 2.7 MB as a PNG that does not
compress at all; the 1 MiB of a text request's body holds a 768 KiB image)."""
DRAINED_BODY_BYTES = 1 << 26
"""A body over its bound is still read, and dropped, up to this many bytes before its 413 is
answered (a longer one is answered at once, and the connection closes on what is unread)."""
MAX_QUEUE = 1 << 16
"""Largest ``max_queue``."""
SPARE_REQUESTS = 128
"""Requests a replica takes beyond twice its queue: ``/health``, polls, DELETE, and the
400s and 503s it answers at once."""
MAX_SERVE_STEPS = 10_000
"""Largest ``max_steps`` (samplers take 1 to 1,000)."""
MAX_REQUEST_TIMEOUT_S = 86_400
"""Largest ``request_timeout_s``: a day."""
MAX_API_KEY_LENGTH = 1024
DEFAULT_STEPS = 28
"""A request's steps when it gives none (``knapray sample``'s), or ``max_steps`` if fewer."""
DEFAULT_SIDE = 256
"""A request's width and height when it gives none (``knapray sample``'s), or the largest
valid side below ``max_side``."""
KEPT_RESULTS = 1024
"""Answers of finished ``wait: false`` jobs kept for polling (the oldest go first)."""
RANKS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RESTART_POLL_S = 0.05
"""How often the replica looks at ``gang.restarts`` for the restarts metric (``RestartWatch``)."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# ---- options ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeOptions:
    """What one served run is: the run, its gang, how many jobs it holds and what one may ask."""

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
    max_queue: int = 256
    """Jobs submitted to the gang and not yet answered (waiting or running), at most; more
    are answered 503."""
    max_steps: int = 100
    """Euler steps a request may ask for, at most."""
    max_side: int | None = None
    """Pixels a side, at most; None: the run's (the largest square of ``MAX_IMAGE_TOKENS``)."""
    max_frames: int | None = None
    """Latent frames, at most; None: the run's (1 for an image family)."""
    max_n: int = 4
    """Images one ``/v1/images/generations`` request may ask for (``n``), at most."""
    request_timeout_s: float = 300.0
    """A job not answered this long after it arrived is answered 504 and cancelled: dropped
    if still queued, stopped between two steps if running."""
    api_key: str | None = None
    """Bearer token every route but ``/health`` requires; None: ``KNAPRAY_API_KEY`` of the
    replica's environment, or none."""
    require_api_key: bool = False
    """Refuse to start without an API key (a written Serve config that never holds the key)."""
    gang: str = DEFAULT_GANG
    """Import path ``module:Class`` of the gang."""
    adapters: dict | None = None
    """LoRA runs of the served run's base, by name (``--adapter NAME=RUN``): a request's ``model``
    picks one (the served run's own name: its own weights)."""

    def __post_init__(self) -> None:
        from knapray.limits import MAX_WORLD_SIZE

        if not isinstance(self.run, str) or not self.run:
            raise ValueError(f"run: {self.run!r}; a run directory")
        for name, lo, hi in (("world_size", 1, MAX_WORLD_SIZE), ("max_queue", 1, MAX_QUEUE),
                             ("max_steps", 1, MAX_SERVE_STEPS), ("max_side", 1, MAX_IMAGE_SIDE),
                             ("max_frames", 1, MAX_IMAGE_TOKENS), ("max_n", 1, MAX_SAMPLE_REQUESTS)):
            value = getattr(self, name)
            if value is None and name in ("max_side", "max_frames"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}: {value!r}; an integer in [{lo}, {hi}]" +
                                 ("" if name not in ("max_side", "max_frames") else " or null (the run's)"))
        if self.max_n > self.max_queue:
            raise ValueError(f"max_n: {self.max_n}; at most max_queue ({self.max_queue}): a request of n images "
                             "queues n jobs")
        t = self.request_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_REQUEST_TIMEOUT_S:
            raise ValueError(f"request_timeout_s: {t!r}; seconds in (0, {MAX_REQUEST_TIMEOUT_S}]")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {self.device!r}; one of auto, cpu, cuda")
        for name in ("topology", "checkpoint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: {getattr(self, name)!r}; a string or null")
        if self.api_key is not None:
            check_api_key(self.api_key, "api_key")
        if not isinstance(self.require_api_key, bool):
            raise ValueError(f"require_api_key: {self.require_api_key!r}; true or false")
        if not isinstance(self.gang, str) or self.gang.count(":") != 1:
            raise ValueError(f"gang: {self.gang!r}; an import path module:Class")
        if self.adapters is not None:
            if not isinstance(self.adapters, dict) or not all(
                    isinstance(k, str) and ADAPTER_NAME.fullmatch(k) and isinstance(v, str) and v
                    for k, v in self.adapters.items()):
                raise ValueError(f"adapters: {_short(self.adapters)}; a mapping of adapter names (letters, digits, "
                                 "'.', '_', '-') to LoRA run directories")

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


def check_api_key(key: Any, what: str) -> str:
    """``key`` if it can be a bearer token (1 to ``MAX_API_KEY_LENGTH`` visible ASCII
    characters); ValueError naming ``what`` (never the key) otherwise."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_API_KEY_LENGTH or not all(33 <= ord(c) <= 126 for c in key):
        length = len(key) if isinstance(key, str) else type(key).__name__
        raise ValueError(f"{what}: not a usable API key ({length} characters); 1 to {MAX_API_KEY_LENGTH} visible "
                         "ASCII characters, no spaces")
    return key


def resolve_gang_class(path: str) -> type:
    """The class an import path ``module:Class`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# ---- limits -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """What one request may ask of a served run, at most (``GET /v1/models`` shows them)."""

    max_steps: int
    max_side: int
    """Pixels a side, a multiple of the run's size multiple."""
    max_frames: int
    max_n: int
    request_timeout_s: float
    multiple: tuple[int, int]
    """(width, height) every size is a multiple of, in pixels."""
    max_image_tokens: int = MAX_IMAGE_TOKENS

    @classmethod
    def of(cls, options: ServeOptions, rules: RunRules, family: str) -> "ServeLimits":
        """The limits of ``options`` on a run (its ``rules``, its model ``family``: one of
        images has one frame). ValueError when ``max_side`` is below the run's size multiple."""
        from knapray.models.families import get_family

        video = get_family(family).video
        mw, mh = rules.multiple
        step = max(mw, mh)
        run_side = min(MAX_IMAGE_SIDE, 256 * step) // step * step  # the largest square of MAX_IMAGE_TOKENS
        side = run_side if options.max_side is None else min(options.max_side, run_side) // step * step
        if side < step:
            raise ValueError(f"max_side: {options.max_side}; this run's sizes are multiples of {mw}x{mh} pixels: at "
                             f"least {step}")
        frames = options.max_frames or (MAX_IMAGE_TOKENS if video else 1)
        return cls(options.max_steps, side, frames if video else 1, options.max_n, float(options.request_timeout_s),
                   (mw, mh))

    @property
    def default_side(self) -> int:
        step = max(self.multiple)
        return max(step, min(DEFAULT_SIDE, self.max_side) // step * step)

    def check(self, job: Job, named_size: bool = False) -> None:
        """ValueError naming the first field past its limit (before the run's own rules);
        ``named_size``: the request gave ``size`` (parsed: two integers)."""
        if named_size and max(job.width, job.height) > self.max_side:
            raise ValueError(f"size: {job.width}x{job.height}: at most {self.max_side} pixels a side (this server's "
                             "--max-request-side)")
        for name, value, most, flag in (("steps", job.steps, self.max_steps, "--max-steps"),
                                        ("width", job.width, self.max_side, "--max-request-side"),
                                        ("height", job.height, self.max_side, "--max-request-side"),
                                        ("frames", job.frames, self.max_frames, "--max-request-frames")):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ValueError(f"{name}: {_short(value)}; an integer in [1, {most}] (this server's {flag})")

    def to_dict(self) -> dict[str, Any]:
        return {"max_steps": self.max_steps, "max_side": self.max_side, "max_frames": self.max_frames,
                "max_image_tokens": self.max_image_tokens, "max_n": self.max_n,
                "request_timeout_s": self.request_timeout_s, "size_multiple": list(self.multiple)}


ADAPTER_NAME = __import__("re").compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What an adapter (a served model's name) may be called."""


def served_model(model: Any, own: str, adapters: Any) -> str | None:
    """The adapter a request's ``model`` asks for: None for the served run itself (its name,
    or no ``model``); ValueError naming what this server serves."""
    names = list(adapters or ())
    if model is None or model == own:
        return None
    if isinstance(model, str) and model in names:
        return model
    served = ", ".join(repr(m) for m in [own, *names])
    raise ValueError(f"model: {_short(model)}; this server serves {served}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- requests -----------------------------------------------------------------------------------


def parse_job(doc: Any, rules: RunRules, limits: ServeLimits | None = None, own: str | None = None,
              adapters: Any = None) -> tuple[Job, bool]:
    """(the job of a ``/v1/generate`` body, whether the client waits for it); ValueError
    naming the first bad field and its valid range. ``own``, ``adapters``: the served model's
    name and its adapters (``model`` picks one)."""
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
        raise ValueError(f"wait: {_short(wait)}; true or false")
    if "size" in doc and ("width" in doc or "height" in doc):
        raise ValueError("size: give size (WIDTHxHEIGHT) or width and height, not both")
    if "size" in doc:
        width, height = _size(doc["size"])
    elif "width" in doc or "height" in doc:
        if "width" not in doc or "height" not in doc:
            raise ValueError(f"{'height' if 'width' in doc else 'width'}: missing; give width and height, or size")
        width, height = doc["width"], doc["height"]
    else:
        width = height = DEFAULT_SIDE if limits is None else limits.default_side
    steps = doc.get("steps", DEFAULT_STEPS if limits is None else min(DEFAULT_STEPS, limits.max_steps))
    adapter = served_model(doc.get("model"), own, adapters) if own is not None else None
    if own is None and doc.get("model") is not None:
        raise ValueError("model: this server takes no model field")
    job = Job(caption=caption, width=width, height=height, frames=doc.get("frames", 1), steps=steps,
              guidance=doc.get("guidance"), shift=doc.get("shift"), seed=doc.get("seed", 0), like=doc.get("like"),
              adapter=adapter, image=_image(doc.get("image")))
    _check(job, rules, limits, "size" in doc)
    return job, wait


def _image(text: Any) -> bytes | None:
    """A request's ``image``: a PNG or JPEG file in base64 (within the body's bound), or null.
    What it holds is checked with the job (``RunRules.check``: the model takes one, its header,
    pixels and bytes bounded)."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"image: a JSON {type(text).__name__}; a PNG or JPEG file in base64, or null")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError(f"image: not base64 ({len(text)} characters); a PNG or JPEG file in base64") from None


def parse_images_request(doc: Any, rules: RunRules, limits: ServeLimits, model: str, adapters: Any = None
                         ) -> list[Job]:
    """The jobs of an OpenAI ``/v1/images/generations`` body (``n`` of them, seeds ``seed``,
    ``seed + 1``, ...); ValueError naming the first bad field (OpenAI's names: ``prompt``)."""
    if not isinstance(doc, dict):
        raise ValueError(f"body: a JSON {type(doc).__name__}; a JSON object with fields {', '.join(IMAGES_FIELDS)}")
    unknown = [k for k in doc if k not in IMAGES_FIELDS]
    if unknown:
        raise ValueError(f"{str(unknown[0])[:60]}: unknown field; valid: {', '.join(IMAGES_FIELDS)}")
    adapter = served_model(doc.get("model"), model, adapters)
    prompt = doc.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: {'missing' if prompt is None else 'a JSON ' + type(prompt).__name__}; a string")
    for name, valid in (("response_format", "b64_json"), ("output_format", "png")):
        if doc.get(name) not in (None, valid):
            raise ValueError(f"{name}: {_short(doc[name])}; only {valid!r} (this server keeps no files)"
                             if name == "response_format" else f"{name}: {_short(doc[name])}; only {valid!r}")
    if doc.get("user") is not None and not isinstance(doc["user"], str):
        raise ValueError(f"user: a JSON {type(doc['user']).__name__}; a string")
    n = doc.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_n:
        raise ValueError(f"n: {_short(n)}; an integer in [1, {limits.max_n}] (this server's --max-n)")
    size = doc.get("size")
    width, height = (limits.default_side,) * 2 if size in (None, "auto") else _size(size)
    seed = doc.get("seed", 0)
    like = doc.get("like")
    caption = None if like is not None else prompt  # like: a corpus sample's text instead of the prompt
    base = Job(caption=caption, width=width, height=height, steps=doc.get("steps", min(DEFAULT_STEPS, limits.max_steps)),
               guidance=doc.get("guidance"), shift=doc.get("shift"), seed=seed, like=like, adapter=adapter)
    try:
        _check(base, rules, limits, size not in (None, "auto"))
        jobs = [base] + [Job(caption=caption, width=width, height=height, steps=base.steps, guidance=base.guidance,
                             shift=base.shift, seed=seed + i, like=like, adapter=adapter) for i in range(1, n)]
        if n > 1:
            rules.check(jobs[-1])  # the last seed in range
    except ValueError as e:
        text = str(e)
        raise ValueError("prompt" + text[len("caption"):] if text.startswith("caption:") else text) from None
    return jobs


def _size(size: Any) -> tuple[int, int]:
    from knapray.inference.requests import parse_size

    if not isinstance(size, str):
        raise ValueError(f"size: {_short(size)}; a string WIDTHxHEIGHT in pixels, e.g. 512x512")
    try:
        return parse_size(size)
    except ValueError as e:
        raise ValueError(str(e).replace("--size ", "size: ", 1)) from None


def _check(job: Job, rules: RunRules, limits: ServeLimits | None, named_size: bool) -> None:
    """The served limits, then the run's rules; the error names ``size`` when the request did."""
    try:
        if limits is not None:
            limits.check(job, named_size)
        rules.check(job)
    except ValueError as e:
        text = str(e)
        if named_size:
            text = text.replace("width x height ", "size: ", 1)
        raise ValueError(text) from None


# ---- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    media_type: str
    message: str | None = None
    """An error's text (its body is ``{"error": message}``)."""

    @classmethod
    def error(cls, status: int, text: str) -> "Answer":
        return cls(status, json.dumps({"error": text}).encode(), "application/json", text)

    @classmethod
    def document(cls, status: int, doc: Any) -> "Answer":
        return cls(status, json.dumps(doc).encode(), "application/json")

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(content=self.body, status_code=self.status, media_type=self.media_type, headers=headers)

    def openai(self) -> Response:
        """An error in OpenAI's shape (``{"error": {message, type, param, code}}``), or as is."""
        if self.message is None:
            return self.response()
        kind, code = OPENAI_ERRORS.get(self.status, ("server_error", None))
        head = self.message.split(":", 1)[0]
        param = head if self.status == 400 and head.isidentifier() and head != "body" else None  # the field named
        doc = {"error": {"message": self.message, "type": kind, "param": param, "code": code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(doc, status_code=self.status, headers=headers)


OPENAI_ERRORS = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
                 404: ("invalid_request_error", "not_found"), 409: ("invalid_request_error", "conflict"),
                 413: ("invalid_request_error", "request_too_large"), 500: ("server_error", None),
                 503: ("server_error", "overloaded"), 504: ("server_error", "timeout")}
"""An error's (type, code) in OpenAI's shape, by HTTP status."""


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


GANG_STAGES = ("queue", "encode", "denoise", "decode")
"""Per-job seconds a gang reports (``JobResult.seconds``: its wait for a block, its captions
encoded, its Euler loop, its latent decoded); each is a histogram."""


class RestartWatch:
    """Restarts of a gang since the last look, from the gang's own count (``Gang.restarts``).
    Watching ``broken`` flip back between two looks missed a restart whose gang broke again
    before the next look."""

    def __init__(self) -> None:
        self.seen = 0

    def look(self, gang) -> int:
        new, self.seen = max(0, gang.restarts - self.seen), max(self.seen, gang.restarts)
        return new


class ServeMetrics:
    """This replica's Prometheus metrics, in a registry of its own (``GET /metrics``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("knapray_serve_queue_length", "jobs submitted to the gang and not yet answered (waiting "
                           "or running: what max_queue bounds)", registry=r)
        self.running = Gauge("knapray_serve_running", "of those, jobs running on a block of the gang", registry=r)
        self.latency = Histogram("knapray_serve_latency_seconds", "a job's arrival to its answer",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.stages = {s: Histogram(f"knapray_serve_{s}_seconds", f"a job's {s} seconds, as the gang reports them "
                                    "(per job)", buckets=STAGE_BUCKETS, registry=r) for s in GANG_STAGES}
        self.ranks = Histogram("knapray_serve_block_ranks", "ranks of the block that ran a job (per job)",
                               buckets=RANKS_BUCKETS, registry=r)
        self.media = Histogram("knapray_serve_media_seconds", "a job's picture written as PNG or MP4 (per job)",
                               buckets=STAGE_BUCKETS, registry=r)
        self.requests = Counter("knapray_serve_requests", "answers of the POST routes by route and status code",
                                ["route", "code"], registry=r)
        self.cancelled = Counter("knapray_serve_cancelled", "jobs cancelled by DELETE or their client gone: dropped "
                                 "while queued, or stopped while running", ["reason", "state"], registry=r)
        self.expired = Counter("knapray_serve_expired", "jobs past their deadline (504): dropped while queued, or "
                               "stopped while running", ["state"], registry=r)
        self.lost = Counter("knapray_serve_lost", "jobs whose block lost a rank (each attempt)", registry=r)
        self.retries = Counter("knapray_serve_retries", "jobs submitted again after their block lost a rank",
                               registry=r)
        self.restarts = Counter("knapray_serve_gang_restarts", "gang restarts (it restarts itself after a loss)",
                                registry=r)

    def observe(self, result: Any) -> None:
        """What the gang reports of one attempt of a job: its stage seconds, its block's ranks."""
        for stage, seconds in (getattr(result, "seconds", None) or {}).items():
            if stage in self.stages:
                self.stages[stage].observe(seconds)
        ranks = getattr(result, "ranks", None)
        if ranks:
            self.ranks.observe(len(ranks))
        if getattr(result, "lost", False):
            self.lost.inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---- the deployment -----------------------------------------------------------------------------


CANCEL_REASONS = ("delete", "disconnect")
"""Why a client's job is cancelled (a third reason, ``deadline``, answers 504)."""


@dataclass(eq=False)
class Pending:
    """A job this replica submitted to the gang, until the gang is done with it and it is answered."""

    id: str
    job: Job
    arrived: float
    future: asyncio.Future
    """Its answer (an ``Answer``)."""
    key: int = -1
    """The gang's key of its current attempt (``cancel`` takes it)."""
    result: Any = None
    """The gang's future of its current attempt (``concurrent.futures.Future`` of a ``JobResult``)."""
    attempts: int = 0
    state: str = "submitted"
    """submitted (the gang says whether queued or running), stopping, done, cancelled, expired."""
    stop: str | None = None
    """Why it was cancelled (``CANCEL_REASONS`` or ``deadline``): a lost result is then not retried."""
    timer: asyncio.TimerHandle | None = None
    """Its deadline."""
    task: asyncio.Task | None = None
    """What awaits the gang's result and answers it."""


api = FastAPI(title="knapray serve")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_QUEUE)
@serve.ingress(api)
class Generator:
    """The ingress: validates requests, submits each job to the gang it owns, answers it."""

    def __init__(self, options: ServeOptions) -> None:
        from knapray.driver.run_dir import read_run_config

        self.options = options
        self.model_id = os.path.basename(os.path.normpath(options.run))
        self.api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
        if self.api_key is not None:
            check_api_key(self.api_key, API_KEY_ENV if options.api_key is None else "api_key")
        elif options.require_api_key:
            raise ValueError(f"require_api_key: no API key; set {API_KEY_ENV} in the replica's environment "
                             "(runtime_env.env_vars, or the nodes')")
        self.metrics = ServeMetrics()
        self._held: dict[str, Pending] = {}
        """Jobs submitted and not done with: the gang holds them, or their answer is being written."""
        self._jobs: collections.OrderedDict[str, Pending] = collections.OrderedDict()  # wait: false jobs
        self.created = int(time.time())
        family = read_run_config(options.run).model.family
        self._gang = resolve_gang_class(options.gang).start(
            options.run, options.world_size, topology=options.topology, device=self._device(options.device),
            checkpoint=options.checkpoint, **({"adapters": dict(options.adapters)} if options.adapters else {}))
        self.rules: RunRules = self._gang.rules
        self.limits = ServeLimits.of(options, self.rules, family)
        self.body_bytes = MAX_IMAGE_BODY_BYTES if self.rules.takes_image else MAX_BODY_BYTES
        """The largest ``/v1/generate`` body: room for an image where the run takes one."""
        self._closed = threading.Event()
        threading.Thread(target=self._count_restarts, name="knapray-restarts", daemon=True).start()

    @staticmethod
    def _device(device: str) -> str:
        if device != "auto":
            return device
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def _count_restarts(self) -> None:
        """The restarts metric follows the gang (``RestartWatch``), looked at every ``RESTART_POLL_S``."""
        watch = RestartWatch()
        while not self._closed.wait(RESTART_POLL_S):
            new = watch.look(self._gang)
            if new:
                self.metrics.restarts.inc(new)

    # ---- routes ----

    @api.post("/v1/generate")
    async def generate(self, request: Request) -> Response:
        answer = self._denied(request) or await self._generate(request)
        self.metrics.requests.labels(route="generate", code=str(answer.status)).inc()
        return answer.response()

    @api.post("/v1/images/generations")
    async def images(self, request: Request) -> Response:
        answer = self._denied(request) or await self._images(request)
        self.metrics.requests.labels(route="images", code=str(answer.status)).inc()
        return answer.openai()

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied.openai()
        limits = {**self.limits.to_dict(), "max_queue": self.options.max_queue, "max_body_bytes": self.body_bytes}
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "knapray",
                 "limits": limits}
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "knapray",
                     "parent": self.model_id, "limits": limits} for name in self._adapters()]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    @api.post("/v1/adapters")
    async def add_adapter(self, request: Request) -> Response:
        """Another LoRA run of the served run's base, served as a model from now on (the gang
        loads it on every rank between blocks; no restart): ``{"name": ..., "run": ...}``."""
        denied = self._denied(request)
        if denied:
            return denied.openai()
        doc = await self._document(request, ("name", "run"))
        if isinstance(doc, Answer):
            return doc.openai()
        if not isinstance(doc, dict) or set(doc) != {"name", "run"} or not all(isinstance(v, str) for v in doc.values()):
            return Answer.error(400, "body: a JSON object {\"name\": NAME, \"run\": RUN_DIRECTORY}").openai()
        name = doc["name"]
        if not ADAPTER_NAME.fullmatch(name) or name == self.model_id:
            return Answer.error(400, f"name: {_short(name)}; letters, digits, '.', '_', '-', not the served run's "
                                     "own name").openai()
        try:
            await asyncio.to_thread(self._gang.add_adapter, name, doc["run"])
        except ValueError as e:
            return Answer.error(400, str(e).splitlines()[0][:500]).openai()
        return JSONResponse({"id": name, "object": "model", "parent": self.model_id})

    def _adapters(self) -> list[str]:
        return list(getattr(self._gang, "adapters", None) or ())

    @api.get("/v1/jobs/{job_id}")
    async def job(self, job_id: str, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied.response()
        p = self._jobs.get(job_id)
        if p is None:
            return self._unknown(job_id).response()
        if not p.future.done():
            return JSONResponse({"job": job_id, "status": self._status(p)}, status_code=202)
        return p.future.result().response()

    @api.delete("/v1/jobs/{job_id}")
    async def cancel(self, job_id: str, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied.response()
        p = self._jobs.get(job_id)
        if p is None:
            return self._unknown(job_id).response()
        if not p.future.done() and p.state != "stopping":
            if self._cancel(p, "delete") == "done":  # the gang has its result: its answer is being written
                try:
                    await asyncio.wait_for(asyncio.shield(p.future), 60)
                except asyncio.TimeoutError:
                    pass
        if p.state in ("cancelled", "stopping"):
            return JSONResponse({"job": job_id, "status": p.state})
        if not p.future.done():
            return Answer.error(409, f"job {job_id}: finished on the gang, its answer being written; nothing to "
                                     "cancel").response()
        return Answer.error(409, f"job {job_id}: already answered ({p.state}, HTTP {p.future.result().status}); "
                                 "nothing to cancel").response()

    @api.get("/health")
    async def health(self) -> Response:
        up = not getattr(self._gang, "broken", False)
        return JSONResponse({"status": "up" if up else "restarting", "queue": len(self._held),
                             "world_size": self.options.world_size}, status_code=200 if up else 503)

    @api.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        denied = self._denied(request)
        if denied:
            return denied.response()
        self.metrics.queue.set(len(self._held))
        if hasattr(self._gang, "state"):
            self.metrics.running.set(sum(self._status(p) == "running" for p in self._held.values()
                                         if not p.future.done()))
        return Response(content=self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    # ---- requests in ----

    def _denied(self, request: Request) -> Answer | None:
        """401 unless the request carries this server's key (when it has one)."""
        if self.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        given = "no Authorization header" if not scheme else "a wrong key" if scheme.lower() == "bearer" else \
            f"an {scheme[:20]!r} Authorization"
        return Answer.error(401, f"authorization: {given}; send 'Authorization: Bearer KEY' with this server's API "
                                 f"key (knapray serve --api-key or {API_KEY_ENV})")

    @staticmethod
    def _unknown(job_id: str) -> Answer:
        return Answer.error(404, f"job: no job {job_id[:40]!r} here (unknown, or its answer was dropped: "
                                 f"the newest {KEPT_RESULTS} are kept)")

    async def _document(self, request: Request, valid: tuple[str, ...], most: int = MAX_BODY_BYTES) -> Any:
        """The request's JSON body (at most ``most`` bytes), or the Answer that refuses it."""
        body = await self._read_body(request, most)
        if isinstance(body, Answer):
            return body
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            return Answer.error(400, f"body: not JSON ({str(e)[:100]}); a JSON object with fields {', '.join(valid)}")

    async def _generate(self, request: Request) -> Answer:
        doc = await self._document(request, JOB_FIELDS, self.body_bytes)
        if isinstance(doc, Answer):
            return doc
        try:
            job, wait = parse_job(doc, self.rules, self.limits, self.model_id, self._adapters())
        except ValueError as e:
            return Answer.error(400, str(e))
        if request.query_params.get("async", "0").lower() in ("1", "true", "yes"):
            wait = False
        full = self._full(1)
        if full:
            return full
        (p,) = self._submit([job])
        if not wait:
            self._keep(p)
            return Answer.document(202, {"job": p.id, "poll": f"/v1/jobs/{p.id}"})
        return (await self._wait([p]))[0]

    async def _images(self, request: Request) -> Answer:
        doc = await self._document(request, IMAGES_FIELDS)
        if isinstance(doc, Answer):
            return doc
        try:
            jobs = parse_images_request(doc, self.rules, self.limits, self.model_id, self._adapters())
        except ValueError as e:
            return Answer.error(400, str(e))
        full = self._full(len(jobs))
        if full:
            return full
        answers = await self._wait(self._submit(jobs))
        failed = next((a for a in answers if a.status != 200), None)
        if failed is not None:
            return failed
        if any(a.media_type != "image/png" for a in answers):
            return Answer.error(500, "result: not an image")
        job = jobs[0]
        return Answer.document(200, {"created": int(time.time()), "output_format": "png",
                                 "size": f"{job.width}x{job.height}",
                                 "data": [{"b64_json": base64.b64encode(a.body).decode()} for a in answers]})

    def _full(self, n: int) -> Answer | None:
        if len(self._held) + n > self.options.max_queue:
            return Answer.error(503, f"queue: {len(self._held)} jobs submitted and not answered; at most "
                                     f"{self.options.max_queue} (max_queue): try again later")
        return None

    def _keep(self, p: Pending) -> None:
        """A ``wait: false`` job, kept for polling and DELETE."""
        self._jobs[p.id] = p
        while len(self._jobs) > KEPT_RESULTS:  # the oldest finished answers go first
            old = next((k for k, v in self._jobs.items() if v.future.done()), None)
            if old is None:
                break
            del self._jobs[old]

    async def _wait(self, ps: list[Pending]) -> list[Answer]:
        """The answers of ``ps``. The client gone (Serve cancels its request) cancels those
        not answered: dropped if queued, stopped between two steps if running."""
        try:
            return list(await asyncio.shield(asyncio.gather(*(p.future for p in ps))))
        except asyncio.CancelledError:
            for p in ps:
                if not p.future.done() and p.state != "stopping":
                    self._cancel(p, "disconnect")
            raise

    @staticmethod
    async def _read_body(request: Request, most: int) -> bytes | Answer:
        """The body, or its 413 past ``most`` bytes. A body over the bound is read to its end
        (and dropped) up to ``DRAINED_BODY_BYTES``: a client that sends it whole before reading
        (urllib, requests) gets the 413, not a connection reset by the proxy closing on unread bytes."""
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > max(most, DRAINED_BODY_BYTES):
            return Answer.error(413, f"body: {declared[:20]} bytes; at most {most}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAINED_BODY_BYTES:
                break
            if size <= most:
                chunks.append(chunk)
        if size > most:
            what = f"{declared[:20]} bytes" if declared.isdigit() else f"over {most} bytes"
            return Answer.error(413, f"body: {what}; at most {most}")
        return b"".join(chunks)

    # ---- jobs on the gang ----

    def _submit(self, jobs: list[Job]) -> list[Pending]:
        """Each job submitted to the gang now, with its deadline and the task that answers it."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        ps = []
        for job in jobs:
            p = Pending(uuid.uuid4().hex, job, now, loop.create_future())
            self._held[p.id] = p
            p.timer = loop.call_later(self.limits.request_timeout_s, self._expire, p)
            try:
                self._attempt(p)
            except Exception as e:  # the gang took no job: nothing to await
                self._held.pop(p.id)
                self._answer(p, Answer.error(503, f"gang: it took no job ({type(e).__name__}: {str(e)[:200]}); "
                                                  "try again later"))
            else:
                p.task = loop.create_task(self._follow(p))
            ps.append(p)
        self.metrics.queue.set(len(self._held))
        return ps

    def _attempt(self, p: Pending) -> None:
        p.result = self._gang.submit(p.job)
        p.key = getattr(p.result, "key", -1)
        p.attempts += 1

    async def _follow(self, p: Pending) -> None:
        """Await the gang's result of ``p`` (submitted again once if its block lost a rank) and
        answer it, unless it was answered already (its deadline, a cancel)."""
        try:
            while True:
                result = await asyncio.wrap_future(p.result)
                self.metrics.observe(result)
                if not (getattr(result, "lost", False) and p.attempts < 2 and p.stop is None
                        and not p.future.done()):
                    break
                self.metrics.retries.inc()
                self._attempt(p)
            if not p.future.done():
                await self._settle(p, result)
        except Exception as e:  # never leave a client waiting on a job this replica dropped
            self._answer(p, Answer.error(500, f"job: {type(e).__name__}: {str(e)[:300]}"))
        finally:
            self._held.pop(p.id, None)
            self.metrics.queue.set(len(self._held))

    async def _settle(self, p: Pending, result: Any) -> None:
        if getattr(result, "lost", False):
            if p.stop in CANCEL_REASONS:  # cancelled while it waited to be submitted again
                self.metrics.cancelled.labels(reason=p.stop, state="queued").inc()
                self._answer(p, self._cancelled(p, p.stop, "queued"), "cancelled")
            else:
                self._answer(p, Answer.error(503, "job: its block lost a rank twice (submitted again once; the gang "
                                                  "restarts itself); try again"))
        elif getattr(result, "cancelled", False) and p.stop in CANCEL_REASONS:
            self._answer(p, self._cancelled(p, p.stop, "running"), "cancelled")
        elif result.error is not None:
            self._answer(p, Answer.error(500, f"job: {result.error}"))
        else:
            t0 = time.monotonic()
            try:
                answer = await asyncio.to_thread(media_answer, result.frames)
            except Exception as e:
                answer = Answer.error(500, f"result: could not encode it ({type(e).__name__}: {str(e)[:200]})")
            self.metrics.media.observe(time.monotonic() - t0)
            self._answer(p, answer)

    def _status(self, p: Pending) -> str:
        """What a poll says of a job not answered: queued, running or stopping (``submitted``
        where the gang cannot tell whether it waits or runs)."""
        if p.state != "submitted":
            return p.state
        state = getattr(self._gang, "state", None)
        if state is None:
            return "submitted"
        return "queued" if state(p.key) in ("new", "waiting") else "running"

    def _cancel(self, p: Pending, reason: str) -> str:
        """Cancel a job not answered (``CANCEL_REASONS``): ``dropped`` (it waited: answered 410
        now), ``stopping`` (it runs: answered 410 once its block stops it), or ``done`` (the
        gang has its result; the job is answered from it)."""
        p.stop = reason
        said = self._gang.cancel(p.key) if p.key >= 0 else "done"
        if said == "dropped":
            self.metrics.cancelled.labels(reason=reason, state="queued").inc()
            self._answer(p, self._cancelled(p, reason, "queued"), "cancelled")
        elif said == "stopping":
            self.metrics.cancelled.labels(reason=reason, state="running").inc()
            p.state = "stopping"
        else:
            said = "done"
        return said

    @staticmethod
    def _cancelled(p: Pending, reason: str, state: str) -> Answer:
        when = "before it ran" if state == "queued" else "while it ran: stopped between two steps"
        return Answer.error(410, f"job {p.id}: cancelled {when} ({reason})")

    def _expire(self, p: Pending) -> None:
        """Its deadline: the job is answered 504 now, and cancelled on the gang: dropped if
        queued, stopped between two steps if running."""
        if p.future.done():
            return
        t = self.limits.request_timeout_s
        p.stop = "deadline"
        said = self._gang.cancel(p.key) if p.key >= 0 else "done"
        if said == "dropped":
            state, text = "queued", f"job: still queued after {t:g} s (--request-timeout); dropped, never drawn"
        else:
            state, text = "running", f"job: running past {t:g} s (--request-timeout); stopped between two steps"
        self.metrics.expired.labels(state=state).inc()
        self._answer(p, Answer.error(504, text), "expired")

    def _answer(self, p: Pending, answer: Answer, state: str = "done") -> None:
        if p.future.done():
            return
        p.future.set_result(answer)
        p.state = state
        if p.timer is not None:
            p.timer.cancel()
        self.metrics.latency.observe(time.monotonic() - p.arrived)

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
        gang = getattr(self, "_gang", None)
        if gang is not None:
            try:
                gang.close()
            except Exception:
                pass


# ---- applications -------------------------------------------------------------------------------


def build_app(options: ServeOptions):
    """The Serve application of ``options`` (``serve.run(build_app(...))``). The replica takes
    twice its queue and ``SPARE_REQUESTS`` (requests it answers at once: 400, 503, /health,
    polls); Serve's proxy holds at most ``max_queue`` more and answers the rest 503 itself,
    so a flood is bounded before it reaches the replica too."""
    return Generator.options(max_ongoing_requests=2 * options.max_queue + SPARE_REQUESTS,
                             max_queued_requests=options.max_queue).bind(options)


def app_builder(args: dict):  # plain dict: Serve inspects the annotation (a pydantic model is parsed)
    """Serve's application builder (``import_path: knapray.driver.serving:app_builder``):
    ``args`` are ``ServeOptions``' fields."""
    return build_app(ServeOptions.from_dict(dict(args)))


def serve_config(options: ServeOptions, *, host: str = "127.0.0.1", port: int = 8000) -> dict[str, Any]:
    """A Serve config for ``serve deploy`` that serves ``options`` on ``host`` (defaults left
    out). An API key is never written: the config requires one (``require_api_key``) and
    the replica reads it from ``KNAPRAY_API_KEY``."""
    defaults = ServeOptions(run=options.run)
    args = {k: v for k, v in options.to_dict().items()
            if k == "run" or (k != "api_key" and v != getattr(defaults, k))}
    if options.api_key is not None:
        args["require_api_key"] = True
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": "knapray", "route_prefix": "/",
                              "import_path": "knapray.driver.serving:app_builder", "args": args}]}
