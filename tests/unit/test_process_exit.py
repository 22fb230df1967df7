"""A command's process ends without the interpreter's teardown (``knapray.stopping.run_main``)
and loses nothing a normal exit keeps: its status, what it wrote to a file it left open, its
``atexit`` handlers' work, a non-daemon thread's work, an idle thread pool, its stdout."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from knapray.stopping import run_main

    left_open = open(sys.argv[1] + "/left-open", "w")  # never closed: only an exit's flush keeps it
    pool = ThreadPoolExecutor(1)  # never shut down: its idle worker must not hold the exit


    class Teardown:
        def __del__(self):  # only the interpreter's teardown of this module calls it
            with open(sys.argv[1] + "/teardown", "w") as f:
                f.write("ran")


    kept = Teardown()


    def late():
        time.sleep(0.3)
        with open(sys.argv[1] + "/thread", "w") as f:
            f.write("done")


    def handler():
        with open(sys.argv[1] + "/atexit", "w") as f:
            f.write("ran")


    def main():
        left_open.write("every byte")
        pool.submit(time.sleep, 0.01).result()
        atexit.register(handler)
        threading.Thread(target=late).start()
        print("to stdout", end="")
        if sys.argv[2] == "usage":
            raise SystemExit(2)  # argparse's way out
        return int(sys.argv[2])


    run_main(main)
""")


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                          timeout=60)


def test_a_command_ends_with_its_status_and_loses_nothing_a_normal_exit_keeps(tmp_path):
    for how, code in (("7", 7), ("0", 0), ("usage", 2)):
        for f in tmp_path.iterdir():
            f.unlink()
        done = _run(tmp_path, how)
        assert done.returncode == code, done.stderr
        assert done.stdout == "to stdout" and done.stderr == ""
        assert (tmp_path / "left-open").read_text() == "every byte"
        assert (tmp_path / "atexit").read_text() == "ran"
        assert (tmp_path / "thread").read_text() == "done"
        assert not (tmp_path / "teardown").exists()  # the teardown itself was skipped


def test_an_error_still_ends_with_its_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-c", "from knapray.stopping import run_main\n"
                           "def main():\n    raise ValueError('bad value')\nrun_main(main)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ValueError: bad value" in done.stderr


DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    from knapray.stopping import drive_in_child, run_main, stop_on_signals

    mode = sys.argv[1]


    def main():
        with stop_on_signals() as signals:
            drive_in_child(lambda signum, status: f"last words: {signum} {status}")
            try:
                print(os.getpid(), os.getpgid(0), flush=True)
                if mode == "said":
                    return 3
                if mode == "main called":
                    return 4
                if mode == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "wordless":
                    os._exit(1)
                time.sleep(30)
                return 0
            except KeyboardInterrupt:
                signals.taken()
                time.sleep(0.5)  # a second signal would be counted here
                if mode == "ray ends it":  # as Ray ends a driver whose own servers stopped: no words
                    os._exit(1)
                print(f"stopped: {signals.count} signal(s)", file=sys.stderr, flush=True)
                return 128 + signals.first


    if mode == "main called":  # by a program of its own (a test): not forked
        sys.exit(main())
    run_main(main)
""")


def _driver(mode: str, signal_to=None) -> tuple[int, int, int, str]:
    """The driver script in ``mode``; ``signal_to(parent, child, child's group)`` once the child
    runs. (exit code, the parent's pid, the child's pid, stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    child, group = (int(x) for x in proc.stdout.readline().split())
    if signal_to is not None:
        signal_to(proc.pid, child, group)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, proc.pid, child, err


def _state(pid: int, leaving: str = "") -> str:
    """The process's state letter (``/proc``: T is stopped), once it is not ``leaving`` (or
    after 10 s); the first letter other than S, R or D seen, if ``leaving`` is empty."""
    import time

    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        if time.monotonic() > deadline or (state != leaving if leaving else state not in "SRD"):
            return state
        time.sleep(0.02)


def test_a_driver_in_a_child_ends_the_command_with_its_words_or_the_parents():
    """``stopping.drive_in_child``: the child's own end (its code, its words) is the command's;
    one it could not say (Ray's ``_Exit(1)``, a kill) is said by the parent, with 128 + the
    signal the command was sent; a signal to the command, or to its process group, reaches the
    child once; the child stops when the parent is killed; a program that calls the command's
    ``main`` itself is not forked."""
    import os
    import signal

    found = []
    code, parent, child, err = _driver("said", lambda p, c, g: found.append((os.getpgid(p), g)))
    assert (code, err) == (3, "") and child != parent
    assert found == [(parent, child)]  # the command leads its own group (start_new_session), the child another
    code, parent, child, err = _driver("main called")
    assert (code, err) == (4, "") and child == parent
    code, _, _, err = _driver("killed")
    assert (code, err.strip()) == (128 + 9, "last words: None -9")
    code, _, _, err = _driver("wordless")
    assert (code, err.strip()) == (1, "last words: None 1")
    # a signal to the command alone: forwarded, the child stops with its own words
    code, _, _, err = _driver("stopped", lambda p, c, g: os.kill(p, signal.SIGTERM))
    assert (code, err.strip()) == (143, "stopped: 1 signal(s)")
    # to the command's process group (a terminal's Ctrl-C): the child, in a group of its own, gets it once
    code, _, _, err = _driver("stopped", lambda p, c, g: os.killpg(p, signal.SIGINT))
    assert (code, err.strip()) == (130, "stopped: 1 signal(s)")
    # to every process of the tree, the child then ended wordlessly by Ray: the parent's words, 143
    code, _, _, err = _driver("ray ends it", lambda p, c, g: (os.kill(p, signal.SIGTERM), os.kill(c, signal.SIGTERM)))
    assert (code, err.strip()) == (143, "last words: 15 1")
    # a terminal's Ctrl-Z (SIGTSTP to the command's group): the child's group stops, then the
    # command; fg (SIGCONT to the command's group) resumes both; the child then stops on one signal
    states = []

    def suspend_resume(p, c, g):
        os.killpg(p, signal.SIGTSTP)
        states.append((_state(p), _state(c)))
        os.killpg(p, signal.SIGCONT)
        states.append((_state(p, "T"), _state(c, "T")))
        os.kill(p, signal.SIGTERM)

    code, _, _, err = _driver("stopped", suspend_resume)
    assert (code, err.strip()) == (143, "stopped: 1 signal(s)")
    assert states[0] == ("T", "T") and "T" not in states[1], states
    # the parent killed outright: the child is sent SIGTERM and stops (its stderr closed: it ended)
    code, _, child, err = _driver("stopped", lambda p, c, g: os.kill(p, signal.SIGKILL))
    assert code == -9 and err.strip() == "stopped: 1 signal(s)"


NESTED = textwrap.dedent("""
    import os, signal, time
    from knapray.stopping import stop_on_signals

    with stop_on_signals() as outer:
        try:
            with stop_on_signals() as inner:  # the run's (launch._fit_or_stop)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        except KeyboardInterrupt as e:
            caught = type(e).__name__
        try:  # its second copy (drive_in_child's parent forwards what the whole tree got)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            print(caught, inner.count, outer.count, outer.first, "went on")
        except KeyboardInterrupt:
            print(caught, inner.count, outer.count, outer.first, "a new Stop")
""")


def test_a_signal_after_an_inner_stop_is_a_second_one_not_a_new_stop():
    """The signals a run's own handlers (an inner ``stop_on_signals``) saw count in the
    command's (the outer): the next one is counted, never a new ``Stop`` in place of the
    stop the command is handling. A signal to every process of a driver's tree arrives twice
    (the waiting parent forwards it); the second, a new ``Stop``, replaced the run's
    ``Interrupted`` and its "Ray is gone" with it: the command waited 9 s on Ray's exit hook
    (once in 30 runs of the tree-SIGTERM test under load)."""
    out = subprocess.run([sys.executable, "-c", NESTED], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Stop", "1", "2", str(int(signal.SIGTERM)), "went", "on"], out.stdout
