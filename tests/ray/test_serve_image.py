"""``knapray serve``'s ``image`` over real HTTP, on one local Serve instance: the stand-in
deployment of test_serve_http.py (a text-to-image run) and, beside it, the real gang serving
the tiny Wan 2.2 TI2V run of test_ti2v_sampling.py (a time per token, its corpus's VAE).

- a request with a base64 PNG or JPEG is the clip ``knapray sample --image`` draws from that
  file on the same run, seed and steps: the same MP4, byte for byte;
- a PNG at the size Wan 2.2 TI2V-5B samples (1280x704, 2.7 MB) fits in a request's body;
  one over the body's bound is 413 (the body read to its end, so that urllib, which sends it
  whole first, reads the answer instead of a connection reset), bytes that are no image 400
  naming ``image``;
- an ``image`` sent to the text-to-image run is 400 naming ``image``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json

import numpy as np
import pytest

import test_serve_http
import test_ti2v_sampling
from needs import needs
from test_serve_http import _call, _error, needs_serve
from test_ti2v_sampling import FRAMES, GUIDANCE, SEED, SIZE, STEPS

served = test_serve_http.served
"""The stand-in deployment (a text-to-image run, an API key) and the Serve instance it starts."""
ti2v = test_ti2v_sampling.ti2v
"""The tiny TI2V run, its VAE, a corpus sample id and a 64x40 PNG."""

pytestmark = [pytest.mark.ray, needs_serve, needs("diffusers", "av")]


def _frames(clip: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(clip)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.timeout(400)
def test_a_served_image_is_knapray_sample_image(served, ti2v, tmp_path):
    from PIL import Image
    from ray import serve

    from knapray.cli import main
    from knapray.driver.serving import MAX_BODY_BYTES, MAX_IMAGE_BODY_BYTES, ServeOptions, build_app

    png = open(ti2v["image"], "rb").read()
    jpeg_path = tmp_path / "first.jpg"
    Image.open(ti2v["image"]).convert("RGB").save(jpeg_path, format="JPEG", quality=90)
    jpeg = jpeg_path.read_bytes()
    rng = np.random.default_rng(0)
    big = io.BytesIO()  # noise: PNG compresses it not at all, the largest a 1280x704 frame's file gets
    Image.fromarray(rng.integers(0, 256, size=(704, 1280, 3), dtype=np.uint8)).save(big, format="PNG")
    big = big.getvalue()
    assert MAX_BODY_BYTES < 4 * len(big) / 3 < MAX_IMAGE_BODY_BYTES, len(big)

    request = {"like": ti2v["like"], "size": SIZE, "frames": FRAMES, "steps": STEPS, "guidance": GUIDANCE,
               "seed": SEED}
    serve.run(build_app(ServeOptions(run=ti2v["run"], world_size=1, device="cpu")), name="knapray-ti2v",
              route_prefix="/ti2v")
    try:
        url = f"{served}/ti2v/v1/generate"
        bodies = [{**request, "image": _b64(png)}, {**request, "image": _b64(jpeg)}, {**request, "image": _b64(big)}]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _call(url, json.dumps(b).encode(), 300), bodies))
        for status, kind, body in answers:
            assert status == 200 and kind == "video/mp4", (status, body[:300])

        # what knapray sample --image writes for each file: the same clip (uint8 frames, one encoder)
        for (_, _, clip), path, name in zip(answers, (ti2v["image"], jpeg_path), ("png", "jpeg")):
            out = tmp_path / f"sample-{name}"
            assert main(["sample", "--run", ti2v["run"], "--like", str(ti2v["like"]), "--size", SIZE, "--frames",
                         str(FRAMES), "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED),
                         "--image", str(path), "--out", f"{out}/"]) == 0
            want = (out / "request_0.mp4").read_bytes()
            got, ref = _frames(clip), _frames(want)
            assert got.shape == (1 + 4 * (FRAMES - 1), 32, 48, 3), got.shape
            diff = int(np.abs(got.astype(int) - ref.astype(int)).max())
            print(f"\nserved {name}: {len(clip)} bytes of MP4, frames against knapray sample --image: max |diff| "
                  f"{diff}, the files {'equal' if clip == want else 'different'}")
            assert clip == want and diff == 0
        assert _frames(answers[0][2]).tolist() != _frames(answers[1][2]).tolist()  # the image is what it drew from

        # over the body's bound; bytes that are no image
        over = {**request, "image": _b64(b"\x89PNG\r\n\x1a\n" + rng.bytes(MAX_IMAGE_BODY_BYTES))}
        status, _, body = _call(url, json.dumps(over).encode())
        assert status == 413 and _error(body).startswith("body: ") and str(MAX_IMAGE_BODY_BYTES) in _error(body), body
        status, _, body = _call(url, json.dumps({**request, "image": _b64(b"GIF89a not a picture")}).encode())
        assert status == 400 and _error(body).startswith("image: not an image that can be read"), body
        status, _, body = _call(url, json.dumps({**request, "image": "not base64!"}).encode())
        assert status == 400 and _error(body).startswith("image: not base64"), body
        status, _, body = _call(f"{served}/ti2v/v1/models")
        assert json.loads(body)["data"][0]["limits"]["max_body_bytes"] == MAX_IMAGE_BODY_BYTES
        assert _call(f"{served}/ti2v/health")[0] == 200

        # the text-to-image run beside it takes no image, and keeps the smaller bound
        status, _, body = _call(f"{served}/v1/generate", json.dumps({"caption": "a cat", "image": _b64(png)}).encode())
        assert status == 400 and _error(body).startswith("image: this run's model takes no conditioning image"), body
        status, _, body = _call(f"{served}/v1/generate", json.dumps({"caption": "a cat", "image": _b64(big)}).encode())
        assert status == 413 and str(MAX_BODY_BYTES) in _error(body), body
    finally:
        serve.delete("knapray-ti2v")
