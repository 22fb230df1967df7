"""Fit the cost model to timed packed batches, and the batches to time (pure numpy).

A rank runs one *packed batch* per step: many sequences concatenated along the token
axis, each layer launched once for all of them. Its forward + backward takes::

    t(batch) = c + layers · (a·N + b·Q + s·n)

``N = Σ L`` tokens, ``Q = Σ L²`` token pairs (attention), ``n`` attention calls (every
sequence, or with the per-sequence ``sdpa`` backend every distinct length: it runs
sequences of one length in one call; ``CostModel.seq_s_counts``), and ``c`` the fixed cost
of a step (kernel launches and dispatch paid once per batch, whatever it
holds). ``a``, ``b`` and ``s`` are the *marginal* costs the planner balances: what one more
token, token pair or sequence adds to a batch. Timing sequences one at a time instead
folds ``c`` into every sequence and prices short ones several times too high.

The fit minimizes the relative squared error (every batch counts alike) with all
coefficients ``>= 0`` (exact: the best least-squares solution over every subset of free
coefficients). The per-sequence term ``s`` is kept only if the data show one, decided by
leave-one-out cross-validation: it stays when it lowers the mean absolute error on
held-out batches by more than ``SEQ_TERM_MIN_GAIN`` (relative), so noise alone does not
add a term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..costs.cost import SEQ_COUNTS, CostModel
from ..shapes.mix import MAX_TEXT_TOKENS, DataCode, parse_mix, sample_step
from ..balance.solver import plan_balance
from ..shapes.topology import Topology

SEQ_TERM_MIN_GAIN = 0.02
"""Relative drop of the leave-one-out error the per-sequence term must bring to be kept."""

CALIBRATION_MIXES = ("same", "short", "medium", "long", "mixed", "spread")
"""Length mixes of the calibration batches (see ``calibration_batches``)."""


def batch_features(batches: Sequence[Sequence[int]], seq_counts: str = "sequences") -> np.ndarray:
    """(B, 3) per batch: tokens ``Σ L``, token pairs ``Σ L²``, and what the per-sequence
    term counts (``seq_counts``: ``"sequences"``, or ``"lengths"``: distinct lengths)."""
    if seq_counts not in SEQ_COUNTS:
        raise ValueError(f"seq_counts must be one of {SEQ_COUNTS}, got {seq_counts!r}")
    rows = []
    for lens in batches:
        arr = np.asarray(lens, dtype=np.float64)
        if arr.ndim != 1 or arr.size == 0 or np.any(arr < 1) or np.any(arr != np.round(arr)):
            raise ValueError(f"a batch must be a non-empty list of integer lengths >= 1, got {lens!r:.80}")
        n = float(arr.size if seq_counts == "sequences" else np.unique(arr).size)
        rows.append((arr.sum(), (arr * arr).sum(), n))
    return np.asarray(rows, dtype=np.float64).reshape(-1, 3)


@dataclass(frozen=True)
class PackedFit:
    """``t = overhead_s + layers · (linear_s·N + attn_s·Q + seq_s·n)``."""

    overhead_s: float
    """Fixed seconds of a step (``c``), whatever the batch holds."""
    linear_s: float
    """Seconds per token per layer (``a``)."""
    attn_s: float
    """Seconds per token pair per layer (``b``)."""
    seq_s: float
    """Seconds per sequence per layer (``s``; 0 when the term was not kept)."""
    layers: int
    per_sequence_term: bool
    """Whether ``s`` was fitted (kept by cross-validation, or forced)."""
    cv_mape: float
    """Leave-one-out mean absolute relative error of the chosen model."""
    cv_mape_without_seq: float
    """... of the model without the per-sequence term."""
    cv_mape_with_seq: float
    """... of the model with it."""
    mape: float
    """Mean absolute relative error on the batches it was fitted to."""
    max_ape: float
    predicted_s: tuple[float, ...]
    """Fitted seconds of every batch."""
    seq_counts: str = "sequences"
    """What ``seq_s`` is paid per: ``sequences`` or distinct ``lengths``."""

    def predict(self, batches: Sequence[Sequence[int]]) -> np.ndarray:
        """Predicted seconds of packed batches."""
        return _predict(self.coefficients, batch_features(batches, self.seq_counts), self.layers)

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.overhead_s, self.linear_s, self.attn_s, self.seq_s])

    def to_dict(self) -> dict:
        return {
            "overhead_s": self.overhead_s,
            "linear_s_per_token_per_layer": self.linear_s,
            "attn_s_per_pair_per_layer": self.attn_s,
            "seq_s_per_sequence_per_layer": self.seq_s,
            "seq_counts": self.seq_counts,
            "layers": self.layers,
            "per_sequence_term": self.per_sequence_term,
            "per_sequence_rule": (
                f"leave-one-out cross-validation: kept if it lowers the held-out mean abs. error "
                f"by more than {SEQ_TERM_MIN_GAIN:.0%}"
            ),
            "cv_mape": self.cv_mape,
            "cv_mape_without_seq": self.cv_mape_without_seq,
            "cv_mape_with_seq": self.cv_mape_with_seq,
            "mape": self.mape,
            "max_ape": self.max_ape,
            "fit_seconds": list(self.predicted_s),
        }

    def cost_fields(self) -> dict:
        """The ``CostModel`` fields this fit sets (per layer; the step's fixed cost is
        charged per layer, as kernel launches are)."""
        return {
            "linear_s": self.linear_s,
            "attn_s": self.attn_s,
            "seq_s": self.seq_s,
            "seq_s_counts": self.seq_counts,
            "layer_overhead_s": self.overhead_s / self.layers,
        }


def fit_packed(
    batches: Sequence[Sequence[int]],
    seconds: Sequence[float],
    layers: int,
    per_sequence: bool | None = None,
    seq_counts: str = "sequences",
) -> PackedFit:
    """Fit the packed-batch model to measured seconds of ``batches`` (lists of lengths).

    ``per_sequence``: None decides by cross-validation; True / False force the term.
    ``seq_counts``: what the per-sequence term counts (``batch_features``)."""
    x = batch_features(batches, seq_counts)
    t = np.asarray(seconds, dtype=np.float64)
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    if t.shape != (x.shape[0],):
        raise ValueError(f"got {x.shape[0]} batches but {t.size} timings")
    if x.shape[0] < 5:
        raise ValueError(f"need >= 5 timed batches to fit and cross-validate 4 coefficients, got {x.shape[0]}")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("measured times must be finite and > 0")
    cv_without = _loo_mape(x, t, layers, False)
    cv_with = _loo_mape(x, t, layers, True)
    keep = cv_with < cv_without * (1 - SEQ_TERM_MIN_GAIN) if per_sequence is None else bool(per_sequence)
    coef = _nnls_relative(x, t, layers, keep)
    pred = _predict(coef, x, layers)
    ape = np.abs(pred - t) / t
    return PackedFit(
        overhead_s=float(coef[0]), linear_s=float(coef[1]), attn_s=float(coef[2]), seq_s=float(coef[3]),
        layers=int(layers), per_sequence_term=keep,
        cv_mape=cv_with if keep else cv_without, cv_mape_without_seq=cv_without, cv_mape_with_seq=cv_with,
        mape=float(ape.mean()), max_ape=float(ape.max()), predicted_s=tuple(pred.tolist()),
        seq_counts=seq_counts,
    )


def _design(x: np.ndarray, layers: int) -> np.ndarray:
    """(B, 4) columns for c, a, b, s."""
    return np.column_stack([np.ones(x.shape[0]), layers * x[:, 0], layers * x[:, 1], layers * x[:, 2]])


def _predict(coef: np.ndarray, x: np.ndarray, layers: int) -> np.ndarray:
    return _design(x, layers) @ coef


def _nnls_relative(x: np.ndarray, t: np.ndarray, layers: int, with_seq: bool) -> np.ndarray:
    """Non-negative least squares on relative error (see ``nnls_relative``)."""
    return nnls_relative(_design(x, layers), t, free=[0, 1, 2, 3] if with_seq else [0, 1, 2])


def nnls_relative(
    basis: np.ndarray, t: np.ndarray, free: Sequence[int] | None = None, offset: np.ndarray | None = None,
    weight: np.ndarray | None = None,
) -> np.ndarray:
    """Coefficients ``>= 0`` minimizing ``Σ weight · ((basis @ coef + offset - t) / t)²``:
    the best unconstrained fit over every subset of the ``free`` columns (default: all)
    whose solution is non-negative (4 columns: 15 subsets). Columns not free get 0."""
    n = basis.shape[1]
    free = list(range(n)) if free is None else list(free)
    target = t if offset is None else t - offset
    # Scale columns to unit size so lstsq's rank cut-off treats them alike.
    norm = np.abs(basis).max(axis=0) if basis.shape[0] else np.ones(n)
    norm[norm == 0] = 1.0
    row = 1.0 / t if weight is None else np.sqrt(weight) / t
    scaled = basis / norm * row[:, None]
    y = target * row
    best_err, best = np.inf, np.zeros(n)
    for mask in range(1, 1 << len(free)):
        cols = [free[i] for i in range(len(free)) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(n)
        full[cols] = coef
        err = float(np.sum((scaled @ full - y) ** 2))
        if err < best_err - 1e-15:
            best_err, best = err, full
    return best / norm


def _loo_mape(x: np.ndarray, t: np.ndarray, layers: int, with_seq: bool) -> float:
    """Leave-one-out mean absolute relative error."""
    errs = []
    for i in range(t.size):
        keep = np.arange(t.size) != i
        coef = _nnls_relative(x[keep], t[keep], layers, with_seq)
        errs.append(abs(float(_predict(coef, x[i : i + 1], layers)[0]) - t[i]) / t[i])
    return float(np.mean(errs))


# ---- batches -------------------------------------------------------------------------------


def calibration_batches(
    budgets: Sequence[int], short: int, longest: int | None = None, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """Packed batches to time: every token budget x every mix of ``CALIBRATION_MIXES``.

    With ``top = min(budget, longest)`` (``longest`` defaults to the largest budget):

    - ``same``: sequences of exactly ``short`` tokens;
    - ``short``: sequences of ``short/2 .. 3·short/2`` tokens, as few equal as can be;
    - ``medium``: about 8 sequences (none longer than ``top``);
    - ``long``: sequences of ``top`` tokens (one if the budget allows);
    - ``mixed``: one sequence of ``min(budget/2, top)`` tokens, short ones for the rest;
    - ``spread``: lengths log-uniform between ``short`` and ``min(budget/2, top)``.

    ``longest`` should be the longest sequence the run sees: on a CPU, attention of much
    longer sequences leaves the caches and costs more per token pair than the data would.
    Lengths other than ``same``'s are jittered so that few are equal (as text lengths make
    them in real batches); ``same`` and ``short`` then differ in attention calls where the
    backend runs one per distinct length. Every batch holds exactly ``budget`` tokens."""
    budgets = sorted({int(b) for b in budgets})
    longest = (longest or budgets[-1]) if budgets else 0
    if not budgets or short < 8 or budgets[0] < 4 * short or longest < 2 * short:
        raise ValueError(
            f"need short >= 8, budgets >= 4 x short and longest >= 2 x short; "
            f"got budgets {budgets}, short {short}, longest {longest}"
        )
    rng = np.random.default_rng(seed)
    out = []
    for budget in budgets:
        top = min(budget, longest)
        half = min(budget // 2, top)
        for mix in CALIBRATION_MIXES:
            if mix == "same":
                lens = [short] * (budget // short)
                lens[-1] += budget - sum(lens)
            elif mix == "short":
                # Every length of short/2 .. 3·short/2 once (in random order) before any twice.
                pool = np.concatenate([rng.permutation(np.arange(short // 2, 3 * short // 2 + 1))
                                       for _ in range(budget // short + 1)])
                it = iter(pool.tolist())
                lens = _fill(budget, lambda it=it: next(it), short)
            elif mix == "medium":
                lens = _fill(budget, lambda top=top, b=budget: min(top, b / 8 * rng.uniform(0.8, 1.2)), short)
            elif mix == "long":
                lens = _fill(budget, lambda top=top: top, short)
            elif mix == "mixed":
                lens = [half] + _fill(budget - half, lambda: short * rng.uniform(0.75, 1.25), short)
            else:
                lo, hi = np.log(short), np.log(half)
                lens = _fill(budget, lambda lo=lo, hi=hi: np.exp(rng.uniform(lo, hi)), short)
            out.append((f"{mix}@{budget}", lens))
    return out


def _fill(budget: int, draw, short: int) -> list[int]:
    """Draw lengths until the budget is used; the last one takes the rest (merged into its
    predecessor when that would be shorter than half of ``short``)."""
    lens: list[int] = []
    left = budget
    while left > 0:
        L = min(left, max(1, round(draw())))
        lens.append(L)
        left -= L
    if len(lens) > 1 and lens[-1] < short // 2:
        last = lens.pop()
        lens[-1] += last
    return lens


def scaled_codes(mix: str, scale: int) -> list[DataCode]:
    """A mix's data codes with resolutions divided by ``scale`` (visual tokens by
    ``scale²``), at least one token side each."""
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"scale must be an integer >= 1, got {scale!r}")
    return [
        DataCode(c.ranks, c.batch, max(16, c.resolution // scale), c.frames, c.compressed) for c in parse_mix(mix)
    ]


def validation_batches(
    cost: CostModel,
    mixes: Sequence[str],
    scale: int,
    target_s: float,
    per_mix: int = 4,
    seed: int = 12345,
) -> list[tuple[str, list[int]]]:
    """Held-out packed batches as a balanced rank runs them.

    For each mix (a paper mix name or codes): one step of the mix at its own rank count,
    resolutions and text lengths divided by ``scale``, planned by ``plan_balance`` with
    ``cost`` onto as many bags of one GPU as make the mean batch take about ``target_s``
    by the model's own prediction; ``per_mix`` of those ranks' batches (evenly spaced
    ranks, so different compositions) are the validation batches."""
    if not (np.isfinite(target_s) and target_s > 0):
        raise ValueError(f"target_s must be a positive number, got {target_s!r}")
    if per_mix < 1:
        raise ValueError(f"per_mix must be >= 1, got {per_mix}")
    rng = np.random.default_rng(seed)
    single = cost.replace(rank_speed=None, gpus_per_node=1, step_overhead_s=0.0)
    out = []
    for mix in mixes:
        codes = scaled_codes(mix, scale)
        lens = [x for r in sample_step(codes, rng, max_text_tokens=MAX_TEXT_TOKENS // scale) for x in r]
        total = float(single.compute(np.asarray(lens)).sum())
        ranks = int(np.clip(round(total / max(target_s - single.fixed_s, 1e-12)), 1, len(lens)))
        # Deal the sequences round-robin onto the ranks (homes do not matter for bags of one).
        homes = [lens[r::ranks] for r in range(ranks)]
        plan = plan_balance(homes, Topology((1,), ranks), single)
        picks = sorted({round(i) for i in np.linspace(0, ranks - 1, min(per_mix, ranks)).tolist()})
        for r in picks:
            batch = plan.seq_lens[plan.bag == r].tolist()
            if batch:
                out.append((f"{mix}#{r}", batch))
    return out


def mean_abs_error(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """Mean and worst absolute relative error of predictions against measurements."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if p.shape != m.shape or m.size == 0 or np.any(m <= 0):
        raise ValueError("need as many predictions as measurements, measurements > 0")
    e = np.abs(p - m) / m
    return float(e.mean()), float(e.max())
