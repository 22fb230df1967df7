"""A command's process ends without the interpreter's teardown (``knapray.stopping.run_main``)
and loses nothing a normal exit keeps: its status, what it wrote to a file it left open, its
``atexit`` handlers' work, a non-daemon thread's work, an idle thread pool, its stdout."""

from __future__ import annotations

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
