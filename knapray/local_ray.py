"""Starting Ray for a knapray command: every ``ray.init`` of knapray goes through
``init_ray``.

Given an address (``--address``, ``$RAY_ADDRESS``) it joins that cluster. Otherwise it starts
a single-machine Ray, and that Ray listens on 127.0.0.1 only: Ray's default, its node's own
address, has the GCS, the raylet, every worker and the dashboard agent listen on every
interface of the machine, open to its network (with no other node ever joining). Ray binds
them to the loopback interface exactly when its node's address is 127.0.0.1, and takes
that address only when Ray clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, what
it does on macOS and Windows; read when ``ray`` is imported, so ``init_ray`` sets Ray's
constant for the start). ``all_interfaces=True`` (``--ray-all-interfaces``) keeps Ray's
default, for the rare machine whose embedded Ray other machines must reach.

An embedded Ray expects up to 4 Python processes per logical CPU to start together
(``STARTUP_ENV``): Ray's bar is min(cores, CPUs), 2 on a 2-core machine, and at 4x it printed
"(raylet) WARNING: 8 PYTHON worker processes have been started ... 4x the maximum expected
startup concurrency (2)" when a command's zero- and half-CPU actors (training workers, the
coordinator and a relay; a serving gang, Serve's controller and proxy) started at once, as
they do by design. A value the user set is kept; a cluster's raylets are never ours to set.

A SIGTERM handler the command has installed (``knapray.stopping``: SIGTERM stops a run as
Ctrl-C does) stays in place while ``ray.init`` runs: Ray's own, ``sys.exit(15)``, replaced it
for the start, so a SIGTERM then exited 15 instead of 143, and one handled inside a fork hook
was dropped, leaving the command talking to a Ray whose processes the same signal had
stopped, for 60 s, then exit 1.

An embedded Ray's processes (its GCS, raylet, agents, and the workers the raylet starts) run
in a session of their own (``own_session``), as Ray does on Windows: a signal to the
command's process group (``timeout``, a terminal, a process manager stopping a group) reaches
the command, which stops the run and then its Ray, not Ray's processes under a run still
going (before: the run went silent, the driver talked to a dead GCS for 60 s and exited 1
with no line, Ray's processes left behind). A command killed outright still takes its GCS
and raylet with it (Ray's fate-sharing: Linux's parent-death signal; only where Ray has that
does this apply); the raylet's dashboard and runtime-env agents outlive it, as they did.
SIGINT and SIGTERM are held while the embedded ``ray.init`` runs (``held_stop_signals``) and
delivered as it returns: one that arrived inside it stopped a half-started Ray, and exited
134 after Ray's native stack dump. Ray installs a crash handler for SIGTERM as its core worker
connects, which, where another thread of the process takes the signal, prints that dump and
sets an alarm that aborts the process 3 s later: the alarm is cancelled (the dump stays).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

LOOPBACK = "127.0.0.1"
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
STARTUP_ENV = "RAY_worker_maximum_startup_concurrency"
"""Ray's setting (its ``worker_maximum_startup_concurrency``, read by the raylet when it starts)
of how many worker processes start at once, and the bar of its "4x the maximum expected" warning."""


def address_given(address: str | None = None) -> str | None:
    """The cluster a command joins: ``address``, else ``$RAY_ADDRESS``, else None (it starts
    its own)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_ray(ray: Any, *, address: str | None = None, all_interfaces: bool = False, **kwargs: Any) -> Any:
    """``ray.init(**kwargs)``: joins ``address`` (or ``$RAY_ADDRESS``) if there is one, else
    starts a single-machine Ray bound to 127.0.0.1 (``all_interfaces``: to every interface,
    Ray's default). Returns what ``ray.init`` returns."""
    joined = address_given(address)
    if joined is not None:
        with keeping_sigterm_handler():
            return ray.init(address=joined, **kwargs)
    with _expected_startups(kwargs.get("num_cpus")), own_session() as wrapped, held_stop_signals(wrapped), \
            keeping_sigterm_handler():
        if all_interfaces:
            context = ray.init(**kwargs)
        else:
            with loopback_only():
                context = ray.init(**kwargs)
        _STARTED_HERE[0] = _gcs_address(ray)  # before a held signal is delivered, at the end of the block
    return context


_STARTED_HERE: list[str | None] = [None]
"""The GCS address of the single-machine Ray ``init_ray`` started in this process, if any."""


def _gcs_address(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a Ray without a runtime context: not known
        return None


def logs_dir() -> str:
    """The log directory of the Ray session this process is connected to, for a hint in a
    message (Ray keeps its own and its workers' logs there)."""
    try:  # not public API; only for the hint
        from ray._private.worker import _global_node

        return _global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001
        return "the Ray session's logs directory (/tmp/ray/session_latest/logs by default)"


def quiet_ray_data() -> None:
    """Ray Data's lines (a dataset's execution plan, its progress, its size estimates) off this
    process's console, kept in the session's ``ray-data.log``. Ray Data sets up its logger when
    ``ray.data`` is first imported, resetting any level given before: imported here first."""
    import logging

    import ray.data  # noqa: F401 - its import configures the "ray.data" logger changed here

    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            handler.setLevel(logging.ERROR)


def started_here(ray: Any) -> bool:
    """Whether the Ray this process is connected to is the single-machine one ``init_ray``
    started in it (not a cluster it joined)."""
    return _STARTED_HERE[0] is not None and ray.is_initialized() and _gcs_address(ray) == _STARTED_HERE[0]


def gone_here(ray: Any) -> bool:
    """Whether the single-machine Ray ``init_ray`` started in this process is gone: its GCS
    refuses connections (a signal to every process of the command's tree stopped it). Its
    other servers go with it (Ray's fate-sharing), so nothing asked of it will answer, and a
    driver thread of Ray's then polls the dead GCS without pause (a core busy until the
    process ends). False for a cluster this process joined, where the GCS may be elsewhere
    and come back."""
    import socket

    if not started_here(ray):
        return False
    host, _, port = (_STARTED_HERE[0] or "").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):  # a timeout, an odd address: not known to be gone
        return False


SETTLE_S = 1.0
"""How long a command stopped by a signal waits to see whether the Ray it started stops too
(``gone_within``) before it asks anything of it or shuts it down: a signal sent to every
process of the command's tree stops Ray's servers as well, and a question or a shutdown
their stop cuts short waits on them, or ends the command from inside Ray."""


def gone_within(ray: Any, limit_s: float) -> bool:
    """Whether the Ray this process started is gone (``gone_here``) within ``limit_s``: a
    signal sent to every process of a command's tree reaches its Ray's servers at the same
    time as the command, and they take a moment to go."""
    deadline = time.monotonic() + limit_s
    while not gone_here(ray):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


@contextlib.contextmanager
def _expected_startups(num_cpus: int | None) -> Iterator[None]:
    """Inside: the raylet started expects 4 worker processes per logical CPU (``num_cpus``, else
    the machine's) to start together, unless the user set ``STARTUP_ENV``."""
    if STARTUP_ENV in os.environ:
        yield
        return
    os.environ[STARTUP_ENV] = str(4 * int(num_cpus or os.cpu_count() or 1))
    try:
        yield
    finally:
        os.environ.pop(STARTUP_ENV, None)


@contextlib.contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Inside: ``ray.init`` leaves a SIGTERM handler this process installed in place (Ray
    installs its own through ``ray._private.utils.set_sigterm_handler``, looked up when it
    starts); with the default handler, or a Ray without that function, Ray does as it does."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:
        yield
        return
    mine = signal.getsignal(signal.SIGTERM)
    own = getattr(ray_utils, "set_sigterm_handler", None)
    if own is None or mine in (signal.SIG_DFL, signal.SIG_IGN, None):
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = own


HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_stop_signals(children_unblock: bool = True) -> Iterator[None]:
    """Inside (in the main thread): SIGINT and SIGTERM held. Blocked in this thread (and in the
    threads Ray starts from it), and recorded by a handler of this context's where another
    thread of the process takes one (one started earlier, as a math library's): at the end the
    handlers this process had before are put back (Ray's crash handler, installed for SIGTERM
    as its core worker starts, replaced), the signals unblocked, and each one that arrived is
    delivered to them then. Only where the processes Ray starts inside unblock SIGTERM first
    (``children_unblock``: ``own_session`` is in place), else nothing is held."""
    if not children_unblock or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    handlers = {s: signal.getsignal(s) for s in HELD}
    held = [s for s, handler in handlers.items() if handler is not None]  # one set outside Python: left alone
    arrived: list[int] = []

    def record(signum, frame) -> None:
        if signum not in arrived:
            arrived.append(signum)

    for s in held:
        signal.signal(s, record)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, handlers[s])
        if arrived and hasattr(signal, "alarm"):
            # Another thread took it, maybe through Ray's crash handler, which printed its stack
            # dump, passed the signal on, and set an alarm that aborts the process 3 s later
            # (exit 134 after the command's own line): cancelled (before a handler can raise).
            signal.alarm(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # one pending here goes to them now
        for s in arrived:  # one another thread took
            signal.raise_signal(s)


@contextlib.contextmanager
def own_session() -> Iterator[bool]:
    """Inside: each process a Ray start spawns (``ray._private.services.ConsolePopen``) starts
    with SIGTERM unblocked (``held_stop_signals``; Ray's own start blocks SIGINT in it, as
    before), and in a session of its own where Ray shares its fate with this process through
    the kernel (Linux). Yields whether the spawns are wrapped (False: a Ray without that class,
    or not POSIX: nothing changes)."""
    try:
        from ray._private import services
        from ray._private import utils as ray_utils
    except ImportError:
        yield False
        return
    base = getattr(services, "ConsolePopen", None)
    if base is None or not hasattr(signal, "pthread_sigmask"):
        yield False
        return
    detect = getattr(ray_utils, "detect_fate_sharing_support", None)
    new_session = sys.platform.startswith("linux") and detect is not None and bool(detect())

    class _Spawned(base):
        def __init__(self, *args, **kwargs):
            given = kwargs.get("preexec_fn")

            def preexec():
                if given is not None:
                    given()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

            kwargs["preexec_fn"] = preexec
            if new_session:
                kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _Spawned
    try:
        yield True
    finally:
        services.ConsolePopen = base


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Inside: a Ray node started by this process takes 127.0.0.1 as its address (so each of
    its processes listens there only); Ray's setting as it was afterwards."""
    from ray._private import ray_constants  # Ray's switch, read where the node's address is chosen

    before_const = ray_constants.ENABLE_RAY_CLUSTER
    before_env = os.environ.get(_CLUSTERS_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_CLUSTERS_ENV] = "0"  # for the processes Ray starts that look it up themselves
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_const
        if before_env is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = before_env
