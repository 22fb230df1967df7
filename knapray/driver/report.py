"""The run's report, read from its files: ``metrics.jsonl`` scanned (torn lines cut, a
resumed run's later steps dropped), the summary and its one-line prediction check,
``summary.json``, the merged ``ledger.jsonl`` and ``quarantine.jsonl``, and the per-rank
work plot. Rank 0's trainer and both launchers write and read it the same way."""

from __future__ import annotations

import json
import os

import numpy as np

from knapray.nofollow import open_nofollow

from knapray.config.run import TrainConfig
from knapray.worker.metrics import most_used_first, read_metrics
from knapray.run_files import RunDir


def summary_steps(records: list[dict]) -> list[dict]:
    """The steps a run's means are taken over: all but the first (warm-up) of three or more."""
    return records[1:] if len(records) > 2 else records


def run_title(cfg: TrainConfig, records: list[dict]) -> str:
    """What the run's steps ran on: its topologies (steps per topology when several), or,
    unbalanced, every rank its own samples (``g1n<world>``)."""
    world = records[-1]["world_size"]
    if not cfg.balance.enabled:
        return f"unbalanced, every rank computes its own samples (g1n{world}), {world} workers"
    topologies = distinct_topologies(records)
    shown = next(iter(topologies)) if len(topologies) == 1 else ", ".join(
        f"{t} ({n} steps)" for t, n in topologies.items())
    return f"balanced on {shown}, {world} workers"


def summarize(records: list[dict]) -> dict:
    """Run-level numbers from rank 0's per-step records (the first step is warm-up)."""
    if not records:
        return {"steps": 0}
    body = summary_steps(records)
    mean = lambda key: float(np.mean([r[key] for r in body]))  # noqa: E731
    return {
        "steps": len(records),
        "loss_first": records[0]["loss"],
        "loss_last": float(np.mean([r["loss"] for r in records[-3:]])),
        "imbalance_planned_before": mean("baseline_imbalance_planned"),
        "imbalance_planned_after": mean("imbalance_planned"),
        "compute_max_over_mean": mean("compute_max_over_mean"),
        "tokens_per_s": float(sum(r["tokens"] for r in body) / sum(r["step_s"] for r in body)),
        "step_s": mean("step_s"),
        "wait_plan_frac": mean("wait_plan_frac"),
        "comm_s_mean": float(np.mean([np.mean(r["comm_s"]) for r in body])),
        "planned_locally": int(sum(r["planned_by"] == "local" for r in records)),
        "topologies": distinct_topologies(records),
        "distinct_topologies": len(distinct_topologies(records)),
        **prediction_summary(records),
    }


def distinct_topologies(records: list[dict]) -> dict[str, int]:
    """Steps per topology the steps ran on, most used first (one entry for a static
    topology; with ``balance.topology: per-step`` every partition the steps chose)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r["topology"]] = counts.get(r["topology"], 0) + 1
    return most_used_first(counts)


PREDICTION_HEAD, PREDICTION_AFTER = 5, 20
"""The cost model's prediction error is averaged over a run's first ``PREDICTION_HEAD``
steps and over its steps after the first ``PREDICTION_AFTER`` (the live re-fit's)."""


def prediction_summary(records: list[dict]) -> dict:
    """Mean per-rank (``prediction_error``) and step-time (``step_prediction_error``)
    errors of the cost model's compute predictions over the first ``PREDICTION_HEAD``
    steps that have one (``planner: cost``: the configured model) and over those after
    the first ``PREDICTION_AFTER`` (the live fit; the last ``PREDICTION_HEAD`` if the run is
    shorter), with their step ranges; empty without predictions."""
    rows = [r for r in records if r.get("prediction_error") is not None]
    if not rows:
        return {}
    head = rows[:PREDICTION_HEAD]
    tail = rows[PREDICTION_AFTER:] or rows[-PREDICTION_HEAD:]
    mean = lambda rs, key: float(np.mean([r[key] for r in rs]))  # noqa: E731
    return {"prediction_error_first": mean(head, "prediction_error"),
            "prediction_error_last": mean(tail, "prediction_error"),
            "step_prediction_error_first": mean(head, "step_prediction_error"),
            "step_prediction_error_last": mean(tail, "step_prediction_error"),
            "prediction_steps_first": [head[0]["step"], head[-1]["step"]],
            "prediction_steps_last": [tail[0]["step"], tail[-1]["step"]]}


def prediction_line(s: dict) -> str:
    """One console line of ``prediction_summary``'s numbers."""
    (a, b), (c, d) = s["prediction_steps_first"], s["prediction_steps_last"]
    return (f"cost model vs measured compute: per rank off {s['prediction_error_first']:.1%} (steps {a}-{b}) -> "
            f"{s['prediction_error_last']:.1%} (steps {c}-{d}); step time off {s['step_prediction_error_first']:.1%} "
            f"-> {s['step_prediction_error_last']:.1%}")


def merge_quarantine(run_dir: str) -> list[dict]:
    """Every quarantine record of the run (per-rank files and the driver's shard check)
    in one ``quarantine.jsonl``: shards first, then samples by id; a shard reported by
    several ranks or several attempts is listed once."""
    records: list[dict] = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("quarantine-") and name.endswith(".jsonl"):
            with open_nofollow(os.path.join(run_dir, name)) as f:
                records.extend(json.loads(line) for line in f if line.strip())
    shards = {r["shard"]: r for r in records if "shard" in r}
    samples = {(r["sample_id"], r["reason"]): r for r in records if "shard" not in r}
    merged = [shards[k] for k in sorted(shards)] + [
        samples[k] for k in sorted(samples, key=lambda k: (k[0] is None, k[0] if k[0] is not None else 0, k[1]))]
    if merged:
        with open_nofollow(RunDir(run_dir).quarantine, "w") as f:
            for r in merged:
                f.write(json.dumps(r) + "\n")
    return merged


def write_run_files(cfg: TrainConfig, summary: dict) -> dict:
    """summary.json (over every step in metrics.jsonl, resumed attempts included),
    quarantine.jsonl, ledger.jsonl and a PNG of per-rank work before/after balancing.
    Returns the run-level summary."""
    run_dir = cfg.run_dir
    records = read_metrics(run_dir)
    quarantined = merge_quarantine(run_dir)
    out = {"config": cfg.to_dict(), "summary": summarize(records),
           "topology": summary.get("topology"), "world_size": summary.get("world_size"),
           "coordinator_stats": summary.get("coordinator_stats"),
           "quarantined_samples": sum("shard" not in q for q in quarantined),
           "quarantined_shards": sum("shard" in q for q in quarantined),
           "quarantined_shard_rows": sum(q.get("rows") or 0 for q in quarantined if "shard" in q)}
    from knapray.worker.ledger_files import unrecorded_steps, write_ledger_jsonl

    out["ledger_rows"] = write_ledger_jsonl(run_dir, RunDir(run_dir).ledger)
    out["ledger_missing_steps"] = unrecorded_steps(run_dir, (r["step"] for r in records))
    with open_nofollow(RunDir(run_dir).summary, "w") as f:
        json.dump(out, f, indent=1, default=str)
    # Per-rank pictures need one world size: an elastic run plots its last one.
    records = [r for r in records if r["world_size"] == records[-1]["world_size"]] if records else []
    if records:
        from knapray.driver.plots import plot_rank_work

        body = summary_steps(records)
        plot_rank_work(
            RunDir(run_dir).rank_work_plot,
            [np.asarray(r["baseline_rank_work"]) for r in body],
            [np.asarray(r["rank_work"]) for r in body],
            [r["baseline_imbalance_planned"] for r in body],
            [r["imbalance_planned"] for r in body],
            title=f"{cfg.run.name}: {run_title(cfg, records)}",
            run_label="balanced (knapray plan)" if cfg.balance.enabled else "unbalanced (this run)",
            measured_compute=[np.asarray(r["compute_s"]) for r in body],
            steps=[r["step"] for r in body],
            note="step 0 (warm-up) left out, as in summary.json" if len(body) < len(records) else "",
        )
    return out


def comparison_lines(rows: list[tuple[str, dict]], balanced: dict, unbalanced: dict | None) -> list[str]:
    """``--compare-unbalanced``'s table: a line per run (its summary), then, with both runs,
    whether they computed the same function and the balanced run's ratios."""
    out = [f"\n{'run':<11} {'steps':>5} {'loss first->last':>17} {'planned imbalance':>18} "
           f"{'compute max/mean':>16} {'tokens/s':>9} {'plan wait':>9}"]
    for name, r in rows:
        out.append(f"{name:<11} {r['steps']:>5} {r['loss_first']:>8.4f}->{r['loss_last']:<8.4f} "
                   f"{r['imbalance_planned_after']:>18.3f} {r['compute_max_over_mean']:>16.2f} "
                   f"{r['tokens_per_s']:>9.0f} {r['wait_plan_frac']:>8.1%}")
    if unbalanced is not None and len(rows) == 2:
        b, u = rows[0][1], rows[1][1]
        lb = [r["loss"] for r in balanced.get("records", [])]
        lu = [r["loss"] for r in unbalanced.get("records", [])]
        if lb and len(lb) == len(lu):
            diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(lb, lu))
            out.append(f"same function: per-step losses of the two runs differ by at most {diff:.1e} (relative)")
        out.append(f"balanced vs unbalanced: compute max/mean {u['compute_max_over_mean']:.2f} -> "
                   f"{b['compute_max_over_mean']:.2f} (x{u['compute_max_over_mean'] / b['compute_max_over_mean']:.2f}), "
                   f"planned imbalance {b['imbalance_planned_before']:.2f} -> {b['imbalance_planned_after']:.3f}, "
                   f"tokens/s x{b['tokens_per_s'] / u['tokens_per_s']:.2f} (wall clock; on a CPU box the "
                   "workers share cores, so compute max/mean is the number that transfers to GPUs)")
    return out


def plot_comparison(cfg: TrainConfig, base_cfg: TrainConfig, balanced: dict) -> None:
    """comparison.png: both runs' per-step planned and measured max/mean, and their measured
    per-rank compute, over the steps the table's means are taken over."""
    from knapray.driver.plots import plot_run_comparison

    b, u = read_metrics(cfg.run_dir), read_metrics(base_cfg.run_dir)
    if not b or not u:
        return
    topologies = balanced["run"]["summary"].get("topologies") or {}
    on = next(iter(topologies)) if len(topologies) == 1 else f"{len(topologies)} topologies"
    plot_run_comparison(
        RunDir(cfg.run_dir).comparison_plot,
        [(f"balanced ({on})", summary_steps(b)),
         (f"unbalanced (g1n{u[-1]['world_size']})", summary_steps(u))],
        title=f"{cfg.run.name}: the same {len(u)} steps balanced and unbalanced, {u[-1]['world_size']} workers",
        note="the legend's means are the table's 'planned imbalance' (dashed) and 'compute max/mean' (solid)"
        + ("; step 0 (warm-up) left out, as in the table" if len(summary_steps(b)) < len(b) else ""),
    )


def ledger_line(run: dict) -> str | None:
    """One line when the ledger lacks steps the run trained (``write_run_files``); None when
    it holds them all."""
    missing = run.get("ledger_missing_steps") or []
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (f"the ledger has no rows of {len(missing)} trained step(s) ({shown}): which samples they trained is not "
            "recorded, so a resume could train them again; ledger.jsonl and summary.json say what it holds")


def quarantine_line(run: dict) -> str:
    n = run["quarantined_samples"] + run["quarantined_shards"]
    if not n:
        return "nothing quarantined"
    return (f"quarantined: {run['quarantined_samples']} sample(s), {run['quarantined_shards']} shard(s) "
            f"({run['quarantined_shard_rows']} rows); see quarantine.jsonl")


def steps_per_epoch(cfg: TrainConfig, rows: int) -> int:
    """Steps of one pass over ``rows`` corpus rows: every rank draws samples_per_step rows
    per step until the epoch's rows run out."""
    return -(-rows // (cfg.scaling.num_workers * cfg.samples_per_rank(cfg.scaling.num_workers)))


def steps_line(cfg: TrainConfig, rows: int) -> str:
    """How long the run is, from the corpus's size: its steps, and its epochs of ``rows``
    samples (said by pre-flight)."""
    per_epoch = steps_per_epoch(cfg, rows)
    batch = f"{rows} samples, {cfg.scaling.num_workers * cfg.samples_per_rank(cfg.scaling.num_workers)} a step"
    if not cfg.data.epochs:
        return (f"{cfg.run.max_steps} steps (run.max_steps; data.epochs=0): about "
                f"{cfg.run.max_steps / max(per_epoch, 1):.3g} epochs of {batch}")
    return (f"about {expected_steps(cfg, rows, 0)} steps: data.epochs={cfg.data.epochs} of {batch} "
            f"({per_epoch} steps an epoch)")


def run_length_note(cfg: TrainConfig, rows: int) -> str | None:
    """A line when the run's length is not what its config reads as (None when it is): said
    when the run starts, and again when it ends (``stopped_early_line``).

    ``run.max_steps`` ends the run before ``data.epochs`` are done; or the epochs end it far
    short of ``run.max_steps`` (a small corpus: 12 pictures at 8 a step are 2 steps an
    epoch), where ``data.epochs=0`` trains ``run.max_steps`` steps."""
    per_epoch = steps_per_epoch(cfg, rows)
    epochs, max_steps = cfg.data.epochs, cfg.run.max_steps
    if not max_steps or not per_epoch or not epochs:
        return None
    if max_steps < per_epoch * epochs:
        return (f"run.max_steps={max_steps} ends the run before data.epochs={epochs} are done: an epoch of {rows} "
                f"samples is about {per_epoch} steps, so it trains about {max_steps / per_epoch:.2g} epoch(s); set "
                "run.max_steps=0 to train every epoch")
    if 2 * per_epoch * epochs <= max_steps:
        return (f"data.epochs={epochs} ends the run after about {per_epoch * epochs} steps, far short of "
                f"run.max_steps={max_steps}: an epoch of {rows} samples is about {per_epoch} steps; set data.epochs=0 "
                f"to train run.max_steps steps (about {max_steps / per_epoch:.3g} epochs)")
    return None


def stopped_early_line(cfg: TrainConfig, summary: dict) -> str | None:
    """At the end: the run stopped at ``run.max_steps`` with epochs left (the trainer's
    summary says in which epoch it was)."""
    epoch = summary.get("epoch")
    if not cfg.run.max_steps or not cfg.data.epochs or epoch is None or int(epoch) >= cfg.data.epochs:
        return None
    return (f"stopped by run.max_steps={cfg.run.max_steps} in epoch {int(epoch) + 1} of data.epochs="
            f"{cfg.data.epochs}; set run.max_steps=0 (or higher) and run it again to train the rest")


def expected_steps(cfg: TrainConfig, rows: int, start_step: int) -> int:
    """Steps the run will take, for the progress bar: every rank draws samples_per_step
    rows per step until the epoch's rows run out, over the epochs left, up to max_steps."""
    total = steps_per_epoch(cfg, rows) * cfg.data.epochs if cfg.data.epochs else cfg.run.max_steps
    if cfg.run.max_steps:
        total = min(total, cfg.run.max_steps)
    return max(total - start_step, 0)


class ProgressTail:
    """A progress bar on the driver over the run's steps, fed by rank 0's metrics.jsonl
    (workers' own output stays in their log files), with a line when an epoch ends."""

    def __init__(self, path: str, total: int, name: str, start_step: int) -> None:
        import threading

        self.path, self.total, self.name, self.start_step = path, total, name, start_step
        # The lines there now are the steps before this call's first (pre-flight dropped any
        # later ones): the tail reads from their end.
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProgressTail":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from knapray.progress import progress_bar

        bar = progress_bar(self.total, self.name, "step", dynamic_ncols=True)
        bar.write(f"[knapray] waiting for step {self.start_step}: Ray starts the workers, they read the corpus and "
                  "build the model (compiled blocks compile at their first step)")
        offset, last_step, epoch = self._offset, self.start_step - 1, None
        while True:
            stopping = self._stop.wait(0.5)
            if os.path.exists(self.path):
                if os.path.getsize(self.path) < offset:
                    # A restarted worker group rewrote the file back to its checkpoint:
                    # read it again, and count only steps the bar has not shown.
                    offset = 0
                    if last_step >= self.start_step:
                        bar.write("[knapray] workers restarted from the last checkpoint")
                with open(self.path) as f:
                    f.seek(offset)
                    chunk = f.read()
                lines = chunk.split("\n")
                offset += len(chunk) - len(lines[-1])  # keep a partly written last line
                for line in lines[:-1]:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if r["step"] <= last_step:  # an earlier attempt's, or redone after a restart
                        continue
                    last_step = r["step"]
                    if epoch is not None and r["epoch"] != epoch:
                        bar.write(f"[knapray] epoch {epoch} done at step {r['step'] - 1}")
                    epoch = r["epoch"]
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{r['loss']:.3f}",
                        imb=f"{r['baseline_imbalance_planned']:.2f}->{r['imbalance_planned']:.3f}",
                        cmp=f"{r['compute_max_over_mean']:.2f}",
                        tok_s=f"{r['tokens_per_s']:.0f}",
                    )
            if stopping:
                break
        if bar.n != self.total:  # the estimate was off (quarantined rows, an elastic resize)
            bar.total = bar.n
            bar.refresh()
        bar.close()
