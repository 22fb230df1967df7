"""Corpus builders and the row schema: synthetic corpora, image ingestion, decoding and
corruption detection. No Ray here."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from knapray.corpus import (
    CORPUS_SCHEMA,
    CorruptSample,
    HashTextEncoder,
    PixelPatchEncoder,
    decode_row,
    read_corpus,
    read_schema_json,
    shard_paths,
    validate_row,
)
from knapray.corpus import ingest as ingest_mod
from knapray.corpus.encoders import tokenize
from knapray.corpus.schema import visual_token_count
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic, sample_lengths, smooth_field

MIX = "g2b3i64f1s0,g1b2i128f4s0,g1b1i64f7s1"  # image, keyframe, video
TINY = dict(mix=MIX, steps=2, scale=2, channels=3, text_dim=8, pooled_dim=5, max_text_tokens=12)


def build(out: Path, **overrides) -> pa.Table:
    cfg = SyntheticConfig(**{**TINY, "shards": 2, **overrides})
    build_synthetic(cfg, out, progress=False)
    return read_corpus(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    out = tmp_path_factory.mktemp("tiny")
    return out, build(out)


# --- synthetic corpus ---------------------------------------------------------------


def test_synthetic_columns_and_lengths_are_consistent(tiny: tuple[Path, pa.Table]) -> None:
    out, table = tiny
    assert table.schema.equals(CORPUS_SCHEMA)
    assert [p.name for p in shard_paths(out)] == ["part-00000.parquet", "part-00001.parquet"]
    assert table.num_rows == 2 * (2 * 3 + 1 * 2 + 1 * 1)
    rows = table.to_pylist()
    assert sorted(r["sample_id"] for r in rows) == list(range(table.num_rows))
    side = {"g2b3i64f1s0": 4, "g1b2i128f4s0": 8, "g1b1i64f7s1": 4}  # 2 * R // (16 * 2)
    frames = {"g2b3i64f1s0": 1, "g1b2i128f4s0": 4, "g1b1i64f7s1": 2}  # int(7 / 3.4) = 2
    kind = {"g2b3i64f1s0": "image", "g1b2i128f4s0": "keyframe", "g1b1i64f7s1": "video"}
    for r in rows:
        src = r["source"]
        assert (r["height"], r["width"], r["frames"]) == (side[src], side[src], frames[src])
        assert r["kind"] == kind[src]
        assert r["visual_tokens"] == r["frames"] * (r["height"] // 2) * (r["width"] // 2)
        assert 0 <= r["text_tokens"] <= 12 // 2
        assert r["seq_len"] == r["visual_tokens"] + r["text_tokens"]
        assert len(r["latent"]) == 3 * r["frames"] * r["height"] * r["width"]
        assert len(r["text"]) == 8 * r["text_tokens"]
        assert len(r["pooled"]) == 5
        validate_row(r, text_dim=8, pooled_dim=5)


def test_schema_json_describes_the_corpus(tiny: tuple[Path, pa.Table]) -> None:
    out, table = tiny
    doc = read_schema_json(out)
    assert list(doc["columns"]) == CORPUS_SCHEMA.names
    assert doc["dims"] == {"channels": 3, "text_dim": 8, "pooled_dim": 5, "vae_downsample": 8,
                           "patch": [1, 2, 2]}
    assert doc["mix"] == MIX and doc["scale"] == 2 and doc["payload"] is True
    assert doc["counts"]["samples"] == table.num_rows
    assert doc["counts"]["by_kind"] == {"image": 12, "keyframe": 4, "video": 2}
    assert doc["counts"]["by_source"]["g1b2i128f4s0"] == 4
    assert doc["counts"]["seq_len"]["total"] == sum(table.column("seq_len").to_pylist())


def test_same_seed_gives_identical_files(tmp_path: Path, tiny: tuple[Path, pa.Table]) -> None:
    out, table = tiny
    again = build(tmp_path / "again")
    assert again.equals(table)
    for a, b in zip(shard_paths(out), shard_paths(tmp_path / "again")):
        assert a.read_bytes() == b.read_bytes()
    other = build(tmp_path / "seed1", seed=1)
    assert other.column("latent").to_pylist() != table.column("latent").to_pylist()


def test_sample_content_does_not_depend_on_sharding(tmp_path: Path, tiny: tuple[Path, pa.Table]) -> None:
    _, table = tiny
    assert build(tmp_path / "one", shards=1).equals(table)
    assert len(shard_paths(tmp_path / "one")) == 1


def test_lengths_only_corpus_has_the_same_lengths_and_null_payload(
    tmp_path: Path, tiny: tuple[Path, pa.Table]
) -> None:
    _, table = tiny
    lengths = build(tmp_path / "lengths", payload=False)
    for col in ("sample_id", "source", "frames", "height", "width", "visual_tokens", "seq_len"):
        assert lengths.column(col).equals(table.column(col)), col
    assert lengths.column("latent").null_count == lengths.num_rows
    assert read_schema_json(tmp_path / "lengths")["payload"] is False
    row = lengths.slice(0, 1).to_pylist()[0]
    validate_row(row, payload=False)
    with pytest.raises(CorruptSample) as e:
        decode_row(row)
    assert e.value.reason == "missing_payload"


def test_full_scale_lengths_match_the_paper_codes(tmp_path: Path) -> None:
    cfg = SyntheticConfig(mix="image+video", steps=1, channels=16, payload=False)
    lengths = sample_lengths(cfg)
    codes = cfg.codes
    expected = np.array([codes[i].visual_tokens for i in lengths.code_index])
    np.testing.assert_array_equal(lengths.visual_tokens, expected)
    assert lengths.visual_tokens.max() == 32 * 32 * 25  # g4b1i512f85s1
    assert lengths.text_tokens.max() <= 392
    build_synthetic(cfg, tmp_path / "full", progress=False)
    assert read_schema_json(tmp_path / "full")["counts"]["samples"] == lengths.sample_id.size


def test_latents_are_smooth_fields_not_noise() -> None:
    rng = np.random.default_rng(0)
    field, params = smooth_field(rng, 4, 2, 32, 32, noise=0.05)
    assert field.shape == (4, 2, 32, 32) and field.dtype == np.float32
    step = np.abs(np.diff(field, axis=-1)).mean()
    # White noise would give a mean neighbour step of ~1.13 std.
    assert step < 0.5 * field.std()
    assert params.ndim == 1 and np.isfinite(params).all()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"scale": 5}, r"valid scales for this mix are 1\.\.4"),
        ({"mix": "g2b3i64"}, "bad data code"),
        ({"shards": 100}, "shards=100 exceeds"),
        ({"channels": 0}, "channels must be an integer >= 1"),
    ],
)
def test_bad_synthetic_config_is_rejected(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**{**TINY, **overrides})


def test_writing_into_a_corpus_directory_is_refused(tiny: tuple[Path, pa.Table]) -> None:
    out, _ = tiny
    with pytest.raises(FileExistsError, match="already holds shards"):
        build_synthetic(SyntheticConfig(**TINY), out, progress=False)


def test_cli_builds_a_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--mix", MIX, "--out", str(tmp_path / "cli"), "--scale", "2", "--shards", "1",
            "--channels", "3", "--text-dim", "8", "--pooled-dim", "5", "--quiet"]
    from knapray.commands import synthetic as command

    assert command.main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("schema.json")
    assert read_corpus(tmp_path / "cli").num_rows == 9
    with pytest.raises(SystemExit) as e:
        command.main(["--mix", MIX, "--out", str(tmp_path / "bad"), "--scale", "9"])
    assert e.value.code == 2


# --- decode / corruption --------------------------------------------------------------


def test_decode_row_round_trip(tiny: tuple[Path, pa.Table]) -> None:
    _, table = tiny
    for row in table.to_pylist():
        s = decode_row(row, text_dim=8, pooled_dim=5)
        c, t, h, w = s["latent"].shape
        assert (c, t, h, w) == (row["channels"], row["frames"], row["height"], row["width"])
        assert s["text"].shape == (row["text_tokens"], 8)
        assert s["pooled"].shape == (5,)
        assert all(s[k].dtype == np.float32 for k in ("latent", "text", "pooled"))
        np.testing.assert_array_equal(s["latent"].ravel(), np.float32(row["latent"]))
        np.testing.assert_array_equal(s["text"].ravel(), np.float32(row["text"]))
        assert s["sample_id"] == row["sample_id"] and s["source"] == row["source"]


def test_decode_accepts_numpy_rows_as_ray_data_gives_them(tiny: tuple[Path, pa.Table]) -> None:
    _, table = tiny
    row = table.slice(0, 1).to_pylist()[0]
    np_row = {k: (np.asarray(v, dtype=np.float32) if isinstance(v, list) else v) for k, v in row.items()}
    np_row.update({k: np.int32(row[k]) for k in ("frames", "height", "width", "seq_len")})
    np.testing.assert_array_equal(decode_row(np_row)["latent"], decode_row(row)["latent"])


def _corrupt(row: dict, kind: str) -> dict:
    row = dict(row)
    if kind == "latent_size":
        row["latent"] = row["latent"][:-1]
    elif kind == "non_finite_latent":
        row["latent"] = [float("nan")] + row["latent"][1:]
    elif kind == "non_finite_pooled":
        row["pooled"] = [float("inf")] + row["pooled"][1:]
    elif kind == "non_positive_length":
        row["frames"] = 0
    elif kind == "negative_text":
        row["text_tokens"] = -1
    elif kind == "seq_len_mismatch":
        row["seq_len"] += 1
    elif kind == "visual_tokens_mismatch":
        row["visual_tokens"] += 1
        row["seq_len"] += 1
    elif kind == "missing_payload":
        row["latent"] = None
    elif kind == "bad_kind":
        row["kind"] = "audio"
    elif kind == "missing_column":
        del row["height"]
    elif kind == "text_size":
        row["text"] = row["text"] + [0.0]
    elif kind == "pooled_size":
        row["pooled"] = row["pooled"][:-1]
    return row


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("latent_size", "latent_size"),
        ("non_finite_latent", "non_finite"),
        ("non_finite_pooled", "non_finite"),
        ("non_positive_length", "non_positive_length"),
        ("negative_text", "non_positive_length"),
        ("seq_len_mismatch", "seq_len_mismatch"),
        ("visual_tokens_mismatch", "visual_tokens_mismatch"),
        ("missing_payload", "missing_payload"),
        ("bad_kind", "bad_kind"),
        ("missing_column", "missing_column"),
        ("text_size", "text_size"),
        ("pooled_size", "pooled_size"),
    ],
)
def test_corruption_raises_corrupt_sample(tiny: tuple[Path, pa.Table], kind: str, reason: str) -> None:
    _, table = tiny
    # A row with text tokens, so text-size corruption is detectable without text_dim.
    row = next(r for r in table.to_pylist() if r["text_tokens"] > 0)
    bad = _corrupt(row, kind)
    with pytest.raises(CorruptSample) as e:
        decode_row(bad, text_dim=8, pooled_dim=5)
    assert e.value.reason == reason
    assert e.value.sample_id == row["sample_id"]
    assert f"corrupt sample {row['sample_id']}: {reason}" in str(e.value)
    assert isinstance(e.value, ValueError)
    decode_row(row, text_dim=8, pooled_dim=5)  # the original row is fine


# --- encoders and ingestion -------------------------------------------------------------


def test_pixel_patch_encoder_pools_and_mixes() -> None:
    enc = PixelPatchEncoder(channels=5, downsample=4, seed=3)
    px = np.zeros((2, 8, 12, 3), dtype=np.uint8)
    px[..., 0] = 255  # pure red
    px[1, :4, :4] = 0  # one black block in frame 1
    lat = enc.encode(px)
    assert lat.shape == (5, 2, 2, 3) and lat.dtype == np.float32
    red = enc._mix @ np.array([1.0, -1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(lat[:, 0, 1, 2], red, rtol=1e-6)
    np.testing.assert_allclose(lat[:, 1, 0, 0], enc._mix @ -np.ones(3, np.float32), rtol=1e-6)
    with pytest.raises(ValueError, match="not a multiple of downsample 4"):
        enc.encode(np.zeros((1, 6, 8, 3), np.uint8))


def test_hash_text_encoder_is_deterministic_and_truncates() -> None:
    enc = HashTextEncoder(dim=6, pooled_dim=3)
    text, pooled = enc.encode("A red fox, jumping.", max_tokens=4)
    assert tokenize("A red fox, jumping.") == ["a", "red", "fox", ",", "jumping", "."]
    assert text.shape == (4, 6) and pooled.shape == (3,)
    again, _ = HashTextEncoder(dim=6, pooled_dim=3).encode("a RED fox , jumping", max_tokens=4)
    np.testing.assert_array_equal(text, again)
    assert not np.allclose(text[1], text[2])
    empty, empty_pooled = enc.encode("", max_tokens=4)
    assert empty.shape == (0, 6) and not empty_pooled.any()


@pytest.fixture()
def media_dir(tmp_path: Path) -> Path:
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to write test images")
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)

    def pixels(h: int, w: int) -> np.ndarray:
        return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)

    image.fromarray(pixels(37, 53)).save(root / "odd.png")
    (root / "odd.txt").write_text("A small odd-sized picture")
    image.fromarray(pixels(70, 200)).save(root / "sub" / "wide.jpg")
    rgba = np.concatenate([pixels(40, 33), np.full((40, 33, 1), 128, np.uint8)], axis=-1)
    image.fromarray(rgba, mode="RGBA").save(root / "sub" / "alpha.png")
    image.fromarray(pixels(9, 40)).save(root / "tiny.png")  # below 16 px: skipped
    frames = [image.fromarray(pixels(48, 32)) for _ in range(3)]
    frames[0].save(root / "anim.gif", save_all=True, append_images=frames[1:], duration=50)
    (root / "clip.mp4").write_bytes(b"not really a video")
    (root / "notes.md").write_text("ignored")
    return root


def test_ingest_images_of_odd_sizes(media_dir: Path, tmp_path: Path) -> None:
    cfg = ingest_mod.IngestConfig(max_side=64, max_text_tokens=3)
    with pytest.warns(UserWarning) as caught:
        report = ingest_mod.ingest(media_dir, tmp_path / "c", cfg, progress=False)
    video_skip = "unreadable" if ingest_mod.video_decoder() else "video_no_decoder"
    assert report.skipped == {"too_small": 1, video_skip: 1}  # clip.mp4 holds no video
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert any("skipped 1 file(s)" in m and "(too_small)" in m and "tiny.png" in m for m in messages)
    assert any(f"({video_skip})" in m and "clip.mp4" in m for m in messages)
    assert report.written == 4
    rows = {r["source"]: r for r in read_corpus(tmp_path / "c").to_pylist()}
    assert set(rows) == {"odd.png", "sub/wide.jpg", "sub/alpha.png", "anim.gif"}
    # 37x53 -> crop to 32x48 px -> latent 4x6; 70x200 -> shrink to 22x64 -> crop 16x64 -> 2x8
    assert (rows["odd.png"]["height"], rows["odd.png"]["width"]) == (4, 6)
    assert (rows["sub/wide.jpg"]["height"], rows["sub/wide.jpg"]["width"]) == (2, 8)
    assert rows["anim.gif"]["kind"] == "video" and rows["anim.gif"]["frames"] == 3
    assert rows["odd.png"]["kind"] == "image" and rows["odd.png"]["frames"] == 1
    assert rows["odd.png"]["text_tokens"] == 3  # caption truncated to max_text_tokens
    assert rows["sub/wide.jpg"]["text_tokens"] == 0  # no sidecar caption
    for r in rows.values():
        s = decode_row(r, text_dim=64, pooled_dim=32)
        assert s["latent"].shape[0] == 4
        assert r["height"] % 2 == 0 and r["width"] % 2 == 0
        assert r["visual_tokens"] == visual_token_count(r["frames"], r["height"], r["width"])
    doc = read_schema_json(tmp_path / "c")
    assert doc["builder"] == "ingest" and doc["counts"]["samples"] == 4
    assert doc["dims"]["channels"] == 4 and doc["encoder"] == "PixelPatchEncoder"


def test_ingest_reads_no_file_through_a_link(media_dir: Path, tmp_path: Path) -> None:
    """A link to a picture outside --input (and a caption, a metadata file linked in) is not
    read unless --follow-symlinks; a link inside stays out too (a regular file only)."""
    image = pytest.importorskip("PIL.Image")
    outside = tmp_path / "outside"
    outside.mkdir()
    image.fromarray(np.full((32, 32, 3), 7, np.uint8)).save(outside / "secret.png")
    (outside / "secret.txt").write_text("a caption from outside")
    (outside / "metadata.jsonl").write_text('{"file_name": "odd.png", "text": "planted"}\n')
    (media_dir / "link.png").symlink_to(outside / "secret.png")
    (media_dir / "link.txt").symlink_to(outside / "secret.txt")
    (media_dir / "metadata.jsonl").symlink_to(outside / "metadata.jsonl")
    (media_dir / "inner.png").symlink_to(media_dir / "odd.png")
    cfg = ingest_mod.IngestConfig(max_side=64, max_text_tokens=3)
    with pytest.warns(UserWarning):
        ingest_mod.ingest(media_dir, tmp_path / "c", cfg, progress=False)
    rows = {r["source"]: r for r in read_corpus(tmp_path / "c").to_pylist()}
    assert set(rows) == {"odd.png", "sub/wide.jpg", "sub/alpha.png", "anim.gif"}
    items, _ = ingest_mod.media_items(media_dir)
    assert {i.source: i.caption for i in items}["odd.png"] == "A small odd-sized picture"  # not "planted"
    followed, _ = ingest_mod.media_items(media_dir, follow_symlinks=True)
    by_source = {i.source: i for i in followed}
    assert {"link.png", "inner.png"} <= set(by_source) and by_source["odd.png"].caption == "planted"
    assert by_source["link.png"].caption == "a caption from outside"


def test_ingest_ids_are_stable_across_runs(media_dir: Path, tmp_path: Path) -> None:
    cfg = ingest_mod.IngestConfig(max_side=64)
    with pytest.warns(UserWarning):
        ingest_mod.ingest(media_dir, tmp_path / "a", cfg, progress=False)
    (media_dir / "odd.png").unlink()  # removing a file must not renumber the others
    with pytest.warns(UserWarning):
        ingest_mod.ingest(media_dir, tmp_path / "b", cfg, progress=False)
    a = {r["source"]: r["sample_id"] for r in read_corpus(tmp_path / "a").to_pylist()}
    b = {r["source"]: r["sample_id"] for r in read_corpus(tmp_path / "b").to_pylist()}
    assert len(set(a.values())) == len(a) == 4
    assert b == {k: v for k, v in a.items() if k != "odd.png"}


class _BadEncoder:
    channels = 4
    downsample = 8

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        return np.zeros((4, 1, 1, 1), np.float32)


def test_ingest_rejects_an_encoder_with_wrong_output(media_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"_BadEncoder.encode returned shape \(4, 1, 1, 1\)"):
        ingest_mod.ingest(media_dir, tmp_path / "bad", encoder=_BadEncoder(), progress=False)
    with pytest.raises(TypeError, match="does not implement LatentEncoder"):
        ingest_mod.ingest(media_dir, tmp_path / "bad2", encoder=object(), progress=False)  # type: ignore[arg-type]


def test_ingest_without_pillow_names_the_missing_package(
    media_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `from PIL import Image` fail
    with pytest.raises(ImportError, match="needs Pillow.*pip install Pillow"):
        ingest_mod.ingest(media_dir, tmp_path / "out", progress=False)


def test_ingest_of_an_empty_folder_names_the_extensions(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no media under .*'\.png'"):
        ingest_mod.ingest(tmp_path, tmp_path / "out", progress=False)


def test_schema_json_is_valid_json_with_columns(tiny: tuple[Path, pa.Table]) -> None:
    out, _ = tiny
    doc = json.loads((out / "schema.json").read_text())
    assert doc["columns"]["latent"].startswith("list<")
    assert doc["shards"] == [p.name for p in shard_paths(out)]


# --- captions, batching, the encoders extra ----------------------------------------------


def _captioned(root: Path) -> Path:
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to write test images")
    rng = np.random.default_rng(3)
    for rel in ("a.png", "b.png", "c.png", "sub/d.png", "sub/e.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        image.fromarray(rng.integers(0, 256, size=(32, 48, 3), dtype=np.uint8)).save(root / rel)
    lines = [
        {"file_name": "a.png", "caption": "one two three", "text": "ignored column"},
        {"file_name": "b.png", "caption": None},
        {"file_name": "gone.png", "caption": "names no file"},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    # file_name is relative to the metadata file's own folder
    (root / "sub" / "metadata.jsonl").write_text(json.dumps({"file_name": "d.png", "caption": "four"}) + "\n")
    (root / "a.txt").write_text("the sidecar loses to metadata.jsonl")
    (root / "c.txt").write_text("five six")
    return root


def test_metadata_jsonl_captions_win_over_sidecars(tmp_path: Path) -> None:
    root = _captioned(tmp_path / "in")
    cfg = ingest_mod.IngestConfig(caption_column="caption")
    with pytest.warns(UserWarning, match=r"1 metadata.jsonl entries under .* name no media file"):
        ingest_mod.ingest(root, tmp_path / "c", cfg, progress=False)
    tokens = {r["source"]: r["text_tokens"] for r in read_corpus(tmp_path / "c").to_pylist()}
    # HashTextEncoder: one token per word
    assert tokens == {"a.png": 3, "b.png": 0, "c.png": 2, "sub/d.png": 1, "sub/e.png": 0}
    doc = read_schema_json(tmp_path / "c")
    assert doc["captions"] == {"column": "caption", "metadata": 3, "sidecar": 1, "none": 1}
    assert doc["encoders"]["latent"] == {"class": "PixelPatchEncoder", "channels": 4, "downsample": 8,
                                         "temporal_downsample": 1, "seed": 0}
    assert doc["encoders"]["text"] == {"class": "HashTextEncoder", "dim": 64, "pooled_dim": 32}


def test_a_trigger_word_and_folder_repeats_as_kohya_reads_them(tmp_path: Path) -> None:
    """``--trigger sks``: every caption starts "sks, " (an empty one is "sks"); a top-level
    folder named ``3_sub``: each of its files is 3 rows under 3 sample ids, the same payload;
    both recorded in schema.json. A folder of 0 repeats is refused, naming it."""
    root = _captioned(tmp_path / "in")
    (root / "sub").rename(root / "3_sub")
    cfg = ingest_mod.IngestConfig(caption_column="caption", trigger="sks")
    with pytest.warns(UserWarning, match="name no media file"):
        report = ingest_mod.ingest(root, tmp_path / "c", cfg, progress=False)
    rows = read_corpus(tmp_path / "c").to_pylist()
    assert report.written == len(rows) == 3 + 2 * 3 and len({r["sample_id"] for r in rows}) == 9
    sources = [r["source"] for r in rows]
    assert {s: sources.count(s) for s in sources} == {"a.png": 1, "b.png": 1, "c.png": 1, "3_sub/d.png": 3,
                                                      "3_sub/e.png": 3}
    # HashTextEncoder: a token per word and per comma: "sks, " two more, "sks" alone one
    assert {r["source"]: r["text_tokens"] for r in rows} == {"a.png": 5, "b.png": 1, "c.png": 4, "3_sub/d.png": 3,
                                                             "3_sub/e.png": 1}
    copies = [r for r in rows if r["source"] == "3_sub/d.png"]
    assert all(c["latent"] == copies[0]["latent"] and c["text"] == copies[0]["text"] for c in copies)
    doc = read_schema_json(tmp_path / "c")
    assert doc["captions"]["trigger"] == "sks" and doc["repeats"] == {"3_sub": 3}
    (root / "3_sub").rename(root / "0_sub")
    with pytest.raises(ValueError, match=r"^folder '0_sub': 0 repeats \(its name's <N>_ prefix\); valid: 1 to 1000$"):
        ingest_mod.ingest(root, tmp_path / "d", cfg, progress=False)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"metadata.jsonl:2: not a JSON object"),
        ('{"text": "no file name"}', r"metadata.jsonl:2: expected an object with 'file_name'"),
        ('{"file_name": "a.png", "caption": "x"}', r"metadata.jsonl:2: no caption column 'text' .*--caption-column"),
        ('{"file_name": "a.png", "text": 3}', r"metadata.jsonl:2: 'text' is int, expected a string"),
        ('{"file_name": "x.png", "text": "a"}', r"metadata.jsonl:2: 'x.png' is captioned twice"),
    ],
)
def test_bad_metadata_lines_name_the_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to write test images")
    image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "x.png", "text": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        ingest_mod.ingest(tmp_path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_caption_or_name_that_is_not_text_skips_its_file_and_names_it(tmp_path: Path) -> None:
    """A lone surrogate (``"\\ud800"``: valid JSON, no UTF-8 for it) failed the whole ingest in
    pyarrow without naming the entry, and so did a file whose name is not UTF-8; now each file
    is skipped and counted, the metadata line or the file named."""
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to write test images")
    for name in ("a.png", "b.png", "c.png", os.fsdecode(b"d\xff.png")):
        image.fromarray(np.full((32, 32, 3), len(name), np.uint8)).save(tmp_path / name)
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "fine"}\n'
                                             '{"file_name": "b.png", "text": "bad \\ud800 here"}\n'
                                             '{"file_name": "c.png", "text": "also fine"}\n')
    with pytest.warns(UserWarning) as seen:
        report = ingest_mod.ingest(tmp_path, tmp_path / "out", progress=False)
    said = [str(w.message) for w in seen]
    assert any(re.search(r"skipped 1 file\(s\) .*\(caption_not_text\), e\.g\. .*metadata.jsonl:2", m) for m in said)
    assert any(re.search(r"skipped 1 file\(s\) .*\(name_not_text\), e\.g\. .*d\\xff\.png", m) for m in said), said
    assert report.written == 2 and report.skipped == {"caption_not_text": 1, "name_not_text": 1}
    assert sorted(r["source"] for r in read_corpus(tmp_path / "out").to_pylist()) == ["a.png", "c.png"]
    assert read_schema_json(tmp_path / "out")["counts"]["skipped"] == {"caption_not_text": 1, "name_not_text": 1}


def test_batch_size_does_not_change_the_corpus(tmp_path: Path) -> None:
    root = _captioned(tmp_path / "in")
    for name, batch in (("one", 1), ("many", 16)):
        with pytest.warns(UserWarning, match="name no media file"):
            ingest_mod.ingest(root, tmp_path / name, ingest_mod.IngestConfig(caption_column="caption", batch_size=batch),
                              progress=False)
    assert read_corpus(tmp_path / "one").equals(read_corpus(tmp_path / "many"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pooled_encoder": "/x"}, "pooled_encoder is given without text_encoder"),
        ({"vae": "/x", "encoder_factory": "m:f"}, "give vae or encoder_factory, not both"),
        ({"device": "tpu"}, r"device 'tpu' is not one of \('auto', 'cpu', 'cuda'\)"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"vae_batch": 0}, "vae_batch must be >= 1, got 0"),
    ],
)
def test_bad_encoder_spec_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ingest_mod.EncoderSpec(**kwargs)


def test_core_imports_and_ingests_without_the_encoders_extra(media_dir: Path, tmp_path: Path) -> None:
    """diffusers/transformers are optional: blocked, the package still imports and ingests
    with the stand-ins, and asking for a VAE names the extra to install."""
    import subprocess

    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(
        json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 4, "block_out_channels": [8, 16]})
    )
    code = f"""
import sys, warnings
sys.modules["diffusers"] = None
sys.modules["transformers"] = None
warnings.simplefilter("ignore")
from knapray.corpus import ingest as m
print(m.ingest({str(media_dir)!r}, {str(tmp_path / 'c')!r}, progress=False).written)
try:
    m.EncoderSpec(vae={str(tmp_path / 'vae')!r}).check()
except ImportError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    written, error = out.stdout.strip().splitlines()
    assert written == "4"
    assert "need diffusers" in error and "pip install 'knapray[encoders]'" in error
