"""The run directory, handled the same way by every launcher: where it is (never inside
Ray's upload folder), whether a run starts fresh or resumes (``checkpoint.resume``), the lock
that keeps a second live run out, the saved config, and at the end ``summary.json``,
``ledger.jsonl``, ``quarantine.jsonl`` and the per-rank work plot."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, replace

import numpy as np

from .config import TrainConfig


RESUME_MODES = ("auto", "never", "must")
CONFIG_FILE = "config.json"
LOCK_FILE = "RUNNING.lock"
LEDGER_DIR = "ledger"
RESUME_KEYS = ("model", "data.corpus", "data.samples_per_step", "data.global_batch", "data.seed")
"""Config values a resumed run must share with the run it continues: the model's shape
and the data order. Anything else (learning rate, step limits, topology, world size...)
may change on resume, and the resume line names what did."""
RAY_UPLOAD_MARKER = os.path.join("runtime_resources", "working_dir_files")
DEFAULT_JOB_STORAGE = "~/knapray/runs"
"""Where a relative run.storage goes when the job runs inside Ray's upload folder."""


class RunError(ValueError):
    """A run cannot start as configured; the message names the value and what is valid."""


def inside_ray_upload(path: str) -> bool:
    """True for a path under the folder ``ray job submit --working-dir`` unpacked (which
    Ray may delete, and which holds no gitignored data)."""
    return RAY_UPLOAD_MARKER in os.path.abspath(path)


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """Absolute storage and corpus paths, resolved on the driver (workers run elsewhere).

    Inside a ``ray job submit`` upload folder a relative ``run.storage`` would put the run
    directory into Ray's temporary files: it goes to ``$KNAPRAY_STORAGE`` or
    ``~/knapray/runs`` instead. A relative ``data.corpus`` there must exist (a
    gitignored corpus is not uploaded): see ``check_corpus``."""
    storage = cfg.run.storage
    if not os.path.isabs(storage) and inside_ray_upload(os.getcwd()):
        storage = os.path.join(os.path.expanduser(os.environ.get("KNAPRAY_STORAGE", DEFAULT_JOB_STORAGE)), storage)
    model = cfg.model
    if model.pretrained:  # workers run elsewhere: an absolute path (it must be on storage every node reads)
        model = replace(model, pretrained=os.path.abspath(os.path.expanduser(model.pretrained)))
    return replace(
        cfg,
        model=model,
        data=replace(cfg.data, corpus=os.path.abspath(cfg.data.corpus)),
        run=replace(cfg.run, storage=os.path.abspath(os.path.expanduser(storage))),
    )


MAX_CONFIG_BYTES = 16 << 20


def saved_config(run_dir: str) -> dict | None:
    """The run directory's ``config.json`` (None if it has none): an object of sections,
    each an object, as ``write_config`` writes it; else ``RunError`` naming the file."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES >> 20} MiB")
        doc = json.loads(data.decode("utf-8"))
    except OSError as e:
        raise RunError(f"run file {path} cannot be read: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise RunError(f"run file {path} is not JSON ({e}): restore it, or choose another run.name") from None
    if not isinstance(doc, dict):
        raise RunError(f"run file {path} holds a {type(doc).__name__}, not a knapray config object: restore it, "
                       "or choose another run.name")
    defaults = TrainConfig().to_dict()
    for section, value in doc.items():
        if section in defaults and isinstance(defaults[section], dict) and not isinstance(value, dict):
            raise RunError(f"run file {path}: section {section!r} is {str(value)[:60]!r}, not an object: restore "
                           "it, or choose another run.name")
    from .config import from_saved_layout

    return from_saved_layout(doc)  # a run written before the run section was split reads as today's


def run_checkpoint(run_dir: str, checkpoint: str | None, purpose: str) -> str:
    """``checkpoint``, or the run's newest complete one: a directory with DCP metadata;
    ValueError naming the flag otherwise (``purpose``: what it is for, e.g. "export")."""
    from .checkpoint import completed_checkpoints

    done = completed_checkpoints(os.path.join(run_dir, "checkpoints"))
    path = checkpoint or (done[-1] if done else None)
    if path is None:
        raise ValueError(f"--run {run_dir}: no complete checkpoint to {purpose}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"--checkpoint {path}: not a checkpoint directory (no .metadata)")
    return path


def read_run_config(run_dir: str) -> TrainConfig:
    """The config a finished or running run was trained with (``knapray sample``,
    ``knapray export``): its ``config.json`` checked as ``saved_config`` does, then as a
    config file is; ``RunError`` in one line naming the directory or the file."""
    from .config import config_from_dict

    doc = saved_config(run_dir)
    if doc is None:
        raise RunError(f"--run {run_dir}: no {CONFIG_FILE} there; is it a knapray run directory?")
    try:
        return config_from_dict(doc)
    except ValueError as e:
        raise RunError(f"run file {os.path.join(run_dir, CONFIG_FILE)}: {e}") from None


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key.count(".") < 1:
            out.update(_flat(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def config_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(keys that forbid a resume, other keys that changed), as ``key: old -> new``. A key
    the old config lacks that is at its default now is no change: a field added to knapray
    since the run was saved (e.g. ``model.family``) must not block resuming it."""
    a, b = _flat(old), _flat(json.loads(json.dumps(new)))
    defaults = _flat(json.loads(json.dumps(TrainConfig().to_dict())))
    blocking, other = [], []
    for key in sorted(set(a) | set(b)):
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            (blocking if any(key == k or key.startswith(k + ".") for k in RESUME_KEYS) else other).append(line)
    return blocking, other


@dataclass(frozen=True)
class RunStart:
    resume_from: str | None
    """The checkpoint directory to resume from (None: a fresh run)."""
    message: str
    torn_metrics: str | None = None
    """A resume's warning that metrics.jsonl ends in a torn line, which ``cut_torn_metrics``
    drops (None: it does not)."""


def decide_start(cfg: TrainConfig, checkpoints: list[str]) -> RunStart:
    """Fresh run or resume, by ``checkpoint.resume`` (auto | never | must), before workers start.

    never: an existing run directory is an error naming it. must: there must be a
    checkpoint to resume from. auto: resume the newest complete checkpoint if the saved
    config is compatible (else an error listing what differs); start fresh if there is
    none."""
    run_dir, mode = cfg.run_dir, cfg.checkpoint.resume
    if mode not in RESUME_MODES:
        raise RunError(f"checkpoint.resume {mode!r}: valid values are {', '.join(RESUME_MODES)}")
    exists = os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    if mode == "never" and exists:
        raise RunError(f"run directory {run_dir} already exists (checkpoint.resume=never): choose another run.name, "
                       "remove the directory, or set checkpoint.resume=auto to continue it")
    if mode == "must" and not checkpoints:
        raise RunError(f"checkpoint.resume=must but {run_dir} holds no complete checkpoint to resume from")
    if not checkpoints:
        return RunStart(None, f"starting run {cfg.run.name!r} in {run_dir}")
    old = saved_config(run_dir)
    if old is None:
        raise RunError(f"run directory {run_dir} has checkpoints but no {CONFIG_FILE}; it was not written by "
                       "this knapray: choose another run.name")
    blocking, other = config_changes(old, cfg.to_dict())
    if blocking:
        raise RunError(f"cannot resume run {cfg.run.name!r} in {run_dir}: its saved config "
                       f"({os.path.join(run_dir, CONFIG_FILE)}) differs in {'; '.join(blocking)}; choose another "
                       "run.name for a new run")
    check_resumable(run_dir, checkpoints[-1])
    torn = scan_metrics(run_dir).torn
    changed = f" (changed: {'; '.join(other)})" if other else ""
    return RunStart(checkpoints[-1], f"resuming run {cfg.run.name!r} from {checkpoints[-1]}{changed}", torn)


def check_writable(run_dir: str) -> None:
    """The run directory can be written, checked without writing anything (pre-flight, before
    Ray starts): it and its ``checkpoints`` and ``ledger`` folders are folders where they
    exist, and it, or the nearest folder above it that exists, is writable (a read-only
    or unwritable ``run.storage`` is refused here, not by a worker)."""
    for path in (run_dir, os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, LEDGER_DIR)):
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RunError(f"run directory {run_dir}: {path} is not a folder; remove it or choose another "
                           "run.storage / run.name")
    existing = run_dir
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunError(f"run.storage: {existing} is not a folder, so the run directory {run_dir} cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(existing) else "is not writable by this user"
        raise RunError(f"run.storage: {existing} {why}, so the run directory {run_dir} cannot be written; give "
                       "run.storage a writable folder")


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_resumable(run_dir: str, checkpoint: str) -> None:
    """What a resume from ``checkpoint`` reads, checked before any worker starts: its
    trainer state and DCP metadata (nothing a planted file names is run), and the ledger
    journal holding every step the checkpoint covers."""
    from knapray.coordinator.store import LedgerFileError

    from .checkpoint import RUN_STATE, CheckpointError, check_checkpoint
    from .ledger_files import LedgerBehind, check_covers, ledger_dir, read_ledger

    try:
        trainer = check_checkpoint(checkpoint, RUN_STATE)
        ledger = read_ledger(run_dir)
        try:
            check_covers(ledger, trainer.get("ledger"), checkpoint, ledger_dir(run_dir))
        finally:
            if ledger is not None:
                ledger.close()
    except (CheckpointError, LedgerBehind, LedgerFileError) as e:
        raise RunError(str(e)) from None


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """The config fits a world of ``world_size`` ranks: the global batch splits over it,
    a concrete topology covers it, and every bag size divides the head count (a per-step
    topology: the world is whole nodes)."""
    from knapray.planning.rules import parse_rule, per_step_node
    from knapray.distributed.groups import check_heads
    from knapray.planning import Topology

    try:
        cfg.samples_per_rank(world_size)
        gpn = cfg.balance.gpus_per_node
        if cfg.parallel.fsdp == "hybrid" and (not gpn or world_size % gpn):
            raise ValueError(f"parallel.fsdp=hybrid shards within a node: balance.gpus_per_node must be set and divide "
                             f"the world size, got gpus_per_node={gpn}")
        kind, _ = parse_rule(cfg.balance.topology)
        per_step_node(cfg.balance.topology, world_size, gpn or None)  # whole nodes
        if kind == "spec":
            topo = Topology.parse(cfg.balance.topology, world_size=world_size)
            check_heads(cfg.model.num_heads, topo)
    except ValueError as e:
        raise RunError(f"{e} (world of {world_size} ranks)") from None


def write_config(cfg: TrainConfig) -> None:
    os.makedirs(cfg.run_dir, exist_ok=True)
    tmp = os.path.join(cfg.run_dir, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    os.replace(tmp, os.path.join(cfg.run_dir, CONFIG_FILE))


class RunLock:
    """``RUNNING.lock`` in the run directory, created exclusively: a second live run with
    the same name is refused. A lock left by a dead process on this host is taken over."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.held = False

    def check_free(self) -> None:
        """Raise ``RunError`` if a live run holds the lock (taking nothing: pre-flight)."""
        owner = self._owner() if os.path.exists(self.path) else None
        if owner is not None and not self._stale(owner):
            raise RunError(
                f"run directory {os.path.dirname(self.path)} is in use by a live run (pid {owner.get('pid')} "
                f"on {owner.get('host')} since {owner.get('started')}); wait for it or choose another run.name"
            )

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self.check_free()
                os.remove(self.path)  # unreadable, or its process is gone: take it over
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunError(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _stale(owner: dict) -> bool:
        if owner.get("host") != socket.gethostname():
            return False  # another machine's process: cannot tell, assume alive
        try:
            os.kill(int(owner.get("pid", -1)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, TypeError):
            return False
        return False


STALE_FILES = ("metrics.jsonl", "summary.json", "ledger.jsonl", "quarantine.jsonl", "rank_work.png")
STALE_DIRS = (LEDGER_DIR, "pids")


def clear_stale_run_files(run_dir: str) -> None:
    """A fresh run in a directory without checkpoints: drop what an earlier, unfinished
    run there left (metrics, quarantine, ledger journal, summary)."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name in STALE_FILES or name.startswith("quarantine-"):
            os.remove(path)
        elif name in STALE_DIRS:
            shutil.rmtree(path)


METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class MetricsScan:
    """``metrics.jsonl`` read and checked (``scan_metrics``)."""

    records: list[dict]
    torn_at: int | None = None
    """Byte offset of a torn last line (None: there is none)."""
    torn: str | None = None
    """One line saying so, naming the file."""


def scan_metrics(run_dir: str) -> MetricsScan:
    """Rank 0's step records. A last line without its newline that is not a record is torn
    (a crash mid-append leaves exactly that): left out, and reported in ``torn``; it is the
    writer's to cut (``cut_torn_metrics``, ``truncate_metrics``). Any other line that is not
    a JSON object with integer ``step`` and ``epoch`` is ``RunError`` naming the file and
    the line: every reader (the resume's rewrite, the step count, summary.json) needs them."""
    path = os.path.join(run_dir, METRICS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return MetricsScan([])
    except OSError as e:
        raise RunError(f"run file {path}: cannot be read ({e.strerror})") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with its newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, why = _metrics_record(line)
        if why is not None:
            raise RunError(f"run file {path}: line {number} is not a step record ({why}); fix or delete that line "
                           "(the steps it held then go uncounted in summary.json)")
        records.append(record)
    if tail.strip():
        record, why = _metrics_record(tail)
        if why is None:  # whole but for its newline: the next rewrite adds it
            records.append(record)
        else:
            return MetricsScan(records, len(data) - len(tail),
                               f"run file {path}: dropped a torn last line {len(lines) + 1} ({len(tail)} bytes, "
                               f"{why}), as a crash while writing it leaves it")
    return MetricsScan(records)


def _metrics_record(line: bytes) -> tuple[dict | None, str | None]:
    """(the record, None) or (None, why the line is not one)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not JSON"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    for key in ("step", "epoch"):
        value = record.get(key)
        if type(value) is not int or value < 0:
            return None, f"{key} is {value!r}" if key in record else f"no {key}"
    return record, None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of ``metrics.jsonl`` (``scan_metrics``: a torn last line left out)."""
    return scan_metrics(run_dir).records


def cut_torn_metrics(run_dir: str) -> None:
    """Cut a torn last line off ``metrics.jsonl`` (before rank 0 appends after it)."""
    torn_at = scan_metrics(run_dir).torn_at
    if torn_at is not None:
        os.truncate(os.path.join(run_dir, METRICS_FILE), torn_at)


def truncate_metrics(run_dir: str, from_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their old lines (and a torn
    last line a worker killed mid-append left)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return
    keep = [r for r in scan_metrics(run_dir).records if r["step"] < from_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


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


def most_used_first(counts: dict[str, int]) -> dict[str, int]:
    """``{topology: steps}`` ordered by steps, most first (ties by name)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


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
            with open(os.path.join(run_dir, name)) as f:
                records.extend(json.loads(line) for line in f if line.strip())
    shards = {r["shard"]: r for r in records if "shard" in r}
    samples = {(r["sample_id"], r["reason"]): r for r in records if "shard" not in r}
    merged = [shards[k] for k in sorted(shards)] + [
        samples[k] for k in sorted(samples, key=lambda k: (k[0] is None, k[0] if k[0] is not None else 0, k[1]))]
    if merged:
        with open(os.path.join(run_dir, "quarantine.jsonl"), "w") as f:
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
    from .ledger_files import write_ledger_jsonl

    out["ledger_rows"] = write_ledger_jsonl(run_dir, os.path.join(run_dir, "ledger.jsonl"))
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    # Per-rank pictures need one world size: an elastic run plots its last one.
    records = [r for r in records if r["world_size"] == records[-1]["world_size"]] if records else []
    if records:
        from knapray.train.plots import plot_rank_work

        body = summary_steps(records)
        plot_rank_work(
            os.path.join(run_dir, "rank_work.png"),
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
