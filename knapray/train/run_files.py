"""Files of a run directory that every launcher writes the same way: the corpus a run
needs (built only when the config asks for a synthetic one), and at the end
``summary.json``, ``ledger.jsonl``, ``quarantine.jsonl`` and the per-rank work plot."""

from __future__ import annotations

import json
import os

import numpy as np

from .config import TrainConfig


def ensure_corpus(cfg: TrainConfig) -> None:
    """Build the synthetic corpus if the config names a mix and it is missing."""
    if os.path.exists(os.path.join(cfg.data.corpus, "schema.json")):
        return
    if not cfg.data.build_mix:
        raise FileNotFoundError(
            f"corpus {cfg.data.corpus!r} not found (no schema.json) and data.build_mix is empty; "
            "build one with datasets/build_synthetic.py or set data.build_mix"
        )
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    build_synthetic(
        SyntheticConfig(
            mix=cfg.data.build_mix, steps=cfg.data.build_steps, scale=cfg.data.build_scale,
            channels=cfg.model.in_channels, text_dim=cfg.model.text_dim,
            pooled_dim=cfg.model.pooled_dim, seed=cfg.data.seed,
        ),
        cfg.data.corpus,
    )


def clear_stale_run_files(run_dir: str) -> None:
    """A fresh run under an old run's name: drop its per-step files (metrics, quarantine)."""
    for stale in os.listdir(run_dir):
        if stale == "metrics.jsonl" or stale.startswith("quarantine-"):
            os.remove(os.path.join(run_dir, stale))


def summarize(records: list[dict]) -> dict:
    """Run-level numbers from rank 0's per-step records (the first step is warm-up)."""
    if not records:
        return {"steps": 0}
    body = records[1:] if len(records) > 2 else records
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
    }


def write_run_files(cfg: TrainConfig, summary: dict) -> None:
    """summary.json, ledger.jsonl and a PNG of per-rank work before/after balancing."""
    run_dir = cfg.run_dir
    records = summary.get("records", [])
    out = {"config": cfg.to_dict(), "summary": summarize(records),
           "topology": summary.get("topology"), "world_size": summary.get("world_size"),
           "coordinator_stats": summary.get("coordinator_stats")}
    quarantined = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("quarantine-rank"):
            quarantined.extend(json.loads(line) for line in open(os.path.join(run_dir, name)) if line.strip())
    if quarantined:
        with open(os.path.join(run_dir, "quarantine.jsonl"), "w") as f:
            for q in sorted(quarantined, key=lambda q: (q["sample_id"] is None, q["sample_id"])):
                f.write(json.dumps(q) + "\n")
    out["quarantined"] = len(quarantined)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    ledger = summary.get("ledger")
    if ledger is not None:
        with open(os.path.join(run_dir, "ledger.jsonl"), "w") as f:
            for row in zip(*(np.asarray(ledger[k]).tolist() for k in ("step", "sample_id", "home_rank", "attempt"))):
                f.write(json.dumps(dict(zip(("step", "sample_id", "home_rank", "attempt"), row))) + "\n")
    if records:
        from knapray.plots import plot_rank_work

        plot_rank_work(
            os.path.join(run_dir, "rank_work.png"),
            [np.asarray(r["baseline_rank_work"]) for r in records],
            [np.asarray(r["rank_work"]) for r in records],
            [r["baseline_imbalance_planned"] for r in records],
            [r["imbalance_planned"] for r in records],
            title=f"{cfg.run.name}: {summary.get('topology')} on {summary.get('world_size')} workers",
        )
