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
