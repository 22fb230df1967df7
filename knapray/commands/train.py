"""``knapray train`` (and ``jobs/train.py``, the ``ray job submit`` entrypoint): a training
run on Ray.

Connects to the Ray cluster given by ``--address`` or ``RAY_ADDRESS`` (``ray job submit``
sets it), or starts an embedded local Ray that listens on 127.0.0.1 only
(``--ray-all-interfaces``: on every interface). Every input is checked before Ray starts
(``knapray.driver.preflight``): a bad config value, a missing corpus, a model that does not
fit the corpus, a world size the topology cannot take, workers no node can hold
(``knapray.driver.placement``) or a run directory that may not be used is one line on
stderr and exit code 2 (what a cluster holds is asked of it once connected). ``--check``
stops after those checks. With ``--compare-unbalanced`` it trains the same steps a second
time without balancing, prints the two side by side and draws them per step
(``comparison.png``).

SIGINT and SIGTERM stop a run alike (its workers, the lock; one line saying where it
stopped; exit 130 or 143); as a ``ray job submit`` entrypoint the driver stops the same way
when the shell that ran it dies (``knapray.stopping``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from knapray.local_ray import logs_dir, quiet_ray_data
from knapray.nofollow import open_nofollow
from knapray.run_files import RunDir


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_config, add_ray_interfaces, int_at_least

    add_config(p, required=True)
    p.add_argument("--check", action="store_true",
                   help="run every pre-flight check (config, corpus, every world size the run may start with, run "
                   "directory), print what was checked and exit: 0 if the run could start, else one line and 2; "
                   "starts neither Ray nor any worker")
    p.add_argument("--address", default=None,
                   help="Ray address (default: $RAY_ADDRESS if set, else an embedded local Ray)")
    p.add_argument("--num-cpus", type=int_at_least(1), default=None, help="logical CPUs of the embedded local Ray")
    add_ray_interfaces(p)
    p.add_argument("--compare-unbalanced", action="store_true",
                   help="also train the same steps without balancing and compare")


def main(argv: list[str] | None = None) -> int:
    from knapray.commands.flags import Parser

    p = Parser(prog="knapray train", description="knapray training on Ray")
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``knapray train`` (``knapray.cli``) and ``jobs/train.py`` past their flags: SIGINT and
    SIGTERM stop it alike from here on."""
    from knapray.stopping import exit_code, said, signal_name, stop_on_signals, stop_with_parent

    stop_with_parent()  # a ray job submit entrypoint: SIGTERM when its shell dies
    signals = None
    try:
        with stop_on_signals() as signals:
            return _run(args, signals)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM before training started (imports, pre-flight, Ray's start)
        name = signal_name(e, signals)
        how = "interrupted" if name == "SIGINT" else f"stopped by {name}"
        print(f"\nknapray train: {how} before training started; nothing was trained", file=sys.stderr, flush=True)
        said(exit_code(e, signals))  # should Ray end this process now, its words are out
        return exit_code(e, signals)


def _run(args: argparse.Namespace, signals) -> int:
    """Pre-flight, Ray, the run (``signals``: the stop signals' handlers, armed again once
    Ray has started: ``ray.init`` installs its own)."""
    from knapray.driver import preflight
    from knapray.config.run import ConfigError
    from knapray.worker.guard import BadCorpus
    from knapray.driver.placement import (check_placement, cluster_capacity, embedded_capacity, fits_line, local_gpus,
                                          slots, worker_request)
    from knapray.driver.run_dir import RunError
    from knapray.driver.report import read_metrics
    from knapray.local_ray import address_given

    try:
        # Every input is checked here, before Ray or any worker starts.
        pre = preflight.check_file(args.config, args.set)
        # The run directory's decision too (a live lock, resume rules, the checkpoint and
        # ledger a resume reads) before Ray starts, and whether the run is finished already.
        # (The launcher decides again under the run's lock: another run may have started.)
        start = pre.run_dir_decision()
        lines = pre.summary(args.config, start) if args.check else []
        from knapray.driver.launch import completed_run  # torch: only past the config checks

        done_at = completed_run(pre.cfg, start)
        if args.check and done_at is not None:
            lines += [f"the run is complete (checkpoint at step {done_at}): it would train nothing"]
        base = None
        if args.compare_unbalanced:  # its run directory too, not only after the balanced run
            base = preflight.check(_unbalanced(pre.cfg), pre.worlds, corpus=pre.corpus)
            lines += [f"--compare-unbalanced: {base.summary(args.config)[-1]}"]
        address = address_given(args.address)
        if address is None:  # an embedded Ray has exactly what it is given: checked before it starts
            num_cpus = embedded_cpus(pre.cfg, args.num_cpus)
            capacity = embedded_capacity(num_cpus, local_gpus())
            check_placement(pre.cfg, capacity, pre.worlds)
            lines += [fits_line(pre.cfg, capacity, pre.worlds)]
    except (ConfigError, RunError, BadCorpus) as e:  # one line that names the value; a traceback adds nothing
        print(f"knapray train: error: {e}", file=sys.stderr)
        return 2
    cfg = pre.cfg
    if args.check and address is None:
        _passed(lines)
        return 0
    if done_at is not None and not args.check:
        # A finished run resubmitted: say so, start nothing, compare nothing; the run files of
        # one whose driver was stopped after its last checkpoint are written now.
        from knapray.driver.launch import finish_run_files

        try:
            finished = finish_run_files(cfg)
        except RunError as e:  # its lock held by a live process
            print(f"knapray train: error: {e}", file=sys.stderr)
            return 2
        _nothing_trained(cfg, done_at, len(read_metrics(cfg.run_dir)))
        if finished is not None:
            print(f"[knapray] wrote the run files its stopped driver had not: summary.json, ledger.jsonl "
                  f"({finished['ledger_rows']} rows), rank_work.png in {cfg.run_dir}", flush=True)
        return 0

    if not address:
        # Ray ends a driver whose own servers stop under it at once and without a word (exit 1):
        # a signal to every process of the command's tree stops them too. The driver runs in a
        # child, and this process, which holds no Ray, says how the run stopped if it cannot.
        from knapray.stopping import drive_in_child

        drive_in_child(lambda signum, status: _driver_gone(cfg, signum, status))
    import ray

    # Ray's own INFO/WARNING lines stay in its session logs; the console shows knapray's
    # lines and the progress bar. Workers' output stays in their log files too.
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address:
        start = dict(address=address, **quiet)
    else:
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
        start = dict(num_cpus=num_cpus, num_gpus=capacity.nodes[0]["GPU"], include_dashboard=False, **quiet)
    try:
        start_ray(ray, start, attempts=1 if address else 2, all_interfaces=args.ray_all_interfaces)
    except RayStartFailed as e:
        print(f"knapray train: error: {e}", file=sys.stderr)
        return 1
    signals.arm()  # in case ray.init put its own SIGTERM handler in place (init_ray keeps it out)
    for name in ("ray", "ray.train"):
        logging.getLogger(name).setLevel(logging.ERROR)
    quiet_ray_data()
    if address:  # what the cluster has, and the node types its autoscaler may add
        capacity = cluster_capacity(ray, f"the Ray cluster at {address}")
        try:
            check_placement(cfg, capacity, pre.worlds)
        except RunError as e:
            print(f"knapray train: error: {e}", file=sys.stderr)
            return 2
        if args.check:
            ray.shutdown()
            _passed(lines + [fits_line(cfg, capacity, pre.worlds)])
            return 0
        if capacity.autoscaler_unknown and not any(slots(n, worker_request(cfg)) for n in capacity.nodes):
            print(f"[knapray] note: {fits_line(cfg, capacity, pre.worlds)}", flush=True)
    return _train(args, cfg, pre, base, address, signals)


def _passed(lines: list[str]) -> None:
    print("[knapray] pre-flight passed (nothing was started):")
    for line in lines:
        print(f"  {line}")


def _driver_gone(cfg, signum: int | None, status: int) -> str:
    """The line for a driver (``stopping.drive_in_child``) that ended without its own: stopped
    by ``signum`` (what the waiting process was sent), else ended with ``status``."""
    import signal

    from knapray.driver.launch import interrupted_line

    if signum is not None:
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        return f"\nknapray train: {how}: {interrupted_line(cfg)}"
    how = (f"was killed by {signal.Signals(-status).name}" if status < 0 else
           f"ended with exit status {status} without a word (Ray ends it so when its own servers stop; their "
           f"logs: {logs_dir()})")
    return f"knapray train: error: the driver process {how}; {interrupted_line(cfg)}"


def embedded_cpus(cfg, num_cpus: int | None) -> int:
    """Logical CPUs of the embedded Ray: ``--num-cpus``, else room for every worker and two
    more (Ray Data's readers, the coordinator) and at least 4."""
    return num_cpus or max(4, int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + 2)


def _train(args: argparse.Namespace, cfg, pre, base, address: str | None, signals) -> int:
    """The run itself (and its unbalanced twin), on the Ray this process started or joined."""
    import ray
    from ray.train import TrainingFailedError

    from knapray.driver.launch import Interrupted, StartTimeout, interrupted_line, run_training
    from knapray.driver.run_dir import RunError
    from knapray.stopping import exit_at_once, exit_code, said, signal_name
    from knapray.worker.guard import BadCorpus
    from knapray.driver.report import (comparison_lines, ledger_line, plot_comparison, prediction_line, quarantine_line,
                                      stopped_early_line)

    print(f"[knapray] Ray {'at ' + address if address else 'embedded'}: {ray.cluster_resources().get('CPU', 0):g} CPUs, "
          f"{ray.cluster_resources().get('GPU', 0):g} GPUs; Ray's and the workers' logs: {logs_dir()}", flush=True)
    t0 = time.perf_counter()
    try:
        balanced = run_training(cfg, checked=pre)
    except (RunError, BadCorpus) as e:
        print(f"knapray train: error: {e}", file=sys.stderr)
        return 2
    except TrainingFailedError as e:
        why = known_failure(e)
        if why is None:  # past run.max_failures restarts: the first worker's error and where the logs are
            why = (f"{first_failure(e)} (run.max_failures={cfg.run.max_failures}); the workers' logs: "
                   f"{logs_dir()}; {interrupted_line(cfg)}")
        print(f"knapray train: error: training failed: {why}", file=sys.stderr)
        return 1
    except StartTimeout as e:  # the workers waited past scaling.start_timeout_s: stopped, Ray's reason
        print(f"knapray train: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the workers were stopped
        name = signal_name(e, None if isinstance(e, Interrupted) else signals)
        how = "interrupted" if name == "SIGINT" else f"stopped by {name}"
        print(f"\nknapray train: {how}: {interrupted_line(cfg)}", file=sys.stderr, flush=True)
        code = exit_code(e, None if isinstance(e, Interrupted) else signals)
        said(code)  # should Ray end this process now, its words are out and its code known
        if getattr(e, "ray_lost", False):  # its servers stopped too: Ray's exit would wait 60 s on them, then exit 1
            exit_at_once(code)
        return code
    except OSError as e:  # the environment (a disk, a mount): one line naming the path
        print(f"knapray train: error: {e}", file=sys.stderr)
        return 1
    s = balanced["run"]["summary"]
    new = balanced["new_steps"]
    if not new:
        # The workers found nothing left (e.g. a checkpoint taken just before the epoch's
        # end): the same answer, and no unbalanced run either.
        _nothing_trained(cfg, balanced["resumed_from_step"], s["steps"])
        return 0
    resumed = balanced["resumed_from_step"]
    whole = "" if resumed is None else f" (resumed after step {resumed}; {s['steps']} steps in the run)"
    print(f"\n[knapray] balanced run: {new} steps trained on {balanced.get('world_size')} workers{whole}, "
          f"topology {balanced.get('topology')}, {time.perf_counter() - t0:.0f} s; "
          f"{quarantine_line(balanced['run'])}")
    if "prediction_error_last" in s:
        print(f"[knapray] {prediction_line(s)}")
    experts = [r["expert"] for r in balanced.get("records", []) if "expert" in r]
    if experts:  # two experts (flow.expert_boundary): how the steps were shared
        print(f"[knapray] experts: transformer (high noise) trained {experts.count(0)} of these steps, "
              f"transformer_2 (low noise) {experts.count(1)}")
    early = stopped_early_line(cfg, balanced)
    if early:
        print(f"[knapray] {early}")
    gaps = ledger_line(balanced["run"])
    if gaps:
        print(f"knapray train: error: {gaps}", file=sys.stderr)
        return 1
    rows = [("balanced", s)]
    if args.compare_unbalanced:
        unbalanced = run_training(base.cfg, checked=base)
        rows.append(("unbalanced", unbalanced["run"]["summary"]))
    for line in comparison_lines(rows, balanced, unbalanced if len(rows) == 2 else None):
        print(line)
    if len(rows) == 2:
        plot_comparison(cfg, base.cfg, balanced)
    print(f"run directory: {cfg.run_dir} (metrics.jsonl, summary.json, ledger.jsonl, rank_work.png"
          f"{', comparison.png' if len(rows) == 2 else ''})")
    with open_nofollow(RunDir(cfg.run_dir).comparison, "w") as f:
        json.dump(dict(rows), f, indent=1)
    return 0


def _unbalanced(cfg):
    """The same run without balancing, in its own run directory (``--compare-unbalanced``)."""
    from dataclasses import replace

    return replace(cfg, balance=replace(cfg.balance, enabled=False),
                   run=replace(cfg.run, name=cfg.run.name + "-unbalanced"))


def _nothing_trained(cfg, checkpoint_step: int | None, run_steps: int) -> None:
    print(f"[knapray] nothing trained: run {cfg.run.name!r} was already complete (its checkpoint at step "
          f"{checkpoint_step} covers data.epochs={cfg.data.epochs}"
          f"{f' or run.max_steps={cfg.run.max_steps}' if cfg.run.max_steps else ''}); 0 new steps, "
          f"{run_steps} in the run directory {cfg.run_dir}. Raise data.epochs or run.max_steps to train "
          "more, or choose another run.name for a new run", flush=True)


def known_failure(error: Exception) -> str | None:
    """The one-line reason of a Ray Train failure whose workers raised one of knapray's own
    errors (a world that cannot be trained on its nodes, a step the coordinator failed, a
    corpus found mostly bad while reading it);
    None for anything else, whose traceback is worth showing."""
    from knapray.coordinator import StepFailed
    from knapray.worker.guard import BadCorpus
    from knapray.worker.trainer import TopologyError

    reasons = []
    for failure in getattr(error, "worker_failures", {}).values():
        # Ray Train 2.60 wraps a worker's exception in UserExceptionWithTraceback, which
        # keeps it as ``_base_exc``; a task error keeps it as ``cause``.
        cause = failure
        for attr in ("_base_exc", "cause"):
            cause = getattr(cause, attr, cause)
        if not isinstance(cause, (TopologyError, StepFailed, BadCorpus)):
            return None
        reasons.append(str(cause).splitlines()[0])
    return "; ".join(dict.fromkeys(reasons)) or None


def first_failure(error: Exception) -> str:
    """One line for any Ray Train failure: the lowest failed rank's error (its exception
    type and first line) and how many other workers failed, or the controller's error."""
    failures = getattr(error, "worker_failures", None) or {}
    if not failures:
        return _one_line(getattr(error, "controller_failure", error))
    rank = min(failures)
    more = f" (and {len(failures) - 1} more worker(s))" if len(failures) > 1 else ""
    return f"worker {rank}: {_one_line(failures[rank])}{more}"


def _one_line(error: BaseException) -> str:
    for attr in ("_base_exc", "cause"):  # Ray's wrappers of a worker's own exception
        error = getattr(error, attr, None) or error
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 400 else text[:397] + "..."


class RayStartFailed(RuntimeError):
    """Ray did not start (or join its cluster); the message says how it failed and where
    Ray's logs are, in one line."""


def start_ray(ray, kwargs: dict, attempts: int = 1, all_interfaces: bool = False) -> None:
    """``ray.init(**kwargs)`` through ``knapray.local_ray.init_ray`` (an embedded Ray listens on
    127.0.0.1 only unless ``all_interfaces``), tried ``attempts`` times (an embedded Ray on a
    loaded machine sometimes loses its raylet while the dashboard agent waits for its ports;
    starting it again is safe: nothing of the run exists yet), then ``RayStartFailed``."""
    from knapray.local_ray import init_ray

    for attempt in range(1, attempts + 1):
        before = ray.is_initialized()
        try:
            init_ray(ray, all_interfaces=all_interfaces, **kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises many kinds (ConnectionError, RuntimeError, TimeoutError)
            error = e
            logs = logs_dir()
            if not before and ray.is_initialized():  # what this attempt half-started, never a Ray in use before
                try:
                    ray.shutdown()
                except Exception:  # noqa: BLE001 - a half-started Ray may fail to stop too; the next try starts anew
                    pass
            if attempt < attempts:
                print(f"[knapray] Ray did not start ({type(e).__name__}); trying once more", file=sys.stderr, flush=True)
    where = f"at {kwargs['address']}" if "address" in kwargs else "embedded"
    what = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise RayStartFailed(f"Ray ({where}) did not start after {attempts} attempt(s): {type(error).__name__}"
                         f"{': ' + what[:300] if what else ''}; Ray's logs: {logs}")


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
