"""The run config: YAML reading, a type and range check for every field, one-line errors,
and the training job's exit on a bad config."""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import subprocess
import sys

import pytest

from knapray.config.run import ConfigError, TrainConfig, config_from_dict, load_config, read_yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "jobs", "configs", "*.yaml")))


def _error(*overrides: str, path: str | None = None) -> str:
    """The one-line message load_config raises for ``overrides``."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---- YAML ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("3e-4", 3e-4), ("1E5", 1e5), ("-2.5e-3", -2.5e-3), ("+1e+2", 100.0), ("1.5e3", 1500.0),
        ("0.5", 0.5), ("12", 12), ("'3e-4'", "3e-4"), ("1e", "1e"), ("e5", "e5"),
        ("true", True), ("False", False), ("yes", "yes"), ("no", "no"), ("on", "on"),
        ("", None), ("[1, 2e-1]", [1, 0.2]), ("{a: 1E3}", {"a": 1000.0}),
    ],
)
def test_yaml_reads_exponent_numbers_as_floats_and_only_true_false_as_booleans(text, value) -> None:
    got = read_yaml(text, "test")
    assert got == value and type(got) is type(value)


def test_set_exponent_lr_is_a_float() -> None:
    cfg = load_config(None, ["optim.lr=3e-4"])
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    cfg = load_config(None, ["optim.lr=1", "optim.betas=[0, 9.5e-1]"])  # ints become floats
    assert type(cfg.optim.lr) is float and cfg.optim.betas == (0.0, 0.95)
    assert all(type(b) is float for b in cfg.optim.betas)


def test_python_tags_are_refused(tmp_path) -> None:
    marker = tmp_path / "ran"
    tag = f"!!python/object/apply:os.system ['touch {marker}']"
    path = tmp_path / "evil.yaml"
    path.write_text(f"run:\n  name: {tag}\n")
    message = _error(path=str(path))
    assert message.startswith(f"config file {str(path)!r}: not plain YAML") and "python/object/apply" in message
    assert "line 2" in message
    item = f"run.name={tag}"
    message = _error(item)
    assert message.startswith(f"config override {item!r}: not plain YAML") and "python/object/apply" in message
    assert not marker.exists()


def test_broken_yaml_is_one_line_naming_the_override() -> None:
    assert _error("optim.betas=[0.9, 0.99").startswith("config override 'optim.betas=[0.9, 0.99': not plain YAML")


# ---- ranges ----------------------------------------------------------------------------

# (key, a value out of range, the value on the range's edge, which is valid)
RANGES = [
    ("data.samples_per_step", "0", "1"),
    ("data.epochs", "-1", "1"),  # 0: as many epochs as run.max_steps takes
    ("data.max_tokens_per_gpu", "-1", "0"),
    ("data.max_bad_fraction", "-0.1", "0"),
    ("data.max_bad_fraction", "1.5", "1"),
    ("data.max_bad_fraction", ".nan", "0.5"),
    ("data.seed", "-1", "0"),
    ("balance.gamma", "-1e-3", "0"),
    ("balance.gamma", ".inf", "0"),
    ("balance.gpus_per_node", "-1", "0"),
    ("balance.coordinator_timeout_s", "0", "1e-3"),
    ("optim.lr", "0", "1e-9"),
    ("optim.lr", "-3e-4", "3e-4"),
    ("optim.lr", ".nan", "1"),
    ("optim.weight_decay", "-1e-2", "0"),
    ("optim.betas", "[0.9, 1.0]", "[0, 0.999]"),
    ("optim.betas", "[-0.1, 0.9]", "[0.0, 0.9]"),
    ("optim.betas", "[0.9, .nan]", "[0.9, 0.9]"),
    ("optim.grad_clip", "-1", "0"),
    ("optim.warmup_steps", "-1", "0"),
    ("scaling.num_workers", "0", "1"),
    ("scaling.min_workers", "-1", "0"),
    ("scaling.min_workers", "5", "4"),  # num_workers defaults to 4
    ("scaling.cpus_per_worker", "0", "0.1"),
    ("scaling.elastic_monitor_interval_s", "0", "0.5"),
    ("scaling.elastic_monitor_interval_s", ".inf", "3600"),
    ("run.max_steps", "-1", "0"),
    ("checkpoint.every", "-1", "0"),
    ("run.max_failures", "-2", "-1"),
    ("metrics.log_every", "0", "1"),
    ("distributed.timeout_s", "0", "1"),
    ("model.hidden_size", "0", "4"),
    ("model.mlp_ratio", "0", "0.5"),
    ("model.rope_theta", "-.inf", "100"),
    ("model.patch_size", "[1, 0, 2]", "[1, 1, 1]"),
]


@pytest.mark.parametrize("key, bad, edge", RANGES)
def test_each_range_is_checked_with_the_key_and_value_named(key, bad, edge) -> None:
    extra = ["model.num_heads=1", "model.rope_axes_dim=[0, 0, 4]"] if key == "model.hidden_size" else []
    message = _error(*extra, f"{key}={bad}")
    value = read_yaml(bad, "test")
    assert message.startswith(f"config {key}: expected ")
    assert message.endswith(f", got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        assert "a finite number" in message
    cfg = load_config(None, [*extra, f"{key}={edge}"])
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    want = read_yaml(edge, "test")
    assert got == (tuple(want) if isinstance(want, list) else want)


def test_range_errors_say_what_is_valid() -> None:
    assert _error("optim.lr=3e-4x") == "config optim.lr: expected a number > 0, got '3e-4x' (str)"
    assert _error("run.max_steps=-1") == "config run.max_steps: expected an int in [0, 1000000000], got -1 (int)"
    assert _error("data.samples_per_step=0") == "config data.samples_per_step: expected an int in [1, 65536], got 0 (int)"
    assert _error("optim.betas=[0.9, 1]") == (
        "config optim.betas: expected a list of 2 numbers, each in [0, 1), got [0.9, 1] (list)"
    )
    assert _error("scaling.num_workers=2", "scaling.min_workers=3") == (
        "config scaling.min_workers: expected an int in [0, num_workers=2], got 3 (int)"
    )
    assert _error("optim.lr=.inf") == "config optim.lr: expected a finite number > 0, got inf (float)"


# ---- types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.seed=1.5", "an int"),
        ("data.seed=true", "an int"),  # a bool is no int
        ("data.epochs='3'", "an int"),
        ("distributed.timeout_s=1e3", "an int"),
        ("optim.lr=abc", "a number"),
        ("optim.lr=false", "a number"),
        ("optim.lr=[1]", "a number"),
        ("scaling.use_gpu=yes", "true or false"),
        ("scaling.use_gpu=1", "true or false"),
        ("balance.enabled=on", "true or false"),
        ("model.qk_norm='true'", "true or false"),
        ("data.corpus=5", "a string"),
        ("balance.cost_profile=[a]", "a string"),
        ("run.storage=", "a string"),
        ("optim.betas=[0.9]", "a list of 2 numbers"),
        ("optim.betas=0.9", "a list of 2 numbers"),
        ("optim.betas=[0.9, x]", "a list of 2 numbers"),
        ("model.patch_size=[1, 2, 2.0]", "a list of 3 ints"),
        ("model.patch_size=[1, 2, true]", "a list of 3 ints"),
        ("model.hidden_size=64.0", "an int"),
        ("scaling.resources_per_worker={a: x}", "a mapping of strings to numbers"),
        ("scaling.resources_per_worker={1: 1}", "a mapping of strings to numbers"),
        ("scaling.resources_per_worker=[1]", "a mapping of strings to numbers"),
        ("balance.cost=3", "a mapping"),
        ("balance.solver=1", "one of 'knapray', 'greedy'"),
    ],
)
def test_wrong_types_are_refused_per_annotation(override: str, expected: str) -> None:
    key, text = override.split("=", 1)
    value = read_yaml(text, "test")
    message = _error(override)
    assert message.startswith(f"config {key}: expected {expected}")
    assert message.endswith(f", got {value!r} ({type(value).__name__})")


def test_values_convert_to_their_annotation() -> None:
    cfg = load_config(None, ["model.patch_size=[1, 2, 2]", "scaling.resources_per_worker={slot: 1}",
                             "balance.cost={bw_inter: 4e10}", "scaling.cpus_per_worker=2"])
    assert cfg.model.patch_size == (1, 2, 2)
    assert cfg.scaling.resources_per_worker == {"slot": 1.0} and type(cfg.scaling.resources_per_worker["slot"]) is float
    assert cfg.balance.cost == {"bw_inter": 4e10}
    assert cfg.scaling.cpus_per_worker == 2.0 and type(cfg.scaling.cpus_per_worker) is float


def test_a_section_must_be_a_mapping() -> None:
    assert _error("model=3").startswith("config model: expected a mapping")


# ---- choices and rules -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("balance.solver=foo", "expected one of 'knapray', 'greedy', got 'foo' (str)"),
        ("balance.planner=fast", "expected one of 'workload', 'cost', got 'fast' (str)"),
        ("parallel.precision=fp16", "expected one of 'auto', 'bf16', 'fp32', got 'fp16' (str)"),
        ("balance.topology=g0n2", "'g0n2'"),
        ("balance.topology=g3", "'g3'"),
        ("balance.topology=bags_of:0", "'bags_of:0'"),
        ("balance.topology=bags_of:x", "'bags_of:x'"),
        ("balance.topology=5", "5"),
    ],
)
def test_choices_and_topology_rules(override: str, fragment: str) -> None:
    key = override.split("=", 1)[0]
    message = _error(override)
    assert message.startswith(f"config {key}: ") and fragment in message


@pytest.mark.parametrize("topology", ["auto", "bags_of:8", "g8n4", "g1n16+g4n2+g8n1"])
def test_valid_topologies_load(topology: str) -> None:
    assert load_config(None, [f"balance.topology={topology}"]).balance.topology == topology


@pytest.mark.parametrize("text", ["", "''", ".", "..", "a/b", "/abs", "5", "[a]", "a\\\\b", "-x", "'a b'", "'a:b'"])
def test_run_name_must_be_one_directory_name(text: str) -> None:
    value = read_yaml(text, "test")
    message = _error(f"run.name={text}")
    assert message == (
        "config run.name: expected a directory name of 1 to 128 letters, digits, '.', '_' and '-' that does not start "
        f"with '.' or '-', got {value!r} ({type(value).__name__})"
    )


def test_run_name_accepts_a_plain_name() -> None:
    assert load_config(None, ["run.name=flux-run.2"]).run.name == "flux-run.2"


def test_precision_replaces_bf16() -> None:
    assert TrainConfig().parallel.precision == "auto"
    assert load_config(None, ["parallel.precision=fp32"]).parallel.precision == "fp32"
    message = _error("parallel.bf16=true")
    assert "['bf16']" in message and "'precision'" in message


def test_model_section_keeps_its_own_checks() -> None:
    assert _error("model.num_heads=3") == "config model: hidden_size=64 must be divisible by num_heads=3"
    assert "sums to" in _error("model.rope_axes_dim=[4, 6, 4]")


# ---- keys and overrides ----------------------------------------------------------------


def test_unknown_keys_are_rejected_with_the_valid_ones(tmp_path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("optim:\n  lrr: 0.1\n")
    assert _error(path=str(path)) == (
        "config optim: unknown key(s) ['lrr']; valid keys: "
        "['lr', 'weight_decay', 'betas', 'grad_clip', 'warmup_steps', 'schedule', 'decay_steps', 'min_lr_ratio', "
        "'grad_accum_steps', 'ema_decay', 'ema_warmup']"
    )
    path.write_text("optimizer:\n  lr: 0.1\n")
    assert _error(path=str(path)) == (
        "config: unknown key(s) ['optimizer']; valid keys: ['model', 'data', 'balance', 'optim', 'flow', 'run', "
        "'distributed', 'scaling', 'checkpoint', 'metrics', 'parallel']"
    )
    message = _error("model.hiden_size=8")
    assert message.startswith("config model: unknown key(s) ['hiden_size']; valid keys: [")
    assert "'hidden_size'" in message


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("optim", "expected section.key=value"),
        ("=3", "expected section.key=value"),
        ("optim..lr=3", "expected section.key=value"),
        ("optim.lr.x=1", "optim.lr is a value (a number), not a section"),
        ("run.name.x=1", "run.name is a value (a string), not a section"),
        ("optimizer.lr=1", "unknown key 'optimizer'; valid keys here: ['model', 'data', 'balance', 'optim', 'flow', 'run', 'distributed', 'scaling', 'checkpoint', 'metrics', 'parallel']"),
        ("run.x.y=1", "unknown key 'run.x'; valid keys here: ['name', "),
    ],
)
def test_bad_overrides_name_the_item(item: str, fragment: str) -> None:
    message = _error(item)
    assert message.startswith(f"config override {item!r}: ") and fragment in message


def test_overrides_enter_empty_sections_and_mapping_fields(tmp_path) -> None:
    path = tmp_path / "empty_section.yaml"
    path.write_text("optim:\nbalance:\n  cost: {bw_intra: 1e11}\n")
    cfg = load_config(str(path), ["optim.lr=2e-4", "balance.cost.bw_inter=4e10"])
    assert cfg.optim.lr == 2e-4 and cfg.balance.cost == {"bw_intra": 1e11, "bw_inter": 4e10}
    path.write_text("balance:\n  cost: 3\n")
    assert "balance.cost is not a section here, it holds 3" in _error("balance.cost.x=1", path=str(path))


def test_missing_or_non_mapping_file(tmp_path) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert _error(path=missing) == f"config file {missing} cannot be read (No such file or directory)"
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert _error(path=str(path)) == f"config file {str(path)!r}: expected a mapping of sections, got [1, 2] (list)"


# ---- shipped configs -------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_load_and_round_trip(path: str) -> None:
    cfg = load_config(path)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert cfg.parallel.precision in ("auto", "bf16", "fp32")


def test_shipped_configs_are_there() -> None:
    assert {os.path.basename(p) for p in CONFIGS} >= {"demo.yaml", "flux_cluster.yaml"}
    flux = load_config(os.path.join(REPO, "jobs", "configs", "flux_cluster.yaml"))
    assert flux.parallel.precision == "bf16" and flux.scaling.min_workers == 16 and flux.optim.weight_decay == 0.01


def test_config_from_dict_checks_like_load() -> None:
    data = TrainConfig().to_dict()
    data["optim"]["lr"] = "3e-4"  # a string is not a number outside YAML either
    with pytest.raises(ConfigError, match=r"^config optim\.lr: expected a number > 0, got '3e-4' \(str\)$"):
        config_from_dict(data)


# ---- jobs/train.py ---------------------------------------------------------------------


def _train_job():
    spec = importlib.util.spec_from_file_location("knapray_job_train", os.path.join(REPO, "jobs", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_job_prints_one_error_line_and_returns_2(capsys) -> None:
    main = _train_job().main
    demo = os.path.join(REPO, "jobs", "configs", "demo.yaml")
    assert main(["--config", demo, "--set", "optim.lr=-3e-4"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "knapray train: error: config optim.lr: expected a number > 0, got -0.0003 (float)\n"
    assert main(["--config", os.path.join(REPO, "jobs", "configs", "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("knapray train: error: config file ") and "missing.yaml" in err and err.count("\n") == 1


def test_train_job_exits_2_without_a_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "jobs", "train.py"),
         "--config", os.path.join(REPO, "jobs", "configs", "demo.yaml"), "--set", "run.max_steps=-1"],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "knapray train: error: config run.max_steps: expected an int in [0, 1000000000], got -1 (int)"
    ]


def test_per_step_topology_needs_the_cost_planner_and_whole_nodes():
    from knapray.driver.run_dir import RunError, check_world

    with pytest.raises(ConfigError, match=r"^config balance: topology 'per-step' chooses bags by predicted step "
                                          r"time: it needs planner: cost, got planner 'workload'$"):
        load_config(None, ["balance.topology=per-step"])
    cfg = load_config(None, ["balance.topology=per-step", "balance.planner=cost", "balance.gpus_per_node=4"])
    assert cfg.balance.topology == "per-step"
    check_world(cfg, 8)
    with pytest.raises(RunError, match="world size 6 is not a multiple of gpus_per_node=4"):
        check_world(cfg, 6)


# ---- a key in the wrong section ------------------------------------------------------------

ELSEWHERE = [("run", "timeout_s", "60", "distributed.timeout_s"),
             ("run", "gloo_socket_ifname", "eth0", "distributed.gloo_socket_ifname"),
             ("run", "num_workers", "8", "scaling.num_workers"), ("run", "resume", "never", "checkpoint.resume"),
             ("run", "precision", "bf16", "parallel.precision"), ("parallel", "max_steps", "3", "run.max_steps")]


@pytest.mark.parametrize("section, key, value, place", ELSEWHERE)
def test_a_key_in_the_wrong_section_names_where_it_goes(section, key, value, place, tmp_path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    message = _error(path=str(path))
    assert message.startswith(f"config {section}: unknown key(s) [{key!r}]; valid keys: [")
    assert message.endswith(f"]; did you mean {place}?") and "\n" not in message
    got = getattr(getattr(load_config(None, [f"{place}={value}"]), place.split(".")[0]), key)
    assert got == read_yaml(value, "test")


def test_a_key_no_section_holds_is_the_usual_error() -> None:
    assert _error("run.checkpoint_every=5").startswith(
        "config run: unknown key(s) ['checkpoint_every']; valid keys: ['name', 'storage', 'max_steps', "
        "'max_failures']")
    assert "did you mean" not in _error("run.checkpoint_every=5")
