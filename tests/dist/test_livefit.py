"""The live re-fit of the cost model: known coefficients and a slow rank recovered from
noisy synthetic times, nothing changed before enough steps, per-coefficient fallback,
bounded change, outliers, persistence, determinism; and a CPU training run (2 gloo ranks,
``planner: cost``, local plans) whose logged prediction error falls from the configured
FLOP constants' ~100% to within 10% once the fit has replaced them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from knapray.planning import PAPER_MIXES, CostModel, Topology, identity_plan, plan_balance, sample_step
from knapray.planning.fitting.costfit import scaled_codes
from knapray.planning.fitting.livefit import MAX_CHANGE, MIN_STEPS, SHIFT_STEPS, SKIP_STEPS, LiveFit, RankFeatures, predict

SHAPE = {"d_model": 256, "double_blocks": 1, "single_blocks": 1, "num_heads": 8}
PRIOR = CostModel(**SHAPE)
"""The FLOP constants (400 TFLOP/s): four orders of magnitude off on a CPU."""
TRUE = CostModel(**SHAPE, linear_s=2e-6, attn_s=3e-10, seq_s=1e-4, layer_overhead_s=5e-3,
                 rank_speed=(1, 1, 1, 0.5, 1, 1, 1, 1))
"""The machine: rank 3 computes at half speed."""
CODES = scaled_codes(PAPER_MIXES["image+video"], 4)
TOPO = Topology.parse("g1n4+g2n2")


def _feed(fit: LiveFit, steps: int, noise: float, seed: int = 0, true: CostModel = TRUE, start: int = 0):
    """Plan ``steps`` steps with the fit's current model (as the coordinator does) and
    feed it the times ``true`` gives, with relative Gaussian noise."""
    rng = np.random.default_rng(seed)
    errors = []
    for step in range(start, start + steps):
        plan = plan_balance(sample_step(CODES, rng)[:8], TOPO, fit.model())
        feats = RankFeatures.of_plan(plan)
        seconds = predict(true, feats) * (1 + noise * rng.standard_normal(8))
        errors.append(float(np.mean(np.abs(predict(fit.model(), feats) - seconds) / seconds)))
        fit.observe(step, feats, seconds)
    return errors


def test_features_are_what_rank_times_prices():
    rng = np.random.default_rng(3)
    plan = plan_balance(sample_step(CODES, rng)[:8], TOPO, TRUE)
    times = TRUE.with_rank_speed(None).step_times(plan)
    feats = RankFeatures.of_plan(plan)
    np.testing.assert_allclose(predict(TRUE.with_rank_speed(None), feats), times.compute + times.overhead, rtol=1e-12)
    assert feats.tokens.sum() == plan.seq_lens.sum() and feats.chunks.sum() == plan.chunk_seq.size


def test_recovers_known_coefficients_and_a_slow_rank_from_noisy_times():
    fit = LiveFit(PRIOR)
    errors = _feed(fit, 40, noise=0.01)
    assert min(errors[: SKIP_STEPS + MIN_STEPS]) > 0.99  # the prior predicts ~nothing
    assert np.mean(errors[-20:]) < 0.02  # 1% noise
    model = fit.model()
    assert model.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.03)
    assert model.linear_s == pytest.approx(TRUE.linear_s, rel=0.15)
    assert model.seq_s == pytest.approx(TRUE.seq_s, rel=0.25)
    # Attention is a small share of these balanced steps and its column follows the
    # tokens' closely: 1% noise moves its coefficient most (a plain fit with the true
    # speeds does no better); the predictions are what must be right.
    assert 1 / 3 < model.attn_s / TRUE.attn_s < 3
    np.testing.assert_allclose(fit.speeds, TRUE.rank_speed, rtol=0.03)
    assert fit.fit_error < 0.02


def test_noise_free_times_give_the_coefficients_exactly():
    fit = LiveFit(PRIOR)
    _feed(fit, 30, noise=0.0)
    got = fit.model()
    for name in ("fixed_s", "linear_s_per_token", "attn_s_per_pair", "seq_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=2e-3), name
    np.testing.assert_allclose(fit.speeds, TRUE.rank_speed, rtol=1e-3)


def test_a_cross_attention_prior_is_fitted_without_an_analytic_cross_term_on_top():
    """Wan (``attention_kind: cross``): the measured times hold the cross-attention, so the
    re-fitted model prices it through its fitted terms (``text_tokens`` 0), as a calibrated
    Wan profile does; with the prior's 512 text tokens added on top it would count it twice."""
    cross_prior = CostModel(**SHAPE, attention_kind="cross", text_tokens=512)
    truth = TRUE.replace(attention_kind="cross", text_tokens=0)  # what the fitted features can express
    fit = LiveFit(cross_prior)
    _feed(fit, 30, noise=0.0, true=truth)
    got = fit.model()
    assert got.attention_kind == "cross" and got.text_tokens == 0
    for name in ("fixed_s", "linear_s_per_token", "attn_s_per_pair", "seq_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=2e-3), name
    lens = np.array([300, 1200, 64])
    assert float(got.compute(lens).sum()) == pytest.approx(float(truth.compute(lens).sum()), rel=2e-3)


def test_nothing_changes_before_enough_steps():
    fit = LiveFit(PRIOR)
    rng = np.random.default_rng(0)
    for step in range(SKIP_STEPS + MIN_STEPS):
        plan = plan_balance(sample_step(CODES, rng)[:8], TOPO, PRIOR)
        changed = fit.observe(step, RankFeatures.of_plan(plan), predict(TRUE, RankFeatures.of_plan(plan)))
        last = step == SKIP_STEPS + MIN_STEPS - 1
        assert changed is last and fit.fitted is last
        assert (fit.model() is PRIOR) is not last
    assert fit.observe(step, RankFeatures.of_plan(plan), np.ones(8)) is False  # a step seen already


def test_recorded_without_a_refit_the_fit_catches_up_when_asked():
    eager, lazy = LiveFit(PRIOR), LiveFit(PRIOR)
    rng = np.random.default_rng(0)
    for step in range(SKIP_STEPS + MIN_STEPS):
        feats = RankFeatures.of_plan(plan_balance(sample_step(CODES, rng)[:8], TOPO, PRIOR))
        eager.observe(step, feats, predict(TRUE, feats))
        assert lazy.observe(step, feats, predict(TRUE, feats), refit=False) is False
    assert not lazy.fitted and eager.fitted
    assert lazy.model() == eager.model() and lazy.fitted  # one fit, on the same window


def test_a_coefficient_the_data_cannot_separate_keeps_its_value():
    # Every rank always runs one chunk: the per-chunk term is indistinguishable from the
    # fixed cost, so it stays at the prior's value and the fixed cost takes the rest.
    prior = PRIOR.replace(seq_s=7e-5)
    fit = LiveFit(prior)
    rng = np.random.default_rng(1)
    for step in range(SKIP_STEPS + MIN_STEPS + 4):
        plan = identity_plan([[int(x)] for x in rng.integers(64, 2048, size=8)])
        feats = RankFeatures.of_plan(plan)
        fit.observe(step, feats, predict(TRUE.with_rank_speed(None), feats))
    got = fit.model()
    assert got.seq_s == pytest.approx(7e-5)
    assert got.fixed_s == pytest.approx(TRUE.fixed_s + 2 * (TRUE.seq_s - 7e-5), rel=1e-3)
    assert got.linear_s == pytest.approx(TRUE.linear_s, rel=1e-3)


def test_a_spike_is_ignored_and_a_lasting_change_is_followed_in_bounded_steps():
    fit = LiveFit(PRIOR)
    _feed(fit, 20, noise=0.0)
    before = fit.model()
    # One step 20x slower on every rank (a recompilation, a page-fault storm): ignored.
    rng = np.random.default_rng(9)
    plan = plan_balance(sample_step(CODES, rng)[:8], TOPO, before)
    fit.observe(100, RankFeatures.of_plan(plan), 20 * predict(TRUE, RankFeatures.of_plan(plan)))
    assert fit.model() == before
    _feed(fit, 5, noise=0.0, start=101)
    assert fit.model().fixed_s == pytest.approx(before.fixed_s, rel=1e-3)
    # The machine slows down 2x for good: two such steps could still be spikes; the third
    # says it changed, and each step then moves the fixed cost by at most a quarter of
    # the mean step until the fit has it.
    slow = TRUE.replace(layer_overhead_s=2 * TRUE.layer_overhead_s, linear_s=2 * TRUE.linear_s,
                        attn_s=2 * TRUE.attn_s, seq_s=2 * TRUE.seq_s)
    fixed = [fit.model().fixed_s]
    for i in range(SHIFT_STEPS + 1):
        errors = _feed(fit, 1, noise=0.0, true=slow, start=200 + i, seed=200 + i)
        fixed.append(fit.model().fixed_s)
    assert fixed[SHIFT_STEPS - 1] == pytest.approx(fixed[0], rel=1e-3)
    mean_step = 2 * 0.03  # the mean measured step of these batches is below 60 ms
    assert 0 < fixed[SHIFT_STEPS] - fixed[SHIFT_STEPS - 1] <= MAX_CHANGE * mean_step
    errors = _feed(fit, 10, noise=0.0, true=slow, start=300, seed=7)
    assert errors[-1] < 1e-3
    assert fit.model().fixed_s == pytest.approx(slow.fixed_s, rel=1e-3)
    # One rank slows down: its speed follows within a few steps, the others' stay.
    slower = slow.with_rank_speed((1, 1, 1, 0.5, 1, 0.5, 1, 1))
    _feed(fit, SHIFT_STEPS + 4, noise=0.0, true=slower, start=400, seed=8)
    np.testing.assert_allclose(fit.speeds, slower.rank_speed, rtol=1e-3)


def test_same_observations_same_model_and_a_new_world_starts_speeds_over():
    a, b = LiveFit(PRIOR), LiveFit(PRIOR)
    _feed(a, 15, noise=0.02, seed=4)
    _feed(b, 15, noise=0.02, seed=4)
    assert a.digest() == b.digest() and a.model() == b.model()
    _feed(b, 1, noise=0.02, seed=5, start=15)
    assert a.digest() != b.digest()
    # 4 ranks now: the 8 speeds mean nothing for them.
    plan = plan_balance([[100], [200], [300], [400]], Topology.parse("g1n4"), a.model().with_rank_speed(None))
    a.observe(99, RankFeatures.of_plan(plan), np.full(4, 0.01))
    assert a.speeds is None and a.model().rank_speed is None and a.fitted


def test_json_round_trip_and_another_prior_is_refused():
    fit = LiveFit(PRIOR)
    _feed(fit, 15, noise=0.01)
    state = json.loads(json.dumps(fit.to_json()))
    back = LiveFit(PRIOR)
    assert back.load_json(state, world_size=8) and back.model() == fit.model() and back.digest() == fit.digest()
    assert back.load_json(state, world_size=4) and back.speeds is None  # speeds of another world
    assert not LiveFit(PRIOR.replace(single_blocks=2)).load_json(state)
    with pytest.raises(ValueError, match="coefficients must be 4 numbers"):
        LiveFit(PRIOR).load_json({**state, "coefficients": [1.0, -1.0, 0.0, 0.0]})


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="min_steps"):
        LiveFit(PRIOR, window=4, min_steps=8)
    with pytest.raises(ValueError, match="needs a CostModel"):
        LiveFit(object())
    feats = RankFeatures.of_plan(identity_plan([[10], [20]]))
    with pytest.raises(ValueError, match="3 compute times for 2 ranks"):
        LiveFit(PRIOR).observe(0, feats, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        LiveFit(PRIOR).observe(0, feats, [1.0, float("nan")])


def test_local_plans_fall_back_to_the_configured_model_if_rank_fits_differ():
    from knapray.worker.ledger_keeper import LedgerKeeper
    from knapray.worker.step_planner import StepPlanner

    live = LiveFit(PRIOR)
    _feed(live, 12, noise=0.0)
    planner = StepPlanner(SimpleNamespace(rank=0), TOPO, PRIOR, "knapray", None, LedgerKeeper(0, None, ""), live=live)
    assert planner._local_model([live.digest()] * 8) is live.model()
    assert planner._local_model([live.digest()] * 7 + ["other"]) is PRIOR
    assert planner.live_disagreements == 1


def test_only_a_balanced_run_with_the_cost_planner_fits_live():
    """An unbalanced run does not run the coordinator's plans: its times must not fit them."""
    from knapray.config.run import load_config
    from knapray.coordinator import make_live_fit
    from knapray.worker.step_planner import coordinator_config, live_fit

    def cfg(*sets):
        return load_config(None, ["balance.topology=g1n2", *sets])

    assert isinstance(live_fit(cfg("balance.planner=cost")), LiveFit)
    assert live_fit(cfg("balance.planner=cost", "balance.enabled=false")) is None
    # the coordinator builds its own from the same section (``make_live_fit``)
    assert make_live_fit(coordinator_config(cfg("balance.planner=cost", "balance.enabled=false"))) is None
    assert live_fit(cfg("balance.planner=cost", "balance.live_fit=false")) is None
    assert live_fit(cfg("balance.planner=workload")) is None


# ---- a CPU training run --------------------------------------------------------------------

MODEL = ["model.hidden_size=128", "model.num_heads=4", "model.rope_axes_dim=[8,12,12]", "model.depth_double=1",
         "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16"]


def _train_cost_planner(rank: int, world: int, corpus: str, run_root: str):
    from dist_utils import local_trainer

    trainer = local_trainer(rank, world, corpus, run_root, "live", MODEL + [
        "balance.topology=g1n2", "balance.planner=cost", "run.max_steps=30",
    ])
    summary = trainer.train()
    live = trainer.planner.live
    return summary["steps"], live.digest(), live.fitted, trainer.planner.live_disagreements


def _late_errors(records: list[dict]) -> tuple[float, float]:
    """Medians over steps 20.. of the per-rank and of the slowest rank's prediction error."""
    late = [r for r in records if r["step"] >= 20]
    return (float(np.median([r["prediction_error"] for r in late])),
            float(np.median([r["step_prediction_error"] for r in late])))


@pytest.mark.dist
def test_cpu_training_with_the_cost_planner_learns_to_predict_step_time(tmp_path):
    from dist_utils import build_tiny_corpus, run_distributed

    from knapray.driver.report import prediction_line, prediction_summary

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b3i128f1s0,g1b2i256f1s0,g1b1i256f2s0", steps=20, scale=2)
    # On this 2-core machine the mean per-rank error after step 20 is 2.5-7% in most runs;
    # a shared CPU sometimes slows for seconds (the same step then measures 30% longer) and
    # the fit follows it in bounded steps: 2 of ~20 runs measured 15-20%. The statistic is
    # the median over steps 20-29, and one fresh run is allowed before failing: a fit that
    # does not learn (it starts from the same prior, ~100% off) fails both.
    for attempt in range(2):
        runs = tmp_path / f"runs{attempt}"
        results = run_distributed(_train_cost_planner, 2, corpus, str(runs))
        assert [r[0] for r in results] == [30, 30]
        # Every rank fitted the same model from the all-reduced times: plans never disagreed.
        assert results[0][1] == results[1][1] and results[0][2] and results[0][3] == results[1][3] == 0
        with open(runs / "live" / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        assert all(r["planned_by"] == "local" and len(r["predicted_compute_s"]) == 2 for r in records)
        assert np.mean([r["prediction_error"] for r in records[:5]]) > 0.9  # an H100's FLOP constants on a CPU
        per_rank, slowest = _late_errors(records)
        if per_rank <= 0.15 and slowest <= 0.15:
            break
    assert per_rank <= 0.15 and slowest <= 0.15, (per_rank, slowest)
    s = prediction_summary(records)
    assert s["prediction_error_first"] > 0.9
    assert s["prediction_steps_first"] == [0, 4] and s["prediction_steps_last"] == [20, 29]
    assert "(steps 0-4) -> " in prediction_line(s)
