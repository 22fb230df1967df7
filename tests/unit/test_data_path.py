"""The data path (issue 23 item 3): zero-copy readers, bf16 text, the byte-sized shuffle buffer.

Fast and single-process: the readers are compared on pyarrow batches as the torchrun
reader (``local_rows``) and Ray Data's pyarrow batches hand them over; tests/ray/test_data.py
runs Ray Data itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from knapray.corpus import CorruptSample, decode_row, read_corpus
from knapray.corpus.schema import BF16_TEXT, bf16_bits, bf16_to_fp32, load_schema_json, schema_doc_problem
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
from knapray.corpus.writer import ShardWriter, build_table, with_text_dtype
from knapray.data import (SHUFFLE_ROWS_MAX, StepStream, _as_tensor, arrow_rows, corpus_info, local_rows,
                          mean_row_bytes, shuffle_rows)

CORPUS = dict(mix="g2b2i256f1s0,g1b1i512f1s0,g1b1i256f17s1", steps=3, scale=8, channels=4, text_dim=32,
              pooled_dim=16, max_text_tokens=200, shards=3)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for dtype in ("fp32", "bf16"):
        path = tmp_path_factory.mktemp(f"corpus-{dtype}")
        build_synthetic(SyntheticConfig(**CORPUS, text_dtype=dtype), path, progress=False)
        out[dtype] = path
    return out


def samples_of(source: Any, corpus: Path) -> list[dict[str, Any]]:
    stream = StepStream.for_corpus(source, corpus_info(corpus), samples_per_step=4)
    return [s for step in stream for s in step.samples]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32),
                                                                                       b.view(np.uint32))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_readers_decode_the_same_samples_bit_for_bit_as_to_pylist(corpora: dict[str, Path], dtype: str) -> None:
    corpus = corpora[dtype]
    table = read_corpus(corpus)
    before = samples_of(table.to_pylist(), corpus)  # the rows the readers used to hand over
    torchrun = samples_of(local_rows(corpus, 0, 1, read_rows=5), corpus)
    ray_like = samples_of([table.slice(i, 7) for i in range(0, table.num_rows, 7)], corpus)  # pyarrow batches
    assert len(before) == len(torchrun) == len(ray_like) == table.num_rows
    for a, b, c in zip(before, torchrun, ray_like):
        for key in ("sample_id", "kind", "source", "frames", "height", "width", "text_tokens", "seq_len"):
            assert a[key] == b[key] == c[key]
        for key in ("latent", "text", "pooled"):
            assert same_bits(a[key], b[key]) and same_bits(a[key], c[key]), (a["sample_id"], key)


def test_payloads_are_views_of_the_arrow_buffers_and_tensors_share_them(corpora: dict[str, Path]) -> None:
    batch = next(iter(local_rows(corpora["fp32"], 0, 1)))
    values = batch.column("latent").values
    start = values.buffers()[1].address
    end = start + values.buffers()[1].size
    for row in arrow_rows(batch):
        sample = decode_row(row)
        for key in ("latent", "text", "pooled"):
            arr = sample[key]
            assert not arr.flags.owndata  # a view, not a copy
        latent = sample["latent"]
        assert start <= latent.ctypes.data < end  # inside the Arrow buffer
        tensor = _as_tensor(latent)
        assert tensor.data_ptr() == latent.ctypes.data and tensor.dtype == torch.float32


def test_bf16_corpus_stores_half_the_text_and_decodes_torchs_rounding(corpora: dict[str, Path]) -> None:
    doc = load_schema_json(str(corpora["bf16"]))
    assert doc["text_dtype"] == "bf16" and doc["columns"]["text"] == "large_binary"
    assert corpus_info(corpora["bf16"]).text_dtype == "bf16" and corpus_info(corpora["fp32"]).text_dtype == "fp32"
    assert read_corpus(corpora["bf16"]).schema.field("text").type == BF16_TEXT
    fp32 = samples_of(local_rows(corpora["fp32"], 0, 1), corpora["fp32"])
    bf16 = samples_of(local_rows(corpora["bf16"], 0, 1), corpora["bf16"])
    text_values = 0
    for a, b in zip(fp32, bf16):
        assert same_bits(a["latent"], b["latent"]) and same_bits(a["pooled"], b["pooled"])  # only text changes
        rounded = torch.from_numpy(a["text"].copy()).to(torch.bfloat16).float().numpy()
        assert same_bits(b["text"], rounded)
        text_values += a["text"].size
    assert text_values > 0
    assert mean_row_bytes(corpora["bf16"]) < 0.75 * mean_row_bytes(corpora["fp32"])


def test_bf16_values_written_and_read_are_identical(tmp_path: Path) -> None:
    # Every finite bf16 bit pattern that is not a NaN/inf, both signs, zeros and subnormals included.
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = bits[(bits & 0x7F80) != 0x7F80]
    values = bf16_to_fp32(finite)
    assert np.array_equal(bf16_bits(values), finite)  # already bf16: rounding keeps them
    dim = 64
    n_tok = finite.size // dim
    texts = [values[i * dim * 32:(i + 1) * dim * 32].reshape(-1, dim) for i in range(n_tok // 32)]
    k = len(texts)
    cols = {"sample_id": np.arange(k), "kind": ["image"] * k, "source": ["x"] * k, "frames": [1] * k,
            "height": [2] * k, "width": [2] * k, "channels": [1] * k, "visual_tokens": [1] * k,
            "text_tokens": [32] * k, "seq_len": [33] * k}
    writer = ShardWriter(tmp_path, rows_per_shard=k, text_dtype="bf16")
    writer.add(build_table(cols, [np.ones((1, 1, 2, 2), np.float32)] * k, texts, [np.ones(4, np.float32)] * k))
    writer.close()
    table = pa.Table.from_batches(list(__import__("pyarrow.parquet", fromlist=["x"]).ParquetFile(
        writer.paths[0]).iter_batches()))
    read = [decode_row(r, text_dim=dim, pooled_dim=4)["text"] for r in arrow_rows(table.to_batches()[0])]
    for want, got in zip(texts, read):
        assert same_bits(want, got)


def test_fp32_to_bf16_rounding_equals_torchs() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 100_000),
        bf16_to_fp32(np.array([0x3F80, 0x3F81], np.uint16)).mean(keepdims=True),  # a tie: to even
        np.array([0.0, -0.0, 1e-45, -1e-45, 3.3895e38, np.finfo(np.float32).max, np.inf, -np.inf], np.float32),
    ]).astype(np.float32)
    torch_bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(x), torch_bits)
    column = with_text_dtype(build_table(
        {"sample_id": [0], "kind": ["image"], "source": ["x"], "frames": [1], "height": [2], "width": [2],
         "channels": [1], "visual_tokens": [1], "text_tokens": [x.size], "seq_len": [x.size + 1]},
        [np.zeros((1, 1, 2, 2), np.float32)], [x.reshape(-1, 1)], [np.zeros(1, np.float32)]), "bf16").column("text")
    assert np.array_equal(np.frombuffer(column.chunk(0).buffers()[2], np.uint16)[:x.size], torch_bits)


def test_bad_bf16_rows_are_corrupt_samples(corpora: dict[str, Path]) -> None:
    row = read_corpus(corpora["bf16"]).slice(0, 1).to_pylist()[0]
    assert isinstance(row["text"], bytes)
    assert decode_row(row, text_dim=32, pooled_dim=16)["text"].dtype == np.float32
    with pytest.raises(CorruptSample) as e:
        decode_row({**row, "text": row["text"] + b"x"}, text_dim=32, pooled_dim=16)
    assert e.value.reason == "text_size"
    if row["text"]:
        nan = bytearray(row["text"])
        nan[0:2] = np.array([0x7FC0], np.uint16).tobytes()
        with pytest.raises(CorruptSample) as e:
            decode_row({**row, "text": bytes(nan)}, text_dim=32, pooled_dim=16)
        assert e.value.reason == "non_finite"


def test_schema_text_dtype_is_checked_and_defaults_to_fp32(corpora: dict[str, Path], tmp_path: Path) -> None:
    doc = json.loads((corpora["fp32"] / "schema.json").read_text())
    assert schema_doc_problem(doc) is None
    del doc["text_dtype"]  # a corpus written before the field
    assert schema_doc_problem(doc) is None
    (tmp_path / "schema.json").write_text(json.dumps(doc))
    assert corpus_info(tmp_path).text_dtype == "fp32"
    problem = schema_doc_problem({**doc, "text_dtype": "fp16"})
    assert problem == "text_dtype is a str, not one of fp32, bf16"  # by kind, never by content (issue 43)


def test_shuffle_buffer_is_sized_in_bytes_and_bounded() -> None:
    flux_row = (16 * 128 * 128 + 512 * 4096) * 4  # a 1024² latent and 512 fp32 T5-XXL tokens: 9 MiB
    assert shuffle_rows(256, flux_row) == 28
    assert shuffle_rows(256, 4 << 20) == 64  # the issue's ~4 MB mean row: 256 MiB, not ~1 GB
    assert shuffle_rows(256, 1000) == SHUFFLE_ROWS_MAX == 256  # small rows: as before
    assert shuffle_rows(1, 1 << 30) == 1 and shuffle_rows(0, 1000) == 0
    with pytest.raises(ValueError, match=">= 0 MiB"):
        shuffle_rows(-1, 10)


def test_shuffle_buffer_mb_past_its_bound_is_one_config_error() -> None:
    from knapray.limits import MAX_SHUFFLE_BUFFER_MB
    from knapray.config.run import ConfigError, TrainConfig, config_from_dict

    data = TrainConfig().to_dict()
    assert data["data"]["shuffle_buffer_mb"] == 256
    data["data"]["shuffle_buffer_mb"] = MAX_SHUFFLE_BUFFER_MB + 1
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).count("\n") == 0 and "data.shuffle_buffer_mb" in str(e.value) and "65536" in str(e.value)


def test_synthetic_cli_and_ingest_take_text_dtype(tmp_path: Path) -> None:
    from knapray.commands import ingest, synthetic

    assert synthetic.build_parser().parse_args(["--mix", "g1b1i256f1s0", "--out", "x", "--text-dtype",
                                                "bf16"]).text_dtype == "bf16"
    parser = ingest.build_parser()
    assert parser.parse_args(["--input", "a", "--out", "b", "--text-dtype", "bf16"]).text_dtype == "bf16"
    assert parser.parse_args(["--input", "a", "--out", "b"]).text_dtype == "fp32"
    with pytest.raises(ValueError, match="text_dtype"):
        ingest.IngestConfig(text_dtype="fp16")
    with pytest.raises(ValueError, match="text_dtype"):
        SyntheticConfig(**CORPUS, text_dtype="fp8")
