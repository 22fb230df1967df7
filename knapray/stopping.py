"""Stopping a run on a signal: SIGTERM is handled as SIGINT is.

A scheduler stops a job with SIGTERM, a user with Ctrl-C (SIGINT); both must stop the run
the same way: its workers stopped, the run directory's lock and ledger closed, one line
saying where the run stopped, exit code 128 + the signal (130, 143). Inside
``stop_on_signals()`` either signal raises ``Stop`` (a ``KeyboardInterrupt``, so what
catches Ctrl-C catches it) in the main thread, once; a second signal while the first is
handled is remembered, not raised (``StopSignals.count``), so the clean-up it interrupts
is not itself interrupted. A ``Stop`` that Python dropped (raised inside a fork hook or a
``__del__``) is raised again at once (``StopSignals.dropped``), without Python's "Exception
ignored" traceback.

``stop_with_parent()``: a driver started by another process that a scheduler may stop
alone (the ``/bin/sh -c`` that ``ray job submit`` runs an entrypoint in) is sent SIGTERM
when that parent dies, so it does not train on for a job marked failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

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

    def __init__(self, signals: tuple[int, ...] = SIGNALS) -> None:
        self.signals = signals
        self.count = 0
        self.first: int | None = None
        self.armed = False
        self._again = False
        self._in_hook = False
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Install the handlers (again: ``ray.init`` puts its own SIGTERM handler in place,
        ``sys.exit(15)``, which left Ray's native stack dump and exit 134 behind)."""
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                signal.signal(s, self.handle)
            self.armed = True

    def handle(self, signum, frame) -> None:
        if self._again:  # the Stop raised before was dropped: the same one again, not a new signal
            if self._in_hook:  # still inside the hook that saw it dropped: again once it has returned
                self._later()
                return
            self._again = False
            raise Stop(self.first)
        self.count += 1
        if self.count == 1:
            self.first = int(signum)
            raise Stop(signum)

    def dropped(self) -> None:
        """Python dropped the ``Stop`` the handler raised: it was raised where an exception
        cannot propagate ("Exception ignored in": a fork hook, such as the one ``logging`` runs
        after each fork ``ray.init`` makes, or a ``__del__``). Raise it again in the main thread
        as soon as it is out of there; without this the run went on, and later signals were
        only counted."""
        self._again = True
        self._later()

    def _later(self) -> None:
        # From another thread, to the main thread: a signal tripped from within the hook would
        # run its handler at once, still in the hook, and be dropped again; a real signal also
        # wakes a main thread asleep in a system call (interrupt_main would not).
        main = threading.main_thread().ident

        def again() -> None:
            if self._again:  # not after stop_on_signals ended (its handlers are gone)
                signal.pthread_kill(main, self.first)

        self._timer = threading.Timer(0.001, again)
        self._timer.daemon = True
        self._timer.start()

    def _end(self) -> None:
        self._again = False
        if self._timer is not None:
            self._timer.cancel()


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

    def quiet(unraisable) -> None:  # a Stop Python dropped: raised again, without Python's traceback
        if isinstance(unraisable.exc_value, Stop) and seen.first is not None:
            seen._in_hook = True
            try:
                seen.dropped()
            finally:
                seen._in_hook = False
        else:
            hook(unraisable)

    sys.unraisablehook = quiet
    seen.arm()
    try:
        yield seen
    finally:
        seen._end()
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        sys.unraisablehook = hook


PR_SET_PDEATHSIG = 1


def stop_with_parent() -> bool:
    """Linux, in a ``ray job submit`` entrypoint: SIGTERM this process when its parent (the
    job's ``/bin/sh -c``) dies, as it would be stopped with it. True when armed. A parent
    that died while this was being armed sends SIGTERM now."""
    if RAY_JOB_ENV not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)
    return True
