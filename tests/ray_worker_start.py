"""The first program of every Python worker the test session's Ray starts, in place of Ray's
``setup_worker.py`` (``conftest._start_ray``): the same work without importing Ray.

Ray's raylet runs ``python setup_worker.py --serialized-runtime-env-context=J --language=L
default_worker.py ...``; Ray's program imports Ray (0.5 CPU-s here) only to read the JSON
``J`` (``RuntimeEnvContext``), set its ``env_vars`` (``${X}`` expanded, unknown ones
emptied) and exec the worker through ``bash -c``. This does the same for a Python worker
whose context has nothing but ``env_vars`` and the same interpreter, and hands anything
else (a command prefix, another interpreter, another entry point, Java) to Ray's own
program unchanged. Where the test process started a fork server
(``KNAPRAY_TEST_RAY_FORK_SERVER``, tests/ray_worker_fork.py), a plain worker is a fork of
it instead of an exec, this process staying as the pid the raylet started until the
worker ends; a request the server refuses is exec'd as before."""

import argparse
import json
import os
import re
import sys

def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, rest = parser.parse_known_args(argv)
    context = json.loads(args.serialized_runtime_env_context or "{}")
    plain = (args.language == "PYTHON" and not context.get("command_prefix")
             and context.get("py_executable") in (None, sys.executable)
             and not context.get("override_worker_entrypoint") and not context.get("java_jars")
             and set(context) <= {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint",
                                  "java_jars"})
    if not plain:
        rays = os.environ["KNAPRAY_TEST_RAY_SETUP_WORKER"]
        os.execv(sys.executable, [sys.executable, rays, *argv])
    for key, value in (context.get("env_vars") or {}).items():
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    server = os.environ.get("KNAPRAY_TEST_RAY_FORK_SERVER")
    if server:
        import ray_worker_fork

        if ray_worker_fork.ask(server, rest):
            return
    os.execv(sys.executable, [sys.executable, *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
