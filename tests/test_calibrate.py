"""Calibration: the least-squares fit, a real CPU measurement of a tiny model, the profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knapray.calibrate import fit
from knapray.cli import main
from knapray.planning.cost import CostModel


def test_fit_recovers_exact_coefficients():
    lengths = [64, 128, 256, 512, 1024, 2048]
    c, a, b, layers = 2e-3, 3e-6, 4e-9, 4
    seconds = [c + layers * (a * L + b * L * L) for L in lengths]
    f = fit(lengths, seconds, layers)
    assert f["overhead_s"] == pytest.approx(c, rel=1e-6)
    assert f["linear_s_per_token_per_layer"] == pytest.approx(a, rel=1e-6)
    assert f["attn_s_per_pair_per_layer"] == pytest.approx(b, rel=1e-6)
    assert f["mape"] < 1e-9


def test_fit_keeps_coefficients_non_negative():
    # Purely linear data with noise that would pull the L² term negative.
    lengths = np.array([100, 200, 400, 800, 1600])
    seconds = 1e-5 * lengths * np.array([1.0, 1.01, 1.0, 0.99, 0.97])
    f = fit(lengths, seconds, 1)
    assert min(f["overhead_s"], f["linear_s_per_token_per_layer"], f["attn_s_per_pair_per_layer"]) >= 0
    with pytest.raises(ValueError, match="need >= 3"):
        fit([1, 2], [1.0, 2.0], 1)


def test_calibrate_tiny_model_on_cpu(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["calibrate", "--hidden", "64", "--heads", "2", "--lengths", "64,128,256,384,512,768,1024",
               "--device", "cpu", "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0  # exits 1 if the fit's mean absolute error is over 5%
    profile = json.loads(out.read_text())
    assert profile == printed
    assert profile["fit"]["mape"] <= 0.05
    m = profile["measured_on"]
    assert m["device"] == "cpu" and m["dtype"] == "float32" and m["attention_backend"] == "sdpa"
    assert profile["command"].startswith("knapray calibrate --hidden 64 --heads 2")
    # Round trip: the planner's cost model predicts what was measured (to the fit's error).
    cost = CostModel.from_profile(str(out))
    assert cost.d_model == 64 and cost.layers == 2 and cost.num_heads == 2
    predicted = cost.compute(np.asarray(profile["lengths"])) + cost.step_overhead_s
    np.testing.assert_allclose(predicted, profile["fit"]["fit_seconds"], rtol=1e-9)
    measured = np.asarray(profile["seconds"])
    assert np.mean(np.abs(predicted - measured) / measured) <= 0.05
