"""Calibration: the packed-batch fit and its per-sequence decision, the batches it times, a
real CPU calibration of a tiny model, the profile's mode, validation against a wrong profile."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from knapray.cli import main
from knapray.planning.costs.cost import MODE_KEYS, PROFILE_FORMAT, CostModel, check_mode
from knapray.planning.fitting.costfit import (
    CALIBRATION_MIXES,
    batch_features,
    calibration_batches,
    fit_packed,
    scaled_codes,
    validation_batches,
)

BATCHES = [lens for _, lens in calibration_batches([1024, 2048, 4096], 64, seed=0)]


def _synthetic(c, a, b, s, layers, noise=0.0, counts="sequences", seed=0):
    x = batch_features(BATCHES, counts)
    t = c + layers * (a * x[:, 0] + b * x[:, 1] + s * x[:, 2])
    return t * (1 + noise * np.random.default_rng(seed).standard_normal(t.size))


def test_fit_recovers_known_coefficients_with_a_per_sequence_term():
    c, a, b, s, layers = 3e-3, 2e-5, 3e-8, 4e-4, 2
    f = fit_packed(BATCHES, _synthetic(c, a, b, s, layers), layers)
    assert f.per_sequence_term
    assert f.coefficients == pytest.approx([c, a, b, s], rel=1e-6)
    assert f.mape < 1e-9 and f.cv_mape_with_seq < 1e-9 < f.cv_mape_without_seq
    assert f.predict(BATCHES) == pytest.approx(f.predicted_s)
    # The CostModel it sets predicts the same batches: the fixed cost once per batch.
    cost = CostModel(double_blocks=1, single_blocks=1, **f.cost_fields())
    assert [cost.batch_time(lens) for lens in BATCHES] == pytest.approx(f.predicted_s, rel=1e-9)
    assert cost.fixed_s == pytest.approx(c)
    # Marginal cost of a sequence: no share of the fixed cost.
    assert float(cost.compute(100)) == pytest.approx(layers * (s + a * 100 + b * 100**2))


def test_fit_counts_distinct_lengths_when_told():
    c, a, b, s, layers = 1e-3, 2e-5, 3e-8, 4e-4, 2
    t = _synthetic(c, a, b, s, layers, counts="lengths")
    f = fit_packed(BATCHES, t, layers, seq_counts="lengths")
    assert f.per_sequence_term and f.coefficients == pytest.approx([c, a, b, s], rel=1e-6)
    cost = CostModel(double_blocks=1, single_blocks=1, **f.cost_fields())
    assert cost.seq_s_counts == "lengths"
    assert [cost.batch_time(lens) for lens in BATCHES] == pytest.approx(t, rel=1e-9)
    # Counted per sequence, the same data need no such term exactly.
    assert fit_packed(BATCHES, t, layers).mape > 1e-3


def test_cross_validation_drops_a_term_the_data_do_not_show():
    layers = 2
    # 2% noise, no per-sequence cost: the held-out error does not improve with the term.
    f = fit_packed(BATCHES, _synthetic(2e-3, 2e-5, 3e-8, 0.0, layers, noise=0.02), layers)
    assert not f.per_sequence_term and f.seq_s == 0.0
    assert f.cv_mape == f.cv_mape_without_seq
    # A per-sequence cost of ~10% of a short batch shows through the same noise.
    f = fit_packed(BATCHES, _synthetic(2e-3, 2e-5, 3e-8, 2e-4, layers, noise=0.02), layers)
    assert f.per_sequence_term and f.seq_s == pytest.approx(2e-4, rel=0.3)
    # Forced either way.
    assert fit_packed(BATCHES, _synthetic(2e-3, 2e-5, 3e-8, 0.0, layers), layers, per_sequence=True).per_sequence_term
    assert fit_packed(BATCHES, _synthetic(2e-3, 2e-5, 3e-8, 2e-4, layers), layers, per_sequence=False).seq_s == 0


def test_fit_keeps_coefficients_non_negative_and_checks_input():
    # Purely per-token data with noise that would pull the other terms negative.
    x = batch_features(BATCHES)
    t = 1e-5 * x[:, 0] * (1 + 0.03 * np.sin(np.arange(len(BATCHES))))
    f = fit_packed(BATCHES, t, 1)
    assert min(f.coefficients) >= 0
    with pytest.raises(ValueError, match="need >= 5 timed batches"):
        fit_packed(BATCHES[:4], t[:4], 1)
    with pytest.raises(ValueError, match="got 18 batches but 17 timings"):
        fit_packed(BATCHES, t[:-1], 1)
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        fit_packed(BATCHES, t, 0)
    with pytest.raises(ValueError, match="non-empty list of integer lengths"):
        batch_features([[3, 0]])


def test_calibration_and_validation_batches():
    named = calibration_batches([512, 1024], 32, longest=300, seed=1)
    assert [n for n, _ in named] == [f"{m}@{b}" for b in (512, 1024) for m in CALIBRATION_MIXES]
    for name, lens in named:
        budget = int(name.split("@")[1])
        assert sum(lens) == budget and max(lens) <= 300 and min(lens) >= 16
    short = dict(named)["short@1024"]
    assert len(set(short)) >= len(short) - 1  # jittered: no two equal but the remainder
    assert set(dict(named)["same@1024"][:-1]) == {32}
    with pytest.raises(ValueError, match="budgets >= 4 x short"):
        calibration_batches([100], 32)
    assert [c.resolution for c in scaled_codes("image+video", 4)][:2] == [64, 128]
    # Held-out batches: balanced ranks of the paper mixes, near the target by the model.
    cost = CostModel(d_model=128, double_blocks=1, single_blocks=1, linear_s=3e-5, attn_s=3e-8, seq_s=3e-4)
    held = validation_batches(cost, ["low-res", "image+video"], scale=4, target_s=0.15, per_mix=3)
    assert len(held) == 6 and all(name.split("#")[0] in ("low-res", "image+video") for name, _ in held)
    times = [cost.batch_time(lens) for _, lens in held]
    assert 0.05 < min(times) and max(times) < 1.0


def test_mode_check():
    recorded = {"device": "cuda", "dtype": "bfloat16", "compile": True, "ac": True,
                "attention_backend": "flash", "device_name": "NVIDIA H100", "torch": "2.13.0"}
    assert set(recorded) == set(MODE_KEYS)
    assert check_mode(recorded, {"device": "cuda", "compile": True}) == []
    problems = check_mode(recorded, {"compile": False, "ac": True, "torch": "2.14.0"})
    assert problems == ["compile is True in the profile but False in the run",
                        "torch is '2.13.0' in the profile but '2.14.0' in the run (warning)"]
    with pytest.raises(ValueError, match=r"unknown execution-mode keys \['speed'\]"):
        check_mode(recorded, {"speed": 1})


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """A real calibration of a tiny model on CPU (seconds, not minutes)."""
    out = tmp_path_factory.mktemp("cal") / "profile.json"
    rc = main(["calibrate", "--hidden", "32", "--heads", "2", "--budgets", "128,256,512", "--short", "16",
               "--repeats", "2", "--device", "cpu", "--out", str(out), "--max-error", "1.0"])
    assert rc == 0
    return out


def test_profile_records_mode_and_round_trips(tiny_profile):
    profile = json.loads(tiny_profile.read_text())
    assert profile["format"] == PROFILE_FORMAT
    mode = profile["mode"]
    assert set(mode) == set(MODE_KEYS)
    assert mode["device"] == "cpu" and mode["dtype"] == "float32" and mode["attention_backend"] == "sdpa"
    assert mode["compile"] is False and mode["ac"] is False
    assert len(profile["batches"]) == 3 * len(CALIBRATION_MIXES) == len(profile["seconds"])
    assert profile["command"].startswith("knapray calibrate --hidden 32 --heads 2")
    # Eager without activation checkpointing: 8 Ulysses all-to-alls per layer, no recompute.
    cm = profile["cost_model"]
    assert cm["ulysses_a2a_per_layer"] == 8 and cm["recompute_passes"] == 0.0 and cm["seq_s_counts"] == "lengths"
    run_mode = {k: mode[k] for k in ("device", "dtype", "compile", "ac", "attention_backend")}
    cost = CostModel.from_profile(str(tiny_profile), run_mode=run_mode)
    assert cost.d_model == 32 and cost.layers == 2 and cost.num_heads == 2
    predicted = [cost.batch_time(b["lengths"]) for b in profile["batches"]]
    np.testing.assert_allclose(predicted, profile["fit"]["fit_seconds"], rtol=1e-9)
    # A run in another mode is refused, naming the difference; or only warned about.
    with pytest.raises(ValueError, match="compile is False in the profile but True in the run"):
        CostModel.from_profile(str(tiny_profile), run_mode={**run_mode, "compile": True})
    with pytest.warns(UserWarning, match="ac is False in the profile but True in the run"):
        CostModel.from_profile(str(tiny_profile), run_mode={"ac": True}, allow_mode_mismatch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CostModel.from_profile(str(tiny_profile))  # no run mode: nothing to check


def test_validate_fails_on_a_wrong_profile(tiny_profile, tmp_path, capsys):
    args = ["--validate-scale", "8", "--validate-target-s", "0.02", "--per-mix", "2", "--repeats", "2", "--json"]
    assert main(["calibrate", "--validate", str(tiny_profile), "--max-error", "1.0", *args]) == 0
    good = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(good["batches"]) == 6 and good["mean_abs_error"] < 0.5
    # The load factor comes from the profile's own batches of its middle budget, re-timed.
    assert good["anchors"] == [f"{m}@256" for m in CALIBRATION_MIXES] and 0.3 < good["load_factor"] < 3
    for b in good["batches"]:
        assert b["error"] == pytest.approx((b["predicted_s"] - b["measured_s"]) / b["measured_s"])
    # Every cost tripled (the timings kept): every prediction far too high, exit 1.
    profile = json.loads(tiny_profile.read_text())
    for key in ("linear_s", "attn_s", "seq_s", "layer_overhead_s"):
        profile["cost_model"][key] *= 3
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(profile))
    assert main(["calibrate", "--validate", str(wrong), *args]) == 1
    bad = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert bad["mean_abs_error"] > 0.5 and all(b["error"] > 0 for b in bad["batches"])
    # A profile without a mode (the old single-sequence format) is refused by name.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "knapray-cost-profile/1", "cost_model": {}}))
    assert main(["calibrate", "--validate", str(old)]) == 2
    assert "not a packed-batch profile" in capsys.readouterr().err


def test_calibration_checkpoints_and_compiles_through_the_trainers_parallelize():
    """The profile's mode is the trainer's: ``parallelize`` wraps the blocks (parameter names
    unchanged, the blocks the checkpointing rule picks), not a calibration-only wrapper."""
    from knapray.commands.calibrate import _Bench
    from knapray.models import MMDiT

    dims = {"hidden_size": 32, "num_heads": 2, "depth_double": 1, "depth_single": 2}
    bench = _Bench(dims, "cpu", None, compile=False, ac=True)
    plain = MMDiT(bench.cfg)
    assert [n for n, _ in bench.model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    blocks = [*bench.model.double_blocks, *bench.model.single_blocks]
    assert all(hasattr(b.forward, "__wrapped__") for b in blocks)  # parallelize's checkpoint
    assert bench.mode["ac"] is True
    bench.step_fn([24, 40], seed=0)()  # forward + backward run through the wrapped blocks


def test_wan_calibration_prices_cross_attention_in_its_fit(tmp_path):
    """``--family wan`` times Wan blocks (each sequence 1/8 text: its cross-attention keys
    and the padding key) and records a cross-attention profile whose fitted terms already
    hold the cross-attention: ``text_tokens`` 0, so a Wan run's planner (attention_kind
    cross, from its config) predicts exactly the fit, with no analytic cross term on top."""
    from knapray.coordinator.config import CoordinatorConfig, make_planning_model

    out = tmp_path / "wan.json"
    assert main(["calibrate", "--family", "wan", "--hidden", "32", "--heads", "2", "--budgets", "128,256,512",
                 "--short", "16", "--repeats", "2", "--device", "cpu", "--out", str(out), "--max-error", "1.0"]) == 0
    profile = json.loads(out.read_text())
    cm = profile["cost_model"]
    assert profile["model"]["family"] == "wan" and profile["command"].startswith("knapray calibrate --family wan")
    assert (cm["attention_kind"], cm["text_tokens"], cm["double_blocks"], cm["single_blocks"]) == ("cross", 0, 0, 2)
    assert cm["ulysses_a2a_per_layer"] == 12 and cm["seq_s_counts"] == "sequences"
    planner = make_planning_model(CoordinatorConfig.from_kwargs(planner="cost", cost_profile=str(out),
                                                                attention_kind="cross", d_model=32))
    predicted = [planner.batch_time(b["lengths"]) for b in profile["batches"]]
    np.testing.assert_allclose(predicted, profile["fit"]["fit_seconds"], rtol=1e-9)
    assert main(["calibrate", "--family", "flux"]) == 2  # flux's blocks are MMDiT's: one line, exit 2


@pytest.mark.parametrize("mode", ["every_k", "selective"])
def test_calibrate_refuses_checkpointing_a_profile_cannot_record(mode, capsys):
    """A profile records checkpointing as on (full) or off: the other modes are one line, exit 2."""
    assert main(["calibrate", "--ac", mode]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--ac {mode}" in err[0] and "--ac full or --ac none" in err[0]
