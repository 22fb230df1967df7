"""``knapray train --check`` (and ``jobs/train.py --check``, the torchrun launcher's
``--check``): every pre-flight check, nothing started. Every shipped config passes against
a small corpus of the widths it expects; a bad input is one line naming the value, exit
code 2, no traceback, and Ray is never started."""

from __future__ import annotations

import json
import pathlib
import runpy
import sys

import pytest
import yaml

from knapray.cli import main
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
from knapray.driver.run_dir import RunLock

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "jobs" / "configs").glob("*.yaml"))
DEFAULT_WIDTHS = {"in_channels": 4, "text_dim": 16, "pooled_dim": 16}
"""Widths of the corpus for a config that leaves them to the corpus."""


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A check that started Ray would fail here instead of starting it."""
    ray = pytest.importorskip("ray")

    def refuse(*args, **kwargs):
        raise AssertionError("pre-flight started Ray")

    monkeypatch.setattr(ray, "init", refuse)


def _corpus(path: pathlib.Path, widths: dict[str, int]) -> str:
    if not (path / "schema.json").exists():
        build_synthetic(SyntheticConfig(mix="g2b2i128f1s0,g1b1i64f2s1", steps=2, scale=4,
                                        channels=widths["in_channels"], text_dim=widths["text_dim"],
                                        pooled_dim=widths["pooled_dim"], max_text_tokens=16, shards=2),
                        path, progress=False)
    return str(path)


def _run(argv: list[str], capsys) -> tuple[int, list[str], list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits itself
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


@pytest.fixture(scope="module")
def demo_corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("corpus"), DEFAULT_WIDTHS)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_passes_its_check(config, tmp_path, capsys, monkeypatch):
    """Against a corpus of the widths the config pins (the corpus's own otherwise).
    ``flux_cluster.yaml`` (elastic 16..64 GPUs, hybrid FSDP in nodes of 8) passes once the
    elastic range is sized in whole nodes (issue 17's Ray-runtime half). A GPU config is
    checked as on a machine with a GPU per worker (here, without one, its workers could
    never be placed: ``tests/unit/test_placement.py``)."""
    from knapray.driver import placement

    scaling = yaml.safe_load(config.read_text()).get("scaling") or {}
    monkeypatch.setattr(placement, "local_gpus", lambda: scaling.get("num_workers", 4) if scaling.get("use_gpu") else 0)
    pinned = (yaml.safe_load(config.read_text()).get("model") or {})
    no_pooled = pinned.get("family") in ("wan", "qwen_image", "flux2")  # umT5; Qwen2.5-VL; Mistral Small 3.1
    defaults = {**DEFAULT_WIDTHS, "pooled_dim": 0} if no_pooled else DEFAULT_WIDTHS
    widths = {k: pinned.get(k, v) for k, v in defaults.items()}
    corpus = _corpus(tmp_path / "corpus", widths)
    pretrained = []
    if pinned.get("pretrained"):  # the real checkpoint's config and headers at full size
        pytest.importorskip("diffusers")
        from flux_utils import save_flux2_headers, save_flux_headers, save_qwen_image_headers, save_wan_headers

        save = {"wan": save_wan_headers, "qwen_image": save_qwen_image_headers,
                "flux2": save_flux2_headers}.get(pinned.get("family"), save_flux_headers)
        path = save(tmp_path / "pipeline" / "transformer")
        boundary = (yaml.safe_load(config.read_text()).get("flow") or {}).get("expert_boundary")
        if boundary:  # two experts: a pipeline folder of both, as Wan2.2-T2V-A14B-Diffusers holds them
            save(tmp_path / "pipeline" / "transformer_2")
            (tmp_path / "pipeline" / "model_index.json").write_text(json.dumps({"boundary_ratio": boundary}))
            path = tmp_path / "pipeline"
        pretrained = ["--set", f"model.pretrained={path}"]
    code, out, err = _run(["train", "--config", str(config), "--set", f"data.corpus={corpus}",
                           "--set", f"run.storage={tmp_path / 'runs'}", *pretrained, "--check"], capsys)
    assert code == 0, err
    text = "\n".join(out)
    assert "pre-flight passed" in text and corpus in text and "would start run" in text, text
    assert not (tmp_path / "runs").exists()  # a check writes nothing


def test_check_reports_what_it_checked_and_starts_nothing(demo_corpus, tmp_path, capsys, monkeypatch):
    base = ["--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={demo_corpus}",
            "--set", f"run.storage={tmp_path}", "--set", "run.name=r", "--check"]
    code, out, err = _run(["train", *base, "--set", "scaling.min_workers=2", "--set", "balance.topology=bags_of:2"],
                          capsys)
    assert code == 0, err
    assert any("2..4 (3 sizes: elastic" in line for line in out), out
    assert any("text_dim 16, pooled_dim 16" in line for line in out), out  # the corpus's widths
    # The same through jobs/train.py (the ray job submit entrypoint) and the torchrun launcher.
    monkeypatch.setattr(sys, "argv", ["jobs/train.py", *base])
    # (its process ends by os._exit once its work is out: here, as sys.exit, in this one)
    monkeypatch.setattr("knapray.stopping.exit_now", sys.exit)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "jobs" / "train.py"), run_name="__main__")
    assert e.value.code == 0 and "pre-flight passed" in capsys.readouterr().out
    from knapray.commands.torchrun import main as torchrun_main

    assert torchrun_main(base[:-1] + ["--set", "balance.topology=g1n1", "--check"]) == 0
    assert "world sizes: 1" in capsys.readouterr().out
    # A resumable run directory is reported as such, and a live run's lock is refused.
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    with RunLock(str(run_dir)):
        code, _, err = _run(["train", *base], capsys)
    assert code == 2 and len(err) == 1 and "in use by a live run" in err[0], err
    assert not any(run_dir.iterdir())


BAD = [
    (["--set", "run.num_workerz=4"], ["num_workerz", "valid keys"]),
    (["--set", "data.corpus=/nonexistent/corpus"], ["/nonexistent/corpus", "no corpus there"]),
    (["--set", "model.text_dim=4096"], ["text_dim=16", "text_dim=4096"]),
    (["--set", "scaling.num_workers=3"], ["g1n2+g2n1", "3"]),
    (["--set", "scaling.min_workers=3", "--set", "balance.topology=bags_of:2", "--set", "data.global_batch=8"],
     ["global_batch=8", "3 ranks"]),
    (["--set", "checkpoint.resume=never", "--set", "run.name=exists"], ["already exists", "checkpoint.resume=never"]),
]


@pytest.mark.parametrize("extra, names", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_a_bad_input_is_one_line_and_exit_2(extra, names, demo_corpus, tmp_path, capsys):
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "config.json").write_text("{}")
    code, out, err = _run(["train", "--config", str(REPO / "jobs/configs/demo.yaml"),
                           "--set", f"data.corpus={demo_corpus}", "--set", f"run.storage={tmp_path}", *extra,
                           "--check"], capsys)
    assert code == 2 and not out
    assert len(err) == 1 and err[0].startswith("knapray train: error:"), err
    for name in names:
        assert name in err[0], (name, err[0])


def test_a_mostly_unreadable_corpus_is_refused_by_name(tmp_path, capsys):
    corpus = pathlib.Path(_corpus(tmp_path / "corpus", DEFAULT_WIDTHS))
    shards = json.loads((corpus / "schema.json").read_text())["shards"]
    for name in shards:
        (corpus / name).write_bytes(b"not parquet")
    code, _, err = _run(["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={corpus}",
                         "--set", f"run.storage={tmp_path}", "--check"], capsys)
    assert code == 2 and len(err) == 1 and "unreadable shard" in err[0] and shards[0] in err[0], err


def test_pre_flight_reads_each_file_once(demo_corpus, tmp_path, monkeypatch):
    """schema.json once (the model's widths and the corpus check share it), each shard's
    footer once."""
    import pyarrow.parquet as pq

    import knapray.driver.preflight as preflight

    reads = {"schema": 0, "footer": 0}
    read_schema, parquet_file = preflight.read_schema_json, pq.ParquetFile

    def count_schema(path):
        reads["schema"] += 1
        return read_schema(path)

    def count_footer(*args, **kwargs):
        reads["footer"] += 1
        return parquet_file(*args, **kwargs)

    monkeypatch.setattr(preflight, "read_schema_json", count_schema)
    monkeypatch.setattr(pq, "ParquetFile", count_footer)
    pre = preflight.check_file(str(REPO / "jobs/configs/demo.yaml"),
                               [f"data.corpus={demo_corpus}", f"run.storage={tmp_path}"])
    assert reads == {"schema": 1, "footer": len(pre.corpus.good_shards)} == {"schema": 1, "footer": 2}
    assert pre.cfg.model.text_dim == 16  # from that one read


def test_train_check_passes_each_step_once(demo_corpus, tmp_path, monkeypatch, capsys):
    """``knapray train --check``, from the command line to the run directory's decision:
    the paths resolved once, the corpus checked once, the run directory decided once."""
    import knapray.driver.preflight as preflight
    import knapray.driver.run_dir as run_dir

    calls = {"resolve_paths": 0, "check_corpus": 0, "decide_start": 0}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
        monkeypatch.setattr(preflight, name, wrapper, raising=False)

    counted(run_dir, "resolve_paths")
    counted(run_dir, "decide_start")
    counted(preflight, "check_corpus")
    code, out, err = _run(["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set",
                           f"data.corpus={demo_corpus}", "--set", f"run.storage={tmp_path}", "--check"], capsys)
    assert code == 0, err
    assert calls == {"resolve_paths": 1, "check_corpus": 1, "decide_start": 1}


def test_loading_a_config_reads_only_its_yaml(demo_corpus, tmp_path, monkeypatch):
    """load_config: the YAML file and nothing else (schema apart from I/O); the run's loader
    (pre-flight, both launchers, the tools that build a run's model) fills the widths the
    config leaves out from the corpus."""
    import builtins

    from knapray.config.run import load_config
    from knapray.driver.preflight import load_run_config

    opened = []
    real_open = builtins.open

    def traced(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", traced)
    config = str(REPO / "jobs/configs/demo.yaml")
    sets = [f"data.corpus={demo_corpus}", f"run.storage={tmp_path}"]
    plain = load_config(config, sets)
    assert opened == [config]
    assert plain.model.text_dim != 16  # the default: the corpus was not read
    opened.clear()
    run = load_run_config(config, sets)
    assert run.model.text_dim == 16 and any(p.endswith("schema.json") for p in opened)


# ---- pre-flight passes nothing training then refuses (issue 29) ----------------------------


def _rewrite_shard(corpus: str, change) -> None:
    import pyarrow.parquet as pq

    from knapray.corpus import shard_paths

    for shard in shard_paths(corpus):
        pq.write_table(change(pq.read_table(shard)), shard)


@pytest.mark.parametrize("damage, needle", [
    (lambda t: t.drop_columns(["pooled"]), "columns ['pooled'] missing"),
    # the text stored as fp32 lists while schema.json says bf16 (the type the reader decodes)
    ("bf16", "text is list<element: float>"),
    (lambda t: t.set_column(t.schema.get_field_index("frames"), "frames",
                            t.column("frames").cast("int64")), "frames is int64, not int32"),
])
def test_a_shard_whose_columns_training_cannot_read_is_refused(tmp_path, capsys, damage, needle):
    corpus = _corpus(tmp_path / "corpus", DEFAULT_WIDTHS)
    if damage == "bf16":
        doc = json.loads((tmp_path / "corpus" / "schema.json").read_text())
        doc["text_dtype"] = "bf16"
        (tmp_path / "corpus" / "schema.json").write_text(json.dumps(doc))
    else:
        _rewrite_shard(corpus, damage)
    code, out, err = _run(["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={corpus}",
                           "--set", f"run.storage={tmp_path / 'runs'}", "--check"], capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_a_corpus_mostly_longer_than_the_token_budget_is_refused(tmp_path, capsys, demo_corpus):
    base = ["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={demo_corpus}",
            "--set", f"run.storage={tmp_path / 'runs'}", "--check"]
    code, out, err = _run([*base, "--set", "data.max_tokens_per_gpu=1"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "data.max_tokens_per_gpu=1:" in err[0] and "longer than 4 tokens (the budget times the largest bag, 4 GPUs" in err[0], err
    code, out, err = _run([*base, "--set", "data.max_tokens_per_gpu=100000"], capsys)
    assert code == 0, err


def test_a_cap_by_max_steps_before_the_epochs_are_done_is_said(tmp_path, capsys, demo_corpus):
    """--set data.epochs=2 on a config whose run.max_steps ends the first epoch: said at the
    check (and by the launchers when the run starts and ends: report.stopped_early_line)."""
    from knapray.config.run import load_config
    from knapray.driver.report import run_length_note, stopped_early_line

    base = ["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={demo_corpus}",
            "--set", f"run.storage={tmp_path / 'runs'}", "--set", "data.epochs=2", "--check"]
    code, out, err = _run([*base, "--set", "run.max_steps=1"], capsys)
    assert code == 0, err
    note = [line for line in out if "note: run.max_steps=1 ends the run before data.epochs=2 are done" in line]
    assert len(note) == 1 and "set run.max_steps=0" in note[0], out
    code, out, err = _run([*base, "--set", "run.max_steps=0"], capsys)
    assert code == 0 and not any("note:" in line for line in out), out
    cfg = load_config(None, ["run.max_steps=24", "data.epochs=2", "scaling.num_workers=4", "data.samples_per_step=2"])
    assert run_length_note(cfg, 178) .startswith("run.max_steps=24 ends the run before data.epochs=2 are done: an "
                                               "epoch of 178 samples is about 23 steps")
    assert stopped_early_line(cfg, {"epoch": 1}) == ("stopped by run.max_steps=24 in epoch 2 of data.epochs=2; set "
                                                     "run.max_steps=0 (or higher) and run it again to train the rest")
    assert stopped_early_line(cfg, {"epoch": 2}) is None and run_length_note(cfg, 80) is None
    # 10 samples: 2 steps an epoch, 4 in all, far short of run.max_steps=24 (issue 43)
    assert run_length_note(cfg, 10).startswith("data.epochs=2 ends the run after about 4 steps, far short of "
                                               "run.max_steps=24")


# ---- a pipeline folder of two experts (Wan 2.2 A14B's transformer/ and transformer_2/) ------


TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=48, num_layers=1)


def _pipeline(path: pathlib.Path, second: dict, *, boundary_ratio: float | None = 0.875,
              second_config: dict | None = None) -> pathlib.Path:
    """A pipeline folder: a tiny Wan as transformer/, ``second`` as transformer_2/ (its
    config.json replaced by ``second_config``'s when given), and model_index.json."""
    from diffusers import WanTransformer3DModel

    WanTransformer3DModel(**TINY_WAN).save_pretrained(path / "transformer")
    WanTransformer3DModel(**second).save_pretrained(path / "transformer_2")
    if second_config is not None:
        WanTransformer3DModel(**second_config).save_config(path / "transformer_2")
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"]}
    (path / "model_index.json").write_text(json.dumps(
        {**index, **({"boundary_ratio": boundary_ratio} if boundary_ratio is not None else {})}))
    return path


@pytest.fixture(scope="module")
def wan_corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("wan-corpus"), {"in_channels": 4, "text_dim": 16, "pooled_dim": 0})


def _check_experts(pipeline: pathlib.Path, corpus: str, tmp_path, capsys, *extra: str):
    config = tmp_path / "wan22.yaml"
    config.write_text(yaml.safe_dump({"model": {"family": "wan", "pretrained": str(pipeline)},
                                      "data": {"corpus": corpus}, "run": {"storage": str(tmp_path / "runs")}}))
    return _run(["train", "--config", str(config), *extra, "--check"], capsys)


def test_a_pipeline_of_two_experts_trains_both_only_with_a_boundary(wan_corpus, tmp_path, capsys):
    """Without flow.expert_boundary a pipeline folder holding transformer_2/ is refused in one
    line naming its model_index.json's boundary_ratio (or the setting, where it has none)
    and the two ways on; with it, the pair passes."""
    pytest.importorskip("diffusers")
    pipeline = _pipeline(tmp_path / "pipe", TINY_WAN)
    code, out, err = _check_experts(pipeline, wan_corpus, tmp_path, capsys)
    assert code == 2 and not out and len(err) == 1, err
    assert err[0] == (f"knapray train: error: model.pretrained: {pipeline} is a pipeline of two experts (transformer/ "
                      "and transformer_2/): set flow.expert_boundary=0.875 (its model_index.json's boundary_ratio) to "
                      f"train both in one run, or point model.pretrained at {pipeline}/transformer or "
                      f"{pipeline}/transformer_2 to train one"), err
    code, out, err = _check_experts(pipeline, wan_corpus, tmp_path, capsys, "--set", "flow.expert_boundary=0.875")
    assert code == 0 and "pre-flight passed" in "\n".join(out), err
    code, out, err = _check_experts(pipeline / "transformer_2", wan_corpus, tmp_path, capsys)  # one expert alone
    assert code == 0, err
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    code, out, err = _check_experts(pipeline, wan_corpus, tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert "set flow.expert_boundary (where they switch: Wan 2.2 T2V A14B's is 0.875) to train both" in err[0], err


@pytest.mark.parametrize("second, second_config, difference", [
    (dict(TINY_WAN, num_layers=2), None, "config num_layers: 1 in transformer/, 2 in transformer_2/"),
    (dict(TINY_WAN, num_layers=2), TINY_WAN,  # the config of transformer/, the tensors of two blocks
     "tensor 'blocks.1.attn1.norm_k.weight': absent in transformer/, [32] in transformer_2/"),
], ids=["config", "tensors"])
def test_two_experts_of_other_architectures_are_refused_by_their_first_difference(
        second, second_config, difference, wan_corpus, tmp_path, capsys):
    pytest.importorskip("diffusers")
    pipeline = _pipeline(tmp_path / "pipe", second, second_config=second_config)
    code, out, err = _check_experts(pipeline, wan_corpus, tmp_path, capsys, "--set", "flow.expert_boundary=0.875")
    assert code == 2 and not out and len(err) == 1, err
    assert err[0] == (f"knapray train: error: model.pretrained: {pipeline}: transformer_2/ is not the architecture of "
                      f"transformer/ ({difference}); the two experts of one run are one model built twice"), err
