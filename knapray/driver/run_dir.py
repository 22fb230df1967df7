"""The run directory, handled the same way by every launcher: where it is (never inside
Ray's upload folder), whether a run starts fresh or resumes (``checkpoint.resume``), the lock
that keeps a second live run out, and the saved config. The run's report at the end
(``summary.json``, ``ledger.jsonl``, ``quarantine.jsonl``, plots) is ``report.py``; every
check before a worker starts is ``preflight.py``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, replace

from knapray.files import read_json
from knapray.nofollow import PlantedLink, open_nofollow, refuse_links

from knapray.run_files import CONFIG_FILE, STALE_DIRS, STALE_FILES, RunDir, RunError

from knapray.config.run import TrainConfig


RESUME_MODES = ("auto", "never", "must")
RESUME_KEYS = ("model", "data.corpus", "data.samples_per_step", "data.global_batch", "data.seed",
               "flow.expert_boundary")
"""Config values a resumed run must share with the run it continues: the model's shape,
its experts (one model, or two split at a boundary: their checkpoint parts) and the data order. Anything else (learning rate, step limits, topology, world size...)
may change on resume, and the resume line names what did."""
RAY_UPLOAD_MARKER = os.path.join("runtime_resources", "working_dir_files")
DEFAULT_JOB_STORAGE = "~/knapray/runs"
"""Where a relative run.storage goes when the job runs inside Ray's upload folder."""


def inside_ray_upload(path: str) -> bool:
    """True for a path under the folder ``ray job submit --working-dir`` unpacked (which
    Ray may delete, and which holds no gitignored data)."""
    return RAY_UPLOAD_MARKER in os.path.abspath(path)


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """Absolute storage and corpus paths, resolved on the driver (workers run elsewhere).

    Inside a ``ray job submit`` upload folder a relative ``run.storage`` would put the run
    directory into Ray's temporary files: it goes to ``$KNAPRAY_STORAGE`` or
    ``~/knapray/runs`` instead; a storage that still lies in that folder (an empty or
    relative ``$KNAPRAY_STORAGE``, an absolute ``run.storage`` there) is ``RunError``. A
    relative ``data.corpus`` there must exist (a gitignored corpus is not uploaded): see
    ``check_corpus``."""
    storage = cfg.run.storage
    if not os.path.isabs(storage) and inside_ray_upload(os.getcwd()):
        storage = os.path.join(os.path.expanduser(os.environ.get("KNAPRAY_STORAGE", DEFAULT_JOB_STORAGE)), storage)
    storage = os.path.abspath(os.path.expanduser(storage))
    if inside_ray_upload(storage):
        given = os.environ.get("KNAPRAY_STORAGE")
        why = (f"$KNAPRAY_STORAGE={given!r} is not an absolute folder" if given is not None and not
               os.path.isabs(os.path.expanduser(given)) else f"run.storage={cfg.run.storage!r} lies in it")
        raise RunError(f"run.storage: {storage} is inside the folder ray job submit uploaded, which Ray deletes when "
                       f"the job ends ({why}): give run.storage, or $KNAPRAY_STORAGE, an absolute folder outside it "
                       "(on storage every node can write)")
    model = cfg.model
    if model.pretrained:  # workers run elsewhere: an absolute path (it must be on storage every node reads)
        model = replace(model, pretrained=os.path.abspath(os.path.expanduser(model.pretrained)))
    return replace(
        cfg,
        model=model,
        data=replace(cfg.data, corpus=os.path.abspath(cfg.data.corpus)),
        run=replace(cfg.run, storage=storage),
    )


MAX_SAVED_CONFIG_BYTES = 16 << 20
"""A run directory's ``config.json`` is a few KB (more with a long ``balance.cost`` or list
of validation captions); a larger file is not one. A YAML config file a user writes has its
own bound (``knapray.config.run.MAX_CONFIG_FILE_BYTES``)."""
RUN_FORMAT = 2
"""The run directory format this knapray writes and reads: ``format_version`` in its
``config.json``. 2: the collective timeout and gloo's network interface are in the
``distributed`` section (they were ``run.timeout_s``, ``run.gloo_socket_ifname``). A
config.json without ``format_version`` is format 1. A run of another format is refused in
one line, never read as this one."""


def saved_config(run_dir: str) -> dict | None:
    """The run directory's ``config.json`` (None if it has none) as ``write_config`` writes
    it: ``format_version`` ``RUN_FORMAT`` and an object of sections, each an object (the
    sections are returned); else ``RunError`` naming the file, never quoting what it holds.
    A symbolic link there is refused, its target never opened."""
    path = RunDir(run_dir).config
    if not os.path.lexists(path):
        return None
    doc = read_json(path, MAX_SAVED_CONFIG_BYTES, "run file", RunError, advice="restore it, or choose another run.name",
                    follow_links=False)
    given = "format_version" in doc
    version = doc.pop("format_version", 1)
    if type(version) is not int or version != RUN_FORMAT:
        which = ("written by an earlier knapray (no format_version: run format 1)" if not given else
                 f"run format {version}" if type(version) is int and 0 <= version < 1 << 20 else
                 f"format_version is {_kind(version)}, not a run format number")
        raise RunError(f"run file {path}: {which}; this knapray reads run format {RUN_FORMAT} only: continue that "
                       "run with the knapray that wrote it, or choose another run.name")
    defaults = TrainConfig().to_dict()
    for section, value in doc.items():
        if section in defaults and isinstance(defaults[section], dict) and not isinstance(value, dict):
            raise RunError(f"run file {path}: section {section!r} is {_kind(value)}, not an object: restore "
                           "it, or choose another run.name")
    return doc


def _kind(value: object) -> str:
    """What a value read from a run file is, without its content: "a str", "a list", "null"."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def refuse_run_links(run_dir: str) -> None:
    """``RunError`` in one line if the run directory is a symbolic link or holds one
    (knapray makes none there, so one was planted: ``knapray.nofollow``); ``run.storage``
    above it may be one (a user's ``runs -> /scratch/runs``)."""
    if os.path.islink(run_dir):
        raise RunError(f"run directory {PlantedLink(run_dir, 'a run directory')}; give run.storage the real folder, "
                       "or choose another run.name")
    try:
        refuse_links(run_dir)
    except PlantedLink as e:
        raise RunError(f"run directory {run_dir}: {e}") from None


def run_checkpoint(run_dir: str, checkpoint: str | None, purpose: str) -> str:
    """``checkpoint``, or the run's newest complete one: a directory with DCP metadata;
    ValueError naming the flag otherwise (``purpose``: what it is for, e.g. "export")."""
    from knapray.worker.checkpoint import completed_checkpoints

    done = completed_checkpoints(RunDir(run_dir).checkpoints)
    path = checkpoint or (done[-1] if done else None)
    if path is None:
        raise ValueError(f"--run {run_dir}: no complete checkpoint to {purpose}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"--checkpoint {path}: not a checkpoint directory (no .metadata)")
    return path


def read_run_config(run_dir: str) -> TrainConfig:
    """The config a finished or running run was trained with (``knapray sample``,
    ``knapray export``): its ``config.json`` checked as ``saved_config`` does, then as a
    config file is; ``RunError`` in one line naming the directory or the file. A run
    directory that is, or holds, a symbolic link is refused before anything is read."""
    refuse_run_links(run_dir)
    doc = saved_config(run_dir)
    if doc is None:
        raise RunError(f"--run {run_dir}: no {CONFIG_FILE} there; is it a knapray run directory?")
    return _saved_as_config(doc, run_dir)


def _saved_as_config(doc: dict, run_dir: str) -> TrainConfig:
    """A saved config (``saved_config``) checked as a config file is: ``RunError`` naming the
    file and the key, not the value it holds."""
    from knapray.config.run import config_from_dict

    try:
        return config_from_dict(doc)
    except ValueError as e:
        raise RunError(f"run file {RunDir(run_dir).config}: {_failing_key(e)} is not what this knapray reads (a run "
                       "file may hold anything: its value is not repeated here); restore it, or choose another "
                       "run.name") from None


def _failing_key(error: ValueError) -> str:
    """The dotted key a config error names ("config model.hidden_size"), without the value
    it quotes: every ``ConfigError`` starts with it."""
    head = str(error).split(":", 1)[0]
    return head if head.startswith("config") and len(head) <= 120 and "'" not in head else "its config"


NESTED_SECTIONS = ("model.lora", "metrics.validation")
"""Sections inside a section (flattened to their keys); other dict values (``balance.cost``)
are one value."""


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and (key.count(".") < 1 or key in NESTED_SECTIONS):
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
    """A resume's warning that metrics.jsonl ends in a torn line, which ``truncate_metrics``
    drops (None: it does not)."""


def decide_start(cfg: TrainConfig, checkpoints: list[str]) -> RunStart:
    """Fresh run or resume, by ``checkpoint.resume`` (auto | never | must), before workers start.

    never: an existing run directory is an error naming it. must: there must be a
    checkpoint to resume from. auto: resume the newest complete checkpoint if the saved
    config is compatible (else an error listing what differs); start fresh if there is
    none."""
    run_dir, mode = cfg.run_dir, cfg.checkpoint.resume
    refuse_run_links(run_dir)
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
    _saved_as_config(old, run_dir)  # only values a config may hold are compared (and named) below
    blocking, other = config_changes(old, cfg.to_dict())
    if blocking:
        raise RunError(f"cannot resume run {cfg.run.name!r} in {run_dir}: its saved config "
                       f"({RunDir(run_dir).config}) differs in {'; '.join(blocking)}; choose another "
                       "run.name for a new run")
    trainer = check_resumable(run_dir, checkpoints[-1])
    check_lora_base(cfg, trainer, checkpoints[-1])
    from knapray.worker.metrics import scan_metrics

    torn = scan_metrics(run_dir).torn
    changed = f" (changed: {'; '.join(other)})" if other else ""
    return RunStart(checkpoints[-1], f"resuming run {cfg.run.name!r} from {checkpoints[-1]}{changed}", torn)


def check_writable(run_dir: str) -> None:
    """The run directory can be written, before Ray starts: neither it nor anything below it
    is a symbolic link (``refuse_run_links``), it and
    its ``checkpoints`` and ``ledger`` folders are folders where they exist, and it, or the
    nearest folder above it that exists, takes a new file (one is created and removed:
    ``os.access`` says yes to root on /proc or a read-only bind mount)."""
    refuse_run_links(run_dir)
    for path in (run_dir, RunDir(run_dir).checkpoints, RunDir(run_dir).ledger_dir):
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RunError(f"run directory {run_dir}: {path} is not a folder; remove it or choose another "
                           "run.storage / run.name")
    existing = run_dir
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunError(f"run.storage: {existing} is not a folder, so the run directory {run_dir} cannot be made")
    probe = os.path.join(existing, f".knapray-write-probe-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        os.remove(probe)
    except OSError as e:
        why = "is on a read-only file system" if _read_only(existing) else f"takes no new file ({e.strerror})"
        raise RunError(f"run.storage: {existing} {why}, so the run directory {run_dir} cannot be written; give "
                       "run.storage a writable folder") from None


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_lora_base(cfg: TrainConfig, trainer: dict, checkpoint: str) -> None:
    """A LoRA checkpoint resumes only on the base it was trained on: the fingerprint of
    ``model.pretrained``'s headers must be the one the checkpoint recorded."""
    saved = trainer.get("lora_base")
    if not cfg.model.lora.enabled or not isinstance(saved, dict):
        return
    from knapray.weights.checks import base_record

    now = base_record(cfg.model)
    if now is None or now.get("fingerprint") != saved.get("fingerprint"):
        raise RunError(f"cannot resume the LoRA run in {cfg.run_dir}: {checkpoint} was trained on the base "
                       f"{saved.get('path')!r} (header fingerprint {str(saved.get('fingerprint'))[:12]}), but "
                       f"model.pretrained {cfg.model.pretrained!r} is another checkpoint"
                       + (f" (fingerprint {now['fingerprint'][:12]})" if now else "")
                       + "; point model.pretrained at the original base or choose another run.name")


def check_resumable(run_dir: str, checkpoint: str) -> dict:
    """What a resume from ``checkpoint`` reads, checked before any worker starts: its
    trainer state and DCP metadata (nothing a planted file names is run), and the ledger
    journal holding every step the checkpoint covers. Returns the trainer state."""
    from knapray.coordinator.store import LedgerFileError

    from knapray.worker.checkpoint import RUN_STATE, CheckpointError, check_checkpoint
    from knapray.worker.ledger_files import LedgerBehind, check_covers, ledger_dir, read_ledger

    try:
        trainer = check_checkpoint(checkpoint, RUN_STATE)
        check_agrees(trainer, checkpoint)
        ledger = read_ledger(run_dir)
        try:
            check_covers(ledger, trainer.get("ledger"), checkpoint, ledger_dir(run_dir))
        finally:
            if ledger is not None:
                ledger.close()
    except (CheckpointError, LedgerBehind, LedgerFileError) as e:
        raise RunError(str(e)) from None
    return trainer


def check_agrees(trainer: dict, checkpoint: str) -> None:
    """A checkpoint's files agree with each other: its ``trainer.json`` covers the step its
    directory is named after, and the ledger position it recorded committed that same step
    (a trainer state one step behind its ledger would train that step's samples again on
    resume, one ahead would skip the next step's). ``RunError`` in one line otherwise."""
    from knapray.worker.checkpoint import TRAINER_STATE

    file = os.path.join(checkpoint, TRAINER_STATE)
    named = os.path.basename(os.path.normpath(checkpoint)).split("-", 1)[-1]
    step = trainer["step"]
    if not named.isdigit() or int(named) != step:
        raise RunError(f"checkpoint file {file} says step {step}, but its directory is the checkpoint of step "
                       f"{int(named) if named.isdigit() else '?'}: the checkpoint's files disagree (one was changed "
                       "or copied from another checkpoint); restore it, or delete that checkpoint to resume from an "
                       "earlier one")
    ledger = trainer.get("ledger")
    if isinstance(ledger, dict) and ledger["committed_step"] != step:
        raise RunError(f"checkpoint file {file} says step {step}, but the ledger position it recorded has committed "
                       f"step {ledger['committed_step']}: the checkpoint's files disagree, so a resume would repeat or "
                       "skip samples; restore it, or delete that checkpoint to resume from an earlier one")


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """The config fits a world of ``world_size`` ranks: the global batch splits over it,
    a concrete topology covers it, and every bag size divides the head count (a per-step
    topology: the world is whole nodes)."""
    from knapray.planning.search.rules import parse_rule, per_step_node
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
    with open_nofollow(tmp, "w") as f:
        json.dump({"format_version": RUN_FORMAT, **cfg.to_dict()}, f, indent=1)
    os.replace(tmp, RunDir(cfg.run_dir).config)


class RunLock:
    """``RUNNING.lock`` in the run directory, created exclusively: a second live run with
    the same name is refused. A lock left by a dead process on this host is taken over."""

    def __init__(self, run_dir: str) -> None:
        self.path = RunDir(run_dir).lock
        self.held = False

    def check_free(self) -> None:
        """Raise ``RunError`` if a live run holds the lock (taking nothing: pre-flight)."""
        owner = self._owner() if os.path.lexists(self.path) else None
        if owner is not None and not self._stale(owner):
            host = owner["host"] if len(owner["host"]) <= 255 else "another host"
            raise RunError(
                f"run directory {os.path.dirname(self.path)} is in use by a live run (pid {owner['pid']} on {host}, "
                f"see {self.path}); wait for it or choose another run.name"
            )

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
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
        """The lock's pid and host, as ``acquire`` writes them; None for a lock no live
        process can hold (unreadable, not JSON, a pid no process has: 0 or below, or above
        ``MAX_PID``), which is taken over."""
        try:
            owner = read_json(self.path, MAX_LOCK_BYTES, "run file", RunError, follow_links=False)
        except RunError:
            return None
        pid, host = owner.get("pid"), owner.get("host")
        if type(pid) is not int or not 0 < pid <= MAX_PID or not isinstance(host, str):
            return None
        return {"pid": pid, "host": host}

    @staticmethod
    def _stale(owner: dict) -> bool:
        if owner["host"] != socket.gethostname():
            return False  # another machine's process: cannot tell, assume alive
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # another user's live process
        return False


MAX_LOCK_BYTES = 1 << 16
"""``RUNNING.lock`` holds a pid, a host name and a time; a larger file is not one."""
MAX_PID = 1 << 22
"""The largest pid Linux gives (``/proc/sys/kernel/pid_max`` is at most 2^22)."""




def clear_stale_run_files(run_dir: str) -> None:
    """A fresh run in a directory without checkpoints: drop what an earlier, unfinished
    run there left (metrics, quarantine, ledger journal, summary)."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name in STALE_FILES or name.startswith("quarantine-"):
            os.remove(path)
        elif name in STALE_DIRS:
            shutil.rmtree(path)
