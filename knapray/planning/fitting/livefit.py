"""LiveFit: re-fit the cost model's compute terms and per-rank speeds while training.

A profile (``knapray calibrate``) or the FLOP constants price a step before the run; the
run itself then measures, every step and on every rank, the seconds of model compute
(``knapray.worker.timing``: forward + backward of the chunks the rank ran, its home sequences'
embedding, head and loss; the all-to-alls excluded). ``LiveFit`` keeps a window of recent
steps and fits, to those seconds, what ``CostModel.step_times`` predicts them with::

    t[r] = c + layers · (a·N[r] + b·Q[r] + s·n[r]) / speed[r]

``N`` the tokens of the chunks rank ``r`` computed, ``Q = Σ L²/g`` over them (a chunk of a
sequence of ``L`` tokens on a bag of ``g`` runs attention over the whole sequence for
``1/g`` of the heads), ``n`` the chunks (every GPU of a bag pays the per-sequence term),
``c`` the fixed cost of a step (``CostModel.fixed_s``, not divided by speed, as
``rank_times`` charges it). These are the features ``rank_times`` uses, so the fitted
coefficients predict exactly what the planner balances.

The fit minimizes the relative squared error (each measurement counts alike, as in
``costfit``), newer steps weighing more (half of it after ``HALF_LIFE`` steps):

- which coefficients: a coefficient the window cannot tell apart from the ones before
  it (in the order ``c, a, b, s``: its column lies within ``COLLINEAR_TOL`` of their span,
  e.g. every rank always ran one sequence) keeps its current value instead of taking a
  noisy one;
- a round of each in turn (non-negative least squares of the coefficients given the
  speeds; each rank's speed-1 prediction over its measured seconds above ``c``, ratio of
  sums, relative to the median rank), then both jointly (``_joint``: Levenberg-Marquardt
  over the coefficients, kept ``>= 0``, and every working rank's log speed). Ranks that ran
  nothing say nothing about speed;
- a measurement more than ``TRIM_FLOOR`` (and ``TRIM_K`` times the median error) off that
  fit is left out if it is isolated (a recompilation, a page-fault storm); if a rank's
  newest ``SHIFT_STEPS`` steps are all off the same way, the machine changed: its older
  measurements are dropped and the fit follows the new ones. Then it fits once more.

Nothing changes before ``min_steps`` steps are in the window (after ``skip_steps`` warm-up
steps: allocator growth, lazy initialization, compilation). The first fit then replaces
the prior whole (it may be far off: FLOP constants on a CPU); later fits move each
coefficient by at most ``max_change`` of the mean measured step per step, and each speed
by at most that factor, so the planner and the fit it feeds cannot start to oscillate.
Fitted values are rounded to ``SIG_DIGITS`` significant digits: ranks that fit the same
data on slightly different BLAS builds still agree (``digest`` checks that they do).

Per-rank speed in ``CostModel`` is a bag's slowest member's; a rank's *own* measured
compute does not include waiting for a slower bag peer (that is communication time), so
the fit uses each rank's own speed.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..costs.cost import CostModel
from .costfit import nnls_relative

WINDOW = 64
"""Steps the fit looks back over."""
MIN_STEPS = 8
"""Steps in the window before the prior is replaced."""
SKIP_STEPS = 2
"""First steps a LiveFit sees (per process) that are not used: warm-up."""
MAX_CHANGE = 0.25
"""After the first fit: a coefficient's change per step, in mean measured step times; a
speed's, as a factor ``1 ± MAX_CHANGE``."""
COLLINEAR_TOL = 0.05
"""A coefficient's (relative-error-weighted, unit-norm) column must have at least this much
outside the span of the columns before it to be fitted."""
HALF_LIFE = 16
"""Steps after which a measurement weighs half as much as the newest: the fit follows a
machine that changed within a few dozen steps."""
ITERATIONS = 1
"""Rounds of coefficients-then-speeds before the joint fit (to start it close)."""
LM_ITERATIONS = 30
"""Most Levenberg-Marquardt iterations of the joint fit (it stops when it stops improving)."""
TRIM_FLOOR, TRIM_K = 0.25, 5.0
"""A measurement more than a factor ``1 + TRIM_FLOOR`` (and ``TRIM_K`` times the median
error) off the fit is an outlier."""
SHIFT_STEPS = 3
"""A rank's newest steps all off the same way this many times in a row: it changed (its
older measurements are dropped); fewer, or a run that ended: left out of the fit."""
SIG_DIGITS = 6
"""Significant digits the fitted values are rounded to."""
COEFFICIENTS = ("fixed_s", "linear_s", "attn_s", "seq_s")
"""``c`` (seconds per step), ``a`` (per token per layer), ``b`` (per pair per layer), ``s``
(per chunk per layer)."""
STATE_VERSION = 1


@dataclass(frozen=True)
class RankFeatures:
    """What each rank computed in one step, as ``rank_times`` prices it."""

    tokens: np.ndarray
    """(W,) tokens of the chunks the rank ran."""
    pairs: np.ndarray
    """(W,) ``Σ L²/g`` over those chunks (its share of attention)."""
    chunks: np.ndarray
    """(W,) chunks it ran (each pays the per-sequence term)."""

    @classmethod
    def of_plan(cls, plan) -> "RankFeatures":
        """From a ``BalancePlan`` (any model)."""
        w = plan.world_size
        seq_len = plan.seq_lens[plan.chunk_seq].astype(np.float64)
        g = plan.bag_size_of_seq[plan.chunk_seq].astype(np.float64)
        rank = plan.chunk_rank
        return cls(
            tokens=np.bincount(rank, weights=plan.chunk_len.astype(np.float64), minlength=w),
            pairs=np.bincount(rank, weights=seq_len * seq_len / g, minlength=w),
            chunks=np.bincount(rank, minlength=w).astype(np.float64),
        )

    @property
    def world_size(self) -> int:
        return int(self.tokens.size)

    def matrix(self) -> np.ndarray:
        """(W, 3) tokens, pairs, chunks."""
        return np.stack([self.tokens, self.pairs, self.chunks], axis=1).astype(np.float64)


def coefficients_of(model: CostModel) -> np.ndarray:
    """``(c, a, b, s)`` of a cost model."""
    return np.array([model.fixed_s, model.linear_s_per_token, model.attn_s_per_pair, model.seq_s], dtype=np.float64)


def predict(model: CostModel, features: RankFeatures) -> np.ndarray:
    """(W,) compute seconds per rank the model predicts, each rank at its own speed."""
    coef = coefficients_of(model)
    speed = model.speeds(features.world_size)
    return coef[0] + model.layers * (features.matrix() @ coef[1:]) / speed


class LiveFit:
    """Re-fits a ``CostModel``'s compute coefficients and per-rank speeds from measured
    per-rank compute seconds (see the module docstring). Deterministic: the same
    observations give the same model, bit for bit."""

    def __init__(
        self,
        prior: CostModel,
        *,
        window: int = WINDOW,
        min_steps: int = MIN_STEPS,
        skip_steps: int = SKIP_STEPS,
        max_change: float = MAX_CHANGE,
    ) -> None:
        if not isinstance(prior, CostModel):
            raise ValueError(f"LiveFit needs a CostModel prior, got {type(prior).__name__}")
        for name, v, lo in (("window", window, 1), ("min_steps", min_steps, 1), ("skip_steps", skip_steps, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if min_steps > window:
            raise ValueError(f"min_steps ({min_steps}) must be <= window ({window})")
        if not (np.isfinite(max_change) and max_change > 0):
            raise ValueError(f"max_change must be a positive number, got {max_change!r}")
        self.prior = prior
        self.window, self.min_steps, self.skip_steps, self.max_change = window, min_steps, skip_steps, max_change
        self._coef = coefficients_of(prior)
        self._speeds: np.ndarray | None = None if prior.rank_speed is None else np.asarray(prior.rank_speed)
        self._rows: deque[tuple[int, np.ndarray, np.ndarray]] = deque(maxlen=window)
        """(step, (W, 3) features, (W,) seconds) of recent steps."""
        self._skipped = 0
        self.fitted = False
        """Whether the prior has been replaced."""
        self.updates = 0
        """Fits applied so far."""
        self.fit_error: float | None = None
        """Mean relative error over the window of the last fit (on the measurements kept)."""
        self._model: CostModel | None = None
        self._stale = False
        """Steps were recorded since the last fit (``observe(refit=False)``)."""

    # ---- observations ---------------------------------------------------------------------

    @property
    def steps_in_window(self) -> int:
        return len(self._rows)

    def observe(self, step: int, features: RankFeatures, compute_s: Sequence[float], refit: bool = True) -> bool:
        """One step's features and measured compute seconds per rank; re-fits once the
        window holds ``min_steps`` steps. Returns whether the model changed. A step already
        in the window is ignored; a new world size starts the window and speeds over.

        ``refit=False`` only records the step: the fit is brought up to date when the model
        is next asked for (a rank whose plans come from the coordinator keeps its own fit
        for the steps it may have to plan itself, without fitting every step)."""
        t = np.array(compute_s, dtype=np.float64)  # a copy: the window marks dropped times in it
        if t.shape != (features.world_size,):
            raise ValueError(f"step {step}: {t.size} compute times for {features.world_size} ranks")
        if np.any(~np.isfinite(t)) or np.any(t < 0):
            raise ValueError(f"step {step}: compute seconds must be finite and >= 0, got {t.tolist()!r:.200}")
        if self._rows and self._rows[0][2].size != t.size:
            self._rows.clear()
            self._stale = False
            self._speeds = None
            self._model = None
        elif self._speeds is not None and self._speeds.size != t.size:
            self._speeds = None
            self._model = None
        if any(s == step for s, _, _ in self._rows):
            return False
        if self._skipped < self.skip_steps:
            self._skipped += 1
            return False
        self._rows.append((int(step), features.matrix(), t))
        if len(self._rows) < self.min_steps:
            return False
        if not refit:
            self._stale = True
            return False
        return self._refit()

    def _settle(self) -> None:
        """Fit the steps recorded without a re-fit, if any."""
        if self._stale:
            self._stale = False
            self._refit()

    # ---- the model ---------------------------------------------------------------------------

    def model(self) -> CostModel:
        """The prior until the first fit, then the prior with the fitted coefficients and
        speeds."""
        self._settle()
        if self._model is None:
            self._model = self._build()
        return self._model

    @property
    def speeds(self) -> np.ndarray | None:
        """(W,) fitted speed of every rank (median 1), or None before any."""
        self._settle()
        return None if self._speeds is None else self._speeds.copy()

    @property
    def coefficients(self) -> dict[str, float]:
        self._settle()
        return dict(zip(COEFFICIENTS, self._coef.tolist()))

    def digest(self) -> str:
        """Short hash of the fitted values: equal on every rank that fit the same data."""
        self._settle()
        state = [self._coef.tolist(), None if self._speeds is None else self._speeds.tolist(), self.fitted]
        return hashlib.sha256(json.dumps(state).encode()).hexdigest()[:16]

    def _build(self) -> CostModel:
        if not self.fitted:
            return self.prior if self._speeds is None else self.prior.with_rank_speed(self._speeds)
        c, a, b, s = self._coef.tolist()
        p = self.prior
        # The fixed cost keeps the prior's split between per-step and per-layer parts.
        if p.fixed_s > 0:
            k = c / p.fixed_s
            fixed = {"step_overhead_s": p.step_overhead_s * k, "layer_overhead_s": p.layer_overhead_s * k}
        else:
            fixed = {"step_overhead_s": 0.0, "layer_overhead_s": c / p.layers}
        # Measured step times hold everything a rank computed, cross-attention too (Wan): the
        # fitted terms price it, so no analytic cross term goes on top (as a calibrated profile).
        cross = {"text_tokens": 0} if p.attention_kind == "cross" else {}
        model = p.replace(linear_s=a, attn_s=b, seq_s=s, **fixed, **cross)
        return model.with_rank_speed(self._speeds)

    # ---- fitting -----------------------------------------------------------------------------

    def _refit(self) -> bool:
        steps = len(self._rows)
        if not steps:
            return False
        w = self._rows[-1][2].size
        feats = np.concatenate([f for _, f, _ in self._rows])  # (R, 3), R = steps · W, by step
        t = np.concatenate([s for _, _, s in self._rows])  # (R,); NaN: dropped after a shift
        rank = np.tile(np.arange(w), steps)
        age = np.repeat(np.arange(steps - 1, -1, -1), w)
        weight = 0.5 ** (age / HALF_LIFE)
        # A rank timed at 0 (nothing measurable) says nothing.
        keep = np.isfinite(t) & (t > 0)
        if not keep.any():
            return False
        variable = self.prior.layers * feats  # (R, 3) seconds per unit coefficient at speed 1
        coef, speeds = self._alternate(variable, t, weight, rank, keep, w)
        off = self._outliers(self._predict(variable, coef, speeds[rank]), t, weight, keep, w)  # (steps, W)
        # Consecutive newest steps of a rank off in one direction: the machine changed.
        run = np.zeros(w, dtype=np.int64)
        for r in range(w):
            col = off[:, r]
            while run[r] < steps and col[steps - 1 - run[r]] != 0 and col[steps - 1 - run[r]] == col[-1]:
                run[r] += 1
        shifted = run >= SHIFT_STEPS
        excluded = off != 0
        for r in np.flatnonzero(shifted).tolist():
            for i in range(steps - run[r]):  # forget what the rank measured before
                self._rows[i][2][r] = np.nan
            excluded[:, r] = False
        drop = excluded.reshape(-1) | (~np.isfinite(np.concatenate([s for _, _, s in self._rows])))
        if drop.any():
            keep = keep & ~drop
            if not keep.any():
                return False
            coef, speeds = self._alternate(variable, t, weight, rank, keep, w)
        if self.fitted:
            coef, speeds = self._bounded(coef, speeds, variable[keep], t[keep], speeds[rank[keep]])
        coef = _round(coef)
        speeds = _round(speeds)
        pred = self._predict(variable, coef, speeds[rank])
        rel = np.abs(pred[keep] - t[keep]) / t[keep]
        self.fit_error = float(np.average(rel, weights=weight[keep]))
        changed = not (self.fitted and np.array_equal(coef, self._coef) and self._speeds is not None
                       and np.array_equal(speeds, self._speeds))
        self._coef, self._speeds = coef, speeds
        self.fitted = True
        self.updates += 1
        self._model = None
        return changed

    def _alternate(self, variable: np.ndarray, t: np.ndarray, weight: np.ndarray, rank: np.ndarray,
                   keep: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients and speeds fitted on the ``keep`` rows, from the current fit: a
        round of each in turn to get close, then jointly (``_joint``)."""
        v, tk, wk, rk = variable[keep], t[keep], weight[keep], rank[keep]
        speeds = np.ones(world) if self._speeds is None else self._speeds.copy()
        coef = self._coef.copy()
        free = _free_columns(v, tk, wk, speeds[rk])
        for _ in range(ITERATIONS):
            coef = self._fit_coefficients(v, tk, wk, speeds[rk], coef, free)
            speeds = self._fit_speeds(v, tk, wk, rk, coef, speeds)
        return _joint(v, tk, wk, rk, coef, speeds, free)

    @staticmethod
    def _outliers(pred: np.ndarray, t: np.ndarray, weight: np.ndarray, keep: np.ndarray, world: int) -> np.ndarray:
        """(steps, W): +1 / -1 where a kept measurement is more than a factor
        ``1 + TRIM_FLOOR`` and ``TRIM_K`` times the (recency-weighted) median off the fit (in
        log terms; +1: predicted too high), else 0."""
        off = np.zeros(t.size)
        ok = keep & (pred > 0)
        off[ok] = np.log(pred[ok] / t[ok])
        off[keep & ~ok] = -np.inf  # predicted nothing, measured something
        size = np.minimum(np.abs(off[keep]), 1e3)
        order = np.argsort(size, kind="stable")
        cum = np.cumsum(weight[keep][order])
        median = float(size[order][np.searchsorted(cum, cum[-1] / 2)])
        limit = max(np.log1p(TRIM_FLOOR), TRIM_K * median)
        return (np.sign(off) * (np.abs(off) > limit) * keep).reshape(-1, world)

    @staticmethod
    def _predict(variable: np.ndarray, coef: np.ndarray, speed: np.ndarray) -> np.ndarray:
        return coef[0] + (variable @ coef[1:]) / speed

    @staticmethod
    def _fit_coefficients(variable: np.ndarray, t: np.ndarray, weight: np.ndarray, speed: np.ndarray,
                          current: np.ndarray, free: list[int]) -> np.ndarray:
        """Non-negative relative least squares of the ``free`` coefficients given the
        speeds; the others keep ``current``."""
        basis = _basis(variable, speed)
        fixed = [k for k in range(4) if k not in free]
        offset = basis[:, fixed] @ current[fixed] if fixed else None
        coef = nnls_relative(basis, t, free=free, offset=offset, weight=weight) if free else np.zeros(4)
        coef[fixed] = current[fixed]
        return coef

    @staticmethod
    def _fit_speeds(variable: np.ndarray, t: np.ndarray, weight: np.ndarray, rank: np.ndarray, coef: np.ndarray,
                    current: np.ndarray) -> np.ndarray:
        """Each rank's speed-1 seconds over its measured seconds above ``c`` (recency-weighted
        sums over the window), relative to the median rank; ranks without work keep
        ``current``."""
        w = current.size
        work = variable @ coef[1:]
        ran = work > 0
        predicted = np.bincount(rank[ran], weights=weight[ran] * work[ran], minlength=w)
        measured = np.bincount(rank[ran], weights=weight[ran] * (t[ran] - coef[0]), minlength=w)
        known = (predicted > 0) & (measured > 0)
        if not known.any():
            return current
        speeds = current.copy()
        speeds[known] = predicted[known] / measured[known]
        speeds[known] /= float(np.median(speeds[known]))
        return speeds

    def _bounded(self, coef: np.ndarray, speeds: np.ndarray, variable: np.ndarray, t: np.ndarray,
                 speed_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Limit the change from the current fit (see the module docstring)."""
        basis = _basis(variable, speed_rows)
        share = basis.mean(axis=0)  # seconds per unit of each coefficient, mean over rows
        limit = np.full(4, np.inf)
        np.divide(self.max_change * float(t.mean()), share, out=limit, where=share > 0)
        coef = np.maximum(np.clip(coef, self._coef - limit, self._coef + limit), 0.0)
        if self._speeds is not None and self._speeds.size == speeds.size:
            speeds = np.clip(speeds, self._speeds / (1 + self.max_change), self._speeds * (1 + self.max_change))
        return coef, speeds

    # ---- persistence (plain JSON) ------------------------------------------------------------

    def _prior_key(self) -> dict[str, Any]:
        p = self.prior
        return {"layers": p.layers, "coefficients": _round(coefficients_of(p)).tolist(),
                "seq_s_counts": p.seq_s_counts}

    def to_json(self) -> dict[str, Any]:
        """The fitted state (not the window: a restored fit waits for ``min_steps`` new
        steps before it changes again)."""
        self._settle()
        return {
            "version": STATE_VERSION,
            "prior": self._prior_key(),
            "fitted": self.fitted,
            "updates": self.updates,
            "coefficients": self._coef.tolist(),
            "speeds": None if self._speeds is None else self._speeds.tolist(),
            "fit_error": self.fit_error,
        }

    def load_json(self, state: dict[str, Any], world_size: int | None = None) -> bool:
        """Restore ``to_json``'s output if it was fitted against the same prior (the same
        model shape and constants); speeds only for ``world_size`` ranks (if given).
        Returns whether it was restored; raises ValueError/KeyError/TypeError if malformed."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"live fit state version {state.get('version')!r}, expected {STATE_VERSION}")
        coef = np.asarray([float(x) for x in state["coefficients"]], dtype=np.float64)
        if coef.shape != (4,) or np.any(~np.isfinite(coef)) or np.any(coef < 0):
            raise ValueError(f"live fit coefficients must be 4 numbers >= 0, got {state['coefficients']!r}")
        speeds = None if state["speeds"] is None else np.asarray([float(x) for x in state["speeds"]])
        if speeds is not None and (speeds.size == 0 or np.any(~np.isfinite(speeds)) or np.any(speeds <= 0)):
            raise ValueError("live fit speeds must be numbers > 0")
        if state["prior"] != self._prior_key():
            return False
        if speeds is not None and world_size is not None and speeds.size != world_size:
            speeds = None
        self._coef, self._speeds = coef, speeds
        self.fitted, self.updates = bool(state["fitted"]), int(state["updates"])
        self.fit_error = None if state["fit_error"] is None else float(state["fit_error"])
        self._rows.clear()
        self._stale = False
        self._model = None
        return True

    def summary(self) -> dict[str, Any]:
        """JSON-friendly: whether fitted, the coefficients, speeds and the window's error."""
        self._settle()
        return {"fitted": self.fitted, "updates": self.updates, "steps_in_window": len(self._rows),
                "fit_error": self.fit_error, **self.coefficients,
                "speeds": None if self._speeds is None else self._speeds.tolist()}


def _basis(variable: np.ndarray, speed: np.ndarray) -> np.ndarray:
    """(R, 4) seconds per unit of ``c, a, b, s`` in each row, at the rows' speeds."""
    return np.column_stack([np.ones(len(variable)), variable / speed[:, None]])


def _free_columns(variable: np.ndarray, t: np.ndarray, weight: np.ndarray, speed: np.ndarray) -> list[int]:
    """The coefficients the rows can tell apart: in the order ``c, a, b, s``, those whose
    (relative-error-weighted, unit-norm) column has more than ``COLLINEAR_TOL`` outside the
    span of the ones taken before it."""
    basis = _basis(variable, speed) * (np.sqrt(weight) / t)[:, None]
    norms = np.linalg.norm(basis, axis=0)
    free: list[int] = []
    for k in range(4):
        if norms[k] == 0:
            continue
        col = basis[:, k] / norms[k]
        if free:
            span = basis[:, free] / norms[free]
            proj, *_ = np.linalg.lstsq(span, col, rcond=None)
            col = col - span @ proj
        if np.linalg.norm(col) > COLLINEAR_TOL:
            free.append(k)
    return free


def _joint(variable: np.ndarray, t: np.ndarray, weight: np.ndarray, rank: np.ndarray, coef: np.ndarray,
           speeds: np.ndarray, free: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt on ``Σ weight · ((c + (V·θ)/speed[r] - t) / t)²`` over the free
    coefficients (kept >= 0) and every working rank's log speed together; the speeds'
    scale (which the coefficients can take up) is fixed afterwards, median 1. Taking one
    then the other in turn crawls along that valley; this does not. The per-rank speed
    block is diagonal, so each iteration solves a 4 x 4 system (Schur complement), whatever
    the world size."""
    world = speeds.size
    g = np.sqrt(weight) / t  # (R,) row scale
    work_rank = np.bincount(rank, weights=variable.sum(axis=1), minlength=world) > 0
    u = np.log(1.0 / speeds)  # log inverse speed: the rank's time is c + exp(u)·(V·θ)
    fr = np.asarray(free, dtype=np.int64)

    def residual(c: np.ndarray, u: np.ndarray) -> np.ndarray:
        return g * (c[0] + np.exp(u[rank]) * (variable @ c[1:])) - np.sqrt(weight)

    e = residual(coef, u)
    cost = float(e @ e)
    lam = 1e-3
    for _ in range(LM_ITERATIONS):
        scale = np.exp(u[rank])
        jc = np.column_stack([g, (g * scale)[:, None] * variable])[:, fr]  # (R, F)
        ju = g * scale * (variable @ coef[1:])  # (R,) d e / d u[rank]
        a = jc.T @ jc
        b = np.zeros((fr.size, world))
        for k in range(fr.size):
            b[k] = np.bincount(rank, weights=jc[:, k] * ju, minlength=world)
        d = np.bincount(rank, weights=ju * ju, minlength=world)
        g1 = jc.T @ e
        g2 = np.bincount(rank, weights=ju * e, minlength=world)
        on = work_rank & (d > 0)
        improved = False
        for _ in range(10):
            a_l = a + lam * np.diag(np.diag(a) + 1e-30)
            d_l = np.where(on, d * (1 + lam) + 1e-30, 1.0)
            bd = b[:, on] / d_l[on]
            step1 = np.linalg.lstsq(a_l - bd @ b[:, on].T, -g1 + bd @ g2[on], rcond=None)[0]
            step2 = np.zeros(world)
            step2[on] = (-g2[on] - b[:, on].T @ step1) / d_l[on]
            c_new = coef.copy()
            c_new[fr] = np.maximum(coef[fr] + step1, 0.0)
            u_new = u + step2
            e_new = residual(c_new, u_new)
            cost_new = float(e_new @ e_new)
            if cost_new < cost:
                improved = cost - cost_new > 1e-12 * max(cost, 1e-30)
                coef, u, e, cost = c_new, u_new, e_new, cost_new
                lam = max(lam / 10, 1e-12)
                break
            lam *= 10
        if not improved:
            break
    speeds = np.exp(-u)
    if work_rank.any():
        m = float(np.median(speeds[work_rank]))
        speeds = speeds / m
        coef = coef.copy()
        coef[1:] /= m  # c + (V·θ)/s  ==  c + (V·θ/m)/(s/m)
    return coef, speeds


def _round(x: np.ndarray) -> np.ndarray:
    return np.asarray([float(f"{v:.{SIG_DIGITS}g}") for v in np.asarray(x, dtype=np.float64).tolist()])
