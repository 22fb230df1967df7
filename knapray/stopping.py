"""Stopping a run on a signal: SIGTERM is handled as SIGINT is.

A scheduler stops a job with SIGTERM, a user with Ctrl-C (SIGINT); both must stop the run
the same way: its workers stopped, the run directory's lock and ledger closed, one line
saying where the run stopped, exit code 128 + the signal (130, 143). Inside
``stop_on_signals()`` either signal raises ``Stop`` (a ``KeyboardInterrupt``, so what
catches Ctrl-C catches it) in the main thread, once; a second signal while the first is
handled is remembered, not raised (``StopSignals.count``), so the clean-up it interrupts
is not itself interrupted. A ``Stop`` nobody handles (Python lost it in a fork hook or a
``__del__``, or a library's bare ``except:`` swallowed it) is raised again every half second
until something does (``StopSignals._watch``), without Python's "Exception ignored" traceback.

``stop_with_parent()``: a driver started by another process that a scheduler may stop
alone (the ``/bin/sh -c`` that ``ray job submit`` runs an entrypoint in) is sent SIGTERM
when that parent dies, so it does not train on for a job marked failed.

``run_main(main)``: a command's process ends once its work is out (``exit_now``), without
the interpreter's teardown of the thousands of modules torch and Ray bring.

``drive_in_child(last_words)``: the rest of a command runs in a child process, and the
command's own process waits for it and ends with its exit code. A driver that started its own
Ray is ended by Ray, at once and without a word (``_Exit(1)``), when Ray's servers stop under
it: a signal sent to every process of the command's tree (a Slurm step's cgroup, a process
manager) stops them too. The waiting process, which holds no Ray, then says how the run
stopped and ends with 128 + the signal, as the driver would have.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in the environment of a ``ray job submit`` entrypoint."""


class Stop(KeyboardInterrupt):
    """A stop signal arrived (``signum``), or something stopped the run as one would."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_of(error: BaseException, signals: "StopSignals | None" = None) -> int:
    """The signal that stopped a command: the first one its handlers saw (Ray's ``get`` turns
    a ``Stop`` raised inside it into a plain ``KeyboardInterrupt``), else the error's own,
    else SIGINT (Python's own Ctrl-C)."""
    if signals is not None and signals.first is not None:
        return signals.first
    return int(getattr(error, "signum", signal.SIGINT))


def exit_code(error: BaseException, signals: "StopSignals | None" = None) -> int:
    """The exit code a stopped command returns: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + signal_of(error, signals)


def signal_name(error: BaseException, signals: "StopSignals | None" = None) -> str:
    return signal.Signals(signal_of(error, signals)).name


class StopSignals:
    """What ``stop_on_signals`` saw: ``count`` signals, the first ``first`` (a signal number)."""

    RESEND_S = 0.5
    """How often the first signal's ``Stop`` is looked for, and raised again when lost."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS) -> None:
        self.signals = signals
        self.count = 0
        self.first: int | None = None
        self.armed = False
        self._again = False
        self._done = threading.Event()
        self._lock = threading.Lock()  # taken() and a resend, never at once

    def arm(self) -> None:
        """Install the handlers (again after ``ray.init``: a Ray whose own SIGTERM handler,
        ``sys.exit(15)``, ``local_ray.init_ray`` could not keep out, replaced them; it left Ray's
        native stack dump and exit 134 behind)."""
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                signal.signal(s, self.handle)
            self.armed = True

    def handle(self, signum, frame) -> None:
        if self._again:  # the Stop raised before was lost: the same one again, not a new signal
            self._again = False
            if self._done.is_set():  # it came after the command took its Stop or left: nothing to do
                return
            raise Stop(self.first)
        self.count += 1
        if self.count == 1:
            self.first = int(signum)
            threading.Thread(target=self._watch, name="knapray-stop", daemon=True).start()
            raise Stop(signum)

    def heard(self, inner: "StopSignals") -> None:
        """The signals an inner ``stop_on_signals`` saw count here too: after its first, the
        next signal is a second one (counted), not a first whose new ``Stop`` would replace the
        one the command is handling. A signal sent to every process of a command's tree reaches
        a driver in a child twice (``drive_in_child``'s parent forwards it), the second often
        after the inner handlers are gone: its ``Stop`` took the place of the run's
        ``Interrupted``, and the command waited 9 s in Ray's exit hook on the servers the signal
        had stopped."""
        if inner.count:
            self.first = self.first if self.first is not None else inner.first
            self.count += inner.count

    def taken(self) -> None:
        """The command has the ``Stop`` and stops: no more looking for it (call where it is
        handled and the command goes on inside ``stop_on_signals``)."""
        with self._lock:  # after this no resend is sent, and one under way is ignored (handle)
            self._done.set()

    def _watch(self) -> None:
        """Raise the first signal's ``Stop`` again while nobody handles it. Python loses an
        exception raised where it cannot propagate ("Exception ignored in": a fork hook, such
        as the one ``logging`` runs after each fork ``ray.init`` makes, or a ``__del__``), and
        a library's bare ``except:`` (an optional import, for one) swallows it: the command
        went on to train to the end, and later signals were only counted. Sent to the main
        thread as a signal, from here: it wakes a system call there too."""
        main = threading.main_thread().ident
        while not self._done.wait(self.RESEND_S):
            with self._lock:
                if not self._done.is_set() and not _handling_interrupt(main):
                    self._again = True
                    signal.pthread_kill(main, self.first)


def _handling_interrupt(thread: int) -> bool:
    """Whether ``thread`` is in an ``except`` or ``finally`` block of a ``KeyboardInterrupt``
    (a ``Stop``, or what it became: an error raised while handling it has it as its context)."""
    current = getattr(sys, "_current_exceptions", None)
    if current is None:  # not in this Python: assume handled, never raise twice
        return True
    error = current().get(thread)
    if isinstance(error, tuple):  # Python 3.10, 3.11: exc_info
        error = error[1]
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, KeyboardInterrupt):
            return True
        error, seen = error.__context__, seen + 1
    return False


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = SIGNALS) -> Iterator[StopSignals]:
    """Inside: the first SIGINT or SIGTERM raises ``Stop`` in the main thread; later ones are
    counted. The handlers before it are back afterwards. Outside the main thread (where
    Python takes no handler) it does nothing."""
    seen = StopSignals(signals)
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    before = {s: signal.getsignal(s) for s in signals}
    hook = sys.unraisablehook

    def quiet(unraisable) -> None:  # a Stop Python lost: raised again (StopSignals._watch), no traceback
        if not isinstance(unraisable.exc_value, Stop):
            hook(unraisable)

    sys.unraisablehook = quiet
    seen.arm()
    try:
        yield seen
    finally:
        seen.taken()
        outers = [getattr(handler, "__self__", None) for handler in before.values()]
        for outer in {id(o): o for o in outers if isinstance(o, StopSignals)}.values():
            outer.heard(seen)  # before its handlers are back
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        sys.unraisablehook = hook


PR_SET_PDEATHSIG = 1


def stop_with_parent() -> bool:
    """Linux, in a ``ray job submit`` entrypoint: SIGTERM this process when its parent (the
    job's ``/bin/sh -c``) dies, as it would be stopped with it. True when armed. A parent
    that died while this was being armed sends SIGTERM now."""
    if RAY_JOB_ENV not in os.environ:
        return False
    return _stop_with(os.getppid())


# ---- ending the process ----------------------------------------------------------------


def run_main(main: Callable[[], "int | None"]) -> NoReturn:
    """The ``__main__`` of a command: ``sys.exit(main())``, ended by ``exit_now``. A
    ``SystemExit`` with a status (argparse's usage error) ends the same way; an exception
    goes on as under ``sys.exit``, with its traceback and Python's own exit."""
    _OWN_PROCESS[0] = True
    try:
        code = main()
    except SystemExit as e:
        if not (e.code is None or isinstance(e.code, int)):
            raise
        code = e.code
    exit_now(0 if code is None else code)


def exit_now(code: int) -> NoReturn:
    """End this process with status ``code`` as Python's exit would, less its teardown.

    A command that imported torch (and its distributed checkpoint stack, the compiler, Ray)
    spends about a second of CPU after its work is done in the interpreter's clearing of
    those thousands of modules one by one (``import knapray.driver.launch`` alone: 2.5 CPU-s
    with it, 1.7 without), which the suite's hundreds of commands and ranks pay each. Every
    step of a normal exit before that teardown is taken here, in the interpreter's order:
    ``threading._shutdown`` (the thread pools' exit hooks, then every non-daemon thread
    joined), the ``atexit`` handlers (Ray's shutdown, logging's flush, multiprocessing's and
    temporary files' clean-up), every file object still open for writing flushed (what the
    teardown's garbage collection would have flushed), Python's and C's standard streams
    flushed; then ``os._exit``."""
    import atexit
    import gc
    import io
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()  # then this; os._exit below runs neither again
    writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():  # the exact types: a check of a proxy's class can run its code
        if type(obj) in writers:
            with contextlib.suppress(Exception):  # closed, read-only or broken: nothing to lose
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # what C code printed through stdio (NULL: every stream)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    said(code)
    os._exit(code)


def exit_at_once(code: int) -> NoReturn:
    """End this process with status ``code`` now: its streams flushed, nothing else run (Ray's
    exit hook would wait on servers that are gone)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    said(code)
    os._exit(code)


# ---- a driver in a process of its own ----------------------------------------------------

_OWN_PROCESS = [False]
"""Whether this process is a command's own (``run_main`` runs it)."""

_TELL: list[int | None] = [None]
"""In a child of ``drive_in_child``: the pipe to the waiting parent."""


def said(code: int) -> None:
    """The command's last words are out and it ends with ``code``: told to the process waiting
    for it (``drive_in_child``), which then adds none of its own; nothing elsewhere."""
    fd = _TELL[0]
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, f"{int(code)}\n".encode())


def drive_in_child(last_words: Callable[["int | None", int], str]) -> None:
    """POSIX: fork; the child returns from here and runs the rest of the command, the parent
    waits for it and never returns. The parent forwards SIGINT and SIGTERM to the child, which
    runs in a process group of its own (a terminal's Ctrl-C, or a signal to the command's
    group, reaches it once, through the parent) and is sent SIGTERM if the parent dies; a
    terminal's Ctrl-Z stops the child's group, then the parent, and ``fg`` or ``bg`` resumes
    both, as it would the command in one process. When
    the child ends having said its last words (``said``: ``exit_now`` does), the parent ends
    with the code it told; when it ends without them (Ray ended it, or a kill), the parent
    prints ``last_words(signal, status)`` (``signal``: the first one the parent was sent, else
    None; ``status``: the child's exit code, negative for the signal that killed it) on
    stderr and ends with 128 + that signal, else with the child's status (128 + a killing
    signal). It forks only a command's own process (``run_main``), never a program that called
    the command's ``main`` (a test's), and returns at once elsewhere (no fork, not the main
    thread) and in a child of its own."""
    if not _OWN_PROCESS[0] or not hasattr(os, "fork") or _TELL[0] is not None \
            or threading.current_thread() is not threading.main_thread():
        return
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    read, write = os.pipe()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # none lost between the fork and the handlers
    try:
        import warnings

        with warnings.catch_warnings():  # 3.12's warning on a fork with threads (a math library's, idle)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        os.close(read)
        os.close(write)
        return
    if pid == 0:
        os.close(read)
        _TELL[0] = write
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        _stop_with(os.getppid())
        hook = sys.excepthook

        def told(kind, value, tb) -> None:  # a traceback is its last words: exit 1
            hook(kind, value, tb)
            if not issubclass(kind, KeyboardInterrupt):
                said(1)

        sys.excepthook = told
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return
    os.close(write)
    _wait_for(pid, read, before, last_words)


def _stop_with(parent: int) -> bool:
    """Linux: SIGTERM this process when its parent, ``parent``, dies (now, if it died before
    the request was in place). Whether it was armed."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _wait_for(pid: int, read: int, mask, last_words: Callable[["int | None", int], str]) -> NoReturn:
    got: list[int] = []

    def forward(signum, frame) -> None:
        got.append(int(signum))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def suspend(signum, frame) -> None:  # Ctrl-Z: the child's group stops, then this process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTSTP)
        os.kill(os.getpid(), signal.SIGSTOP)  # (a SIGTSTP of its own would be dropped in an orphaned group)

    def resume(signum, frame) -> None:  # fg or bg: the child's group goes on too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGCONT)

    signal.signal(signal.SIGTSTP, suspend)
    signal.signal(signal.SIGCONT, resume)
    for s in SIGNALS:
        signal.signal(s, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _, status = os.waitpid(pid, 0)  # a handler that returns: the wait goes on (PEP 475)
    os.set_blocking(read, False)
    told = b""
    with contextlib.suppress(OSError):  # nothing written (BlockingIOError): nothing said
        told = os.read(read, 4096)
    code = os.waitstatus_to_exitcode(status)
    lines = told.decode(errors="replace").split()
    if lines:
        os._exit(int(lines[-1]))
    if code == 0 and not got:
        os._exit(0)
    with contextlib.suppress(Exception):
        print(last_words(got[0] if got else None, code), file=sys.stderr, flush=True)
    os._exit(128 + got[0] if got else (code if code > 0 else 128 - code))
