"""A fork server for the Python workers of the Rays the test session starts: a worker is a
fork of a process that imported torch, Ray, Ray Train, Ray Data and knapray's launcher
once, instead of a fresh interpreter that imports them again (each training worker 4-5
CPU-s of imports, each of Ray's task workers and helper actors 1-3, hundreds of them in a
suite).

    python tests/ray_worker_fork.py SOCKET      # the server (conftest._fast_worker_start)

The raylet still starts every worker itself, as ``tests/ray_worker_start.py``: that small
process (the standard library only) sends its argv, environment and working directory and
its standard streams over the server's Unix socket; a fork of the server takes them and
becomes the worker (``default_worker.py`` run as ``__main__``). The worker registers with
the raylet under its own pid, which is the pid the raylet signals and watches from then on;
the small process stays until the worker ends, passing on the signals it gets.

Two levels, because Ray reads some settings once, when its native library loads: the job a
worker belongs to and the raylet's pid (``RAY_JOB_ID``, ``RAY_RAYLET_PID``), the
authentication mode, every ``RAY_*`` setting. The server (level 0) imports what does not
load Ray (torch, its distributed checkpointing, pandas, pyarrow, knapray's launcher); for
each distinct worker environment it forks a level-1 server that sets that environment,
imports Ray's side, and from then on forks that environment's workers. A session's Ray
hands most of its workers one environment (its job's), so each level-1 server's imports
are paid once and its workers' not at all.

A request the fork could not honour exactly gets ``no`` and the small process execs the
worker itself, as without this server: a variable that the interpreter, torch or the C
libraries read as they load (``AS_THEY_LOAD``) differing from the server's, or a server
that is not there."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys

BASE = ("numpy", "pandas", "pyarrow", "torch", "torch.distributed.checkpoint", "torch.distributed.tensor",
        "knapray.driver.launch")
"""Level 0's imports: none of them loads Ray (``ray._raylet`` fixes Ray's settings as it loads)."""

RAY_SIDE = ("ray", "ray._private.node", "ray._private.parameter", "ray._private.ray_logging",
            "ray._private.runtime_env.setup_hook", "ray._private.async_compat", "ray.actor", "ray.data",
            "ray.train", "ray.train.torch")
"""A level-1 server's imports, in the environment of its workers: a Ray worker's own
(``default_worker.py``'s) and what Ray Train's workers and controller and Ray Data's tasks
import on top."""

AS_THEY_LOAD = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP", "OPENBLAS", "TORCH", "PYTORCH", "CUDA",
                "NVIDIA", "NCCL", "TRITON", "ARROW", "NUMPY", "PANDAS", "MALLOC", "GLIBC", "TMPDIR", "TEMP", "TMP",
                "XDG_")
"""Prefixes of the variables that the interpreter, its C libraries and level 0's imports
(``BASE``) read as they load, not later: a worker asking for other values of these than
level 0 started with is refused. The rest (Ray's own, a test's ``GLOO_SOCKET_IFNAME`` or
``KNAPRAY_*``, a runtime environment's ``env_vars``) a level-1 server takes as the worker has
them, before it imports Ray's side."""


def _as_they_load(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(AS_THEY_LOAD)}


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def _recv(conn: socket.socket):
    (n,) = struct.unpack("!I", _read(conn, 4))
    return json.loads(_read(conn, n))


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The small process's request: a 4-byte length sent with its three streams, then JSON."""
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    try:
        head += _read(conn, 4 - len(head))
        (n,) = struct.unpack("!I", head)
        return json.loads(_read(conn, n)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _become_worker(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In a fork of a level-1 server: take the small process's streams, directory and argv
    (the environment is already its), tell it the pid, and run the worker as ``__main__``;
    never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        import numpy

        numpy.random.seed()  # numpy's legacy global state, drawn once in the server, is every fork's
        _send(conn, os.getpid())
        conn.close()
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ignored by the servers, which end with the test process (level 0) or with level 0 or their
raylet (level 1); a worker gets Python's own handling of them back."""


def _log(path: str, line: str) -> None:
    """The servers' log beside level 0's socket (``SOCKET.log``): what went wrong, for a
    test that finds the session's workers not forked."""
    with open(f"{path}.log", "a") as f:
        print(f"{os.getpid()} {line}", file=f)


def _debug(*what) -> None:
    where = os.environ.get("KNAPRAY_TEST_RAY_FORK_DEBUG")
    if where:
        with open(where, "a") as f:
            print(os.getpid(), *what, file=f)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _import_ray_side() -> None:
    """Import ``RAY_SIDE`` without drawing from Ray's native random generator in this
    thread. Ray's ids come from a per-thread generator seeded from a process-wide pool
    (abseil's), which a fork copies as it is: once this process has drawn from it, every
    fork would draw the same ids (the same lease and task ids from two workers: the raylet
    crashed on one). Importing Ray Data and Ray Train draws once per actor class they
    define (``ray.actor``'s ``ActorClassID.from_random()``); those ids come from the OS
    instead while the imports run. ``_forks_draw_apart`` checks the result."""
    import ray.actor

    real = ray.actor.ActorClassID

    class _FromOS(real):
        @classmethod
        def from_random(cls):
            return real(os.urandom(real.size()))

    ray.actor.ActorClassID = _FromOS
    try:
        for name in RAY_SIDE:
            __import__(name)
    finally:
        ray.actor.ActorClassID = real


def _forks_draw_apart() -> bool:
    """Whether two forks of this process draw different random ids from Ray."""
    from ray._raylet import UniqueID

    drawn = []
    reaping = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid below, not the kernel
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, UniqueID.from_random().binary())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            drawn.append(f.read())
    signal.signal(signal.SIGCHLD, reaping)
    return drawn[0] != drawn[1] and all(drawn)


def _level1(listener: socket.socket, first: tuple, env: dict) -> None:
    """A level-1 server, in a fork of level 0: this environment, Ray's side imported in it,
    then a fork per request (the first one, ``(conn, request, fds)``, handed over by level
    0). Ends with level 0 or with the raylet whose workers it starts; never returns."""
    level0_path = listener.getsockname().rsplit(".", 1)[0]
    try:
        level0 = os.getppid()
        os.environ.clear()
        os.environ.update(env)
        _import_ray_side()
        refuse = not _forks_draw_apart()  # then each small process execs its worker
        if refuse:
            _log(level0_path, "forks would draw the same random ids from Ray: this level-1 server refuses")
        raylet = int(env.get("RAY_RAYLET_PID") or 0)
        pending: tuple | None = first
        listener.settimeout(1.0)
        while os.getppid() == level0 and (not raylet or _alive(raylet)):
            if pending is None:
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                try:
                    request, fds = _recv_request(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                pending = (conn, request, fds)
            conn, request, fds = pending
            pending = None
            try:
                if refuse:
                    _send(conn, "no")
                elif os.fork() == 0:
                    listener.close()
                    _become_worker(request, fds, conn)
            except OSError:
                pass
            finally:
                for fd in fds:
                    os.close(fd)
                conn.close()
    except BaseException as e:  # noqa: BLE001 - its small processes exec their workers
        _log(level0_path, f"level-1 server failed: {e!r}")
    finally:
        os._exit(0)


def serve(path: str) -> None:
    """Level 0: import ``BASE``, then answer requests until the process that started it ends."""
    parent = os.getppid()
    for s in STOPS:  # the test process's group may get a terminal's Ctrl-C; this ends with that process
        signal.signal(s, signal.SIG_IGN)
    for name in BASE:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the level-1 servers
    mine = _as_they_load(os.environ)
    level1: dict[str, tuple[int, str]] = {}
    print("ready", flush=True)
    try:
        while os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(None)
            fds: list[int] = []
            try:
                request, fds = _recv_request(conn)
                env = request["env"]
                theirs = _as_they_load(env)
                if len(fds) != 3 or theirs != mine:
                    _log(path, "refused: " + repr({k: (theirs.get(k), mine.get(k)) for k in set(theirs) | set(mine)
                                                   if theirs.get(k) != mine.get(k)}))
                    _send(conn, "no")
                    continue
                key = hashlib.sha256(json.dumps(sorted(env.items())).encode()).hexdigest()[:16]
                known = level1.get(key)
                if known is not None and _alive(known[0]):
                    _send(conn, {"to": known[1]})
                    continue
                where = f"{path}.{key}"
                if os.path.exists(where):
                    os.unlink(where)
                sub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sub.bind(where)
                sub.listen(64)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _level1(sub, (conn, request, fds), env)
                sub.close()
                level1[key] = (pid, where)
                _debug("level 1", pid, key, {k: v for k, v in env.items() if k.startswith(("RAY_", "KNAPRAY"))})
            except Exception as e:  # noqa: BLE001 - one bad request: its small process execs its worker
                _log(path, f"request failed: {e!r}")
            finally:
                for fd in fds:
                    os.close(fd)
                conn.close()
    finally:
        _log(path, "level 0 ends")
        for _pid, where in level1.values():
            if os.path.exists(where):
                os.unlink(where)
        os.unlink(path)
        try:
            os.rmdir(os.path.dirname(path))  # conftest's directory for it, if nothing else is there
        except OSError:
            pass


def ask(path: str, argv: list[str]) -> bool:
    """In the small process: have a server fork this worker, then stay until it ends (never
    returns then). False if no server is there or it refused: the caller execs the worker."""
    data = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    for _ in range(2):  # level 0, then the level-1 server it names
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            socket.send_fds(conn, [struct.pack("!I", len(data))], [0, 1, 2])
            conn.sendall(data)
            answer = _recv(conn)
        except (OSError, EOFError, ValueError):
            return False
        finally:
            conn.close()
        if isinstance(answer, int):
            _stay_with(answer)
        if not (isinstance(answer, dict) and isinstance(answer.get("to"), str)):
            return False
        path = answer["to"]
    return False


def _stay_with(pid: int) -> None:
    """Wait for the worker ``pid`` (not this process's child) to end, passing on SIGTERM,
    SIGINT, SIGHUP and SIGQUIT; then exit."""
    import select

    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        os._exit(0)

    def forward(signum, _frame):
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, forward)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():
        pass
    os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1])
