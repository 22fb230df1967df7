"""Whether Ray can place a run's workers: what the config asks of each worker against what
the cluster has or its autoscaler can add, before any worker starts; and, while the
workers wait for Ray to place them, how long they have waited and Ray's reason.

A request no node can ever hold (GPUs asked of a machine without them, a custom resource
no node has, more workers than a fixed cluster holds at once) used to wait at "waiting for
step 0" for good, Ray's reason only in its monitor.log. ``check_placement`` refuses it in
one line (``RunError``: exit 2), for ``--check`` and every run. What is known:

- an embedded Ray (no ``--address``): exactly what ``knapray train`` gives it, its CPUs and
  this machine's GPUs, and no autoscaler;
- a cluster: its live nodes, and the node types its autoscaler may add when the cluster
  reports them to Ray (``ClusterConfig``, what Ray Train itself checks a group against).
  Without that report an autoscaler may still add nodes nobody here can see: such a run
  starts with a note, and ``scaling.start_timeout_s`` bounds its wait (``PlacementWatch``).

``PlacementWatch`` follows the run's placement groups (those of this driver's Ray job,
which Ray Train's controller creates for each worker group) and says, once the workers have
waited longer than ``scaling.start_timeout_s`` since the start or since a group was last
placed, why: Ray's scheduling state of the group, what each worker asks, what the cluster
has, and Ray's own words from the head's ``monitor.log`` when this machine has it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from knapray.config.run import TrainConfig
from knapray.driver.run_dir import RunError

EMBEDDED = "the embedded Ray on this machine"
_EPS = 1e-9


@dataclass(frozen=True)
class NodeType:
    """A kind of node an autoscaler may add: its resources, at most ``max_count`` (-1: no bound)."""

    name: str
    resources: Mapping[str, float]
    max_count: int


@dataclass(frozen=True)
class Capacity:
    """What a Ray cluster has (``nodes``: each live node's resources) and may add."""

    where: str
    """How the cluster is named in a message: "the embedded Ray on this machine"."""
    nodes: tuple[Mapping[str, float], ...]
    node_types: tuple[NodeType, ...] = ()
    autoscaler_unknown: bool = False
    """A cluster that did not say which nodes its autoscaler may add (a request no live node
    holds may still be placed later)."""

    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for node in self.nodes:
            for k, v in node.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out


def worker_request(cfg: TrainConfig) -> dict[str, float]:
    """The resources Ray Train asks for each worker: ``cpus_per_worker`` CPUs, one GPU with
    ``use_gpu``, and ``resources_per_worker`` on top (which may set CPU or GPU itself), as
    ``ScalingConfig`` merges them; zero amounts left out."""
    s = cfg.scaling
    out: dict[str, float] = {"CPU": float(s.cpus_per_worker)}
    if s.use_gpu:
        out["GPU"] = 1.0
    out.update({k: float(v) for k, v in s.resources_per_worker.items()})
    return {k: _num(v) for k, v in out.items() if v > 0}


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else v


def _text(resources: Mapping[str, float]) -> str:
    """``{'CPU': 8, 'GPU': 1}``: whole amounts as ints, Ray's internal resources left out."""
    shown = {k: _num(float(v)) for k, v in resources.items() if not _internal(k)}
    return repr(dict(sorted(shown.items(), key=lambda kv: (kv[0] not in ("CPU", "GPU"), kv[0]))))


def _internal(name: str) -> bool:
    return name.startswith("node:") or name in ("memory", "object_store_memory") or name.startswith("accelerator_type:")


def slots(node: Mapping[str, float], request: Mapping[str, float]) -> int:
    """How many workers asking ``request`` one node of ``node``'s resources holds."""
    return min((int(math.floor(float(node.get(k, 0.0)) / v + _EPS)) for k, v in request.items()), default=0)


def check_placement(cfg: TrainConfig, capacity: Capacity, worlds: Iterable[int]) -> None:
    """``RunError`` (one line) when Ray can never place the run: no node of the cluster, nor
    any its autoscaler may add, holds one worker; or the smallest group the run may start
    with (``worlds``) never fits at once."""
    request = worker_request(cfg)
    if not request:
        return
    kinds = list(capacity.nodes) + [t.resources for t in capacity.node_types]
    if not any(slots(n, request) >= 1 for n in kinds):
        if capacity.autoscaler_unknown:
            return  # an autoscaler may add a node nobody here can see: the start timeout bounds the wait
        raise RunError(_no_node(cfg, capacity, request, kinds))
    need = min(int(w) for w in worlds)
    room = room_for(request, capacity)
    if room < need:
        raise RunError(_too_many(cfg, capacity, request, need, int(room)))


def room_for(request: Mapping[str, float], capacity: Capacity) -> float:
    """How many workers asking ``request`` the cluster holds at once, with every node its
    autoscaler may add; ``math.inf`` where that is unbounded (a node type without a maximum
    that holds one, or a cluster that reports no node types)."""
    if capacity.autoscaler_unknown:
        return math.inf
    room = sum(slots(n, request) for n in capacity.nodes)
    for t in capacity.node_types:
        per_node = slots(t.resources, request)
        if per_node and t.max_count < 0:
            return math.inf
        room += per_node * max(t.max_count, 0)
    return room


def _asked_by(cfg: TrainConfig) -> str:
    keys = ["scaling.cpus_per_worker"] + (["scaling.use_gpu"] if cfg.scaling.use_gpu else []) \
        + (["scaling.resources_per_worker"] if cfg.scaling.resources_per_worker else [])
    return ", ".join(keys)


def _no_node(cfg: TrainConfig, capacity: Capacity, request: dict, kinds: list) -> str:
    short = []
    for k, v in request.items():
        best = max((float(n.get(k, 0.0)) for n in kinds), default=0.0)
        if best + _EPS < v:
            short.append(f"{k}: {_num(v)} asked, at most {_num(best)} on a node")
    why = "; ".join(short) if short else "each resource is on some node, but no node has all of it"
    adds = (f"nor may its autoscaler add one ({', '.join(t.name for t in capacity.node_types)})"
            if capacity.node_types else "and nothing adds nodes to it" if capacity.where == EMBEDDED
            else "and it reports no autoscaler that may add one")
    fixes = []
    if "GPU" in request and any(f.startswith("GPU") for f in short):
        fixes.append("set scaling.use_gpu=false, or train where there are GPUs (--address)")
    if "CPU" in request and any(f.startswith("CPU") for f in short):
        fixes.append("lower scaling.cpus_per_worker" + (" or give --num-cpus" if capacity.where == EMBEDDED else ""))
    custom = [k for k in request if k not in ("CPU", "GPU") and any(f.startswith(f"{k}:") for f in short)]
    if custom:
        fixes.append(f"give a node {custom[0]!r} (ray start --resources, a node type's resources) or leave it out "
                     "of scaling.resources_per_worker")
    if not fixes:
        fixes.append("ask for less per worker, or add a node that has it all")
    return (f"scaling: a worker asks Ray for {_text(request)} ({_asked_by(cfg)}), and no node of {capacity.where} "
            f"holds it ({why}; it has {_text(capacity.total())}), {adds}: the run would wait for good; "
            f"{'; '.join(fixes)}")


def _too_many(cfg: TrainConfig, capacity: Capacity, request: dict, need: int, room: int) -> str:
    which = "scaling.min_workers" if cfg.scaling.min_workers else "scaling.num_workers"
    adds = " with every node its autoscaler may add" if capacity.node_types else ""
    fixes = f"lower {which} or what each worker asks"
    if capacity.where == EMBEDDED:
        fixes += ", or give --num-cpus"
    return (f"scaling: {need} workers ({which}) of {_text(request)} each never fit at once: {capacity.where} "
            f"holds at most {room} ({_text(capacity.total())}{adds}); {fixes}")


def fits_line(cfg: TrainConfig, capacity: Capacity, worlds: Iterable[int]) -> str:
    """What ``--check`` says when ``check_placement`` passed."""
    request, top = worker_request(cfg), max(int(w) for w in worlds)
    if capacity.autoscaler_unknown and not any(slots(n, request) >= 1 for n in capacity.nodes):
        return (f"workers: {top} x {_text(request)}: no node of {capacity.where} holds one now, and it reports no "
                f"node types: its autoscaler must add them within scaling.start_timeout_s="
                f"{cfg.scaling.start_timeout_s:g} s")
    return f"workers: {top} x {_text(request)} fit {capacity.where} ({_text(capacity.total())})"


# ---- what a cluster has -------------------------------------------------------------------


def local_gpus() -> int:
    """GPUs on this machine that torch can use (an embedded Ray is given exactly these)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def embedded_capacity(num_cpus: float, num_gpus: int) -> Capacity:
    return Capacity(EMBEDDED, nodes=({"CPU": float(num_cpus), "GPU": float(num_gpus)},))


def cluster_capacity(ray: Any, where: str) -> Capacity:
    """The cluster this process is connected to: its live nodes' resources, and the node
    types its autoscaler reported to Ray (none reported: ``autoscaler_unknown``)."""
    nodes = tuple(dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive"))
    types: tuple[NodeType, ...] = ()
    try:  # not public API (Ray Train checks a group against the same report)
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - no report readable: treated as none
        config = None
    if config is not None and config.node_group_configs:
        types = tuple(NodeType(g.name or "?", {k: float(v) for k, v in g.resources.items()}, int(g.max_count))
                      for g in config.node_group_configs)
    return Capacity(where, nodes=nodes, node_types=types, autoscaler_unknown=not types)


# ---- while the workers wait ---------------------------------------------------------------


@dataclass
class PlacementWatch:
    """Follows the placement groups of this Ray job (``groups()``: Ray's placement group
    table) and calls ``on_timeout(reason)`` once, when the workers have waited longer than
    ``timeout_s`` since ``start()`` or since one of the job's groups was last placed, while
    one is waiting. ``timeout_s`` 0: never."""

    timeout_s: float
    request: Mapping[str, float]
    groups: Callable[[], Mapping[str, Mapping]]
    on_timeout: Callable[[str], None]
    cluster: Callable[[], Mapping[str, float]] = dict
    ray_words: Callable[[], str | None] = lambda: None
    poll_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    placed_at: float = 0.0
    fired: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "PlacementWatch":
        self.placed_at = self.clock()
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="knapray-placement-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                reason = self.check()
            except Exception:  # noqa: BLE001 - Ray busy or shutting down: look again next time
                continue
            if reason is not None:
                self.fired = True
                self.on_timeout(reason)
                return

    def check(self) -> str | None:
        """One look: the reason to stop, or None."""
        now = self.clock()
        table = self.groups()
        waiting = [g for g in table.values() if g.get("state") in ("PENDING", "RESCHEDULING")]
        if any(g.get("state") == "CREATED" for g in table.values()) or not waiting:
            if any(g.get("state") == "CREATED" for g in table.values()):
                self.placed_at = now
            return None
        waited = now - self.placed_at
        if waited <= self.timeout_s:
            return None
        return self.reason(waiting[0], waited)

    def reason(self, group: Mapping, waited: float) -> str:
        bundles = list((group.get("bundles") or {}).values())
        state = (group.get("stats") or {}).get("scheduling_state") or group.get("state")
        what = (f"its placement group of {len(bundles)} x {_text(bundles[0])} ({group.get('strategy', '?')}) is "
                f"{state}" if bundles else f"its placement group is {state}")
        words = self.ray_words()
        said = f"Ray says: {words}; " if words else ""
        return (f"the workers waited {waited:.0f} s for Ray to place them (scaling.start_timeout_s="
                f"{self.timeout_s:g}): {said}{what}; each asks {_text(self.request)}, the cluster has "
                f"{_text(self.cluster())}; ask for what the cluster has (scaling.use_gpu, cpus_per_worker, "
                "resources_per_worker, num_workers), add nodes, or raise scaling.start_timeout_s")


def job_groups(ray: Any) -> dict[str, Mapping]:
    """The placement groups of this driver's Ray job (a group's id ends with its job's id)."""
    from ray.util import placement_group_table

    job = ray.get_runtime_context().get_job_id()
    return {pg_id: g for pg_id, g in placement_group_table().items() if pg_id.endswith(job)}


MONITOR_TAIL_BYTES = 1 << 16


def monitor_words(logs_dir: str | None) -> str | None:
    """The newest "No available node types can fulfill ..." line of the head's
    ``monitor.log`` (how Ray's autoscaler says a request cannot be placed), when this
    machine holds that log; None otherwise."""
    if not logs_dir:
        return None
    path = os.path.join(logs_dir, "monitor.log")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - MONITOR_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = [line for line in tail.splitlines() if "No available node types can fulfill" in line]
    if not found:
        return None
    text = found[-1]
    text = text[text.index("No available node types"):].strip()
    cut = text.find(". Add suitable node types")
    text = text if cut < 0 else text[:cut]
    return text if len(text) <= 300 else text[:297] + "..."
