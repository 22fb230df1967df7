"""The launcher without Ray (torchrun) and the GPU check's chain, on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# What the GPU machine lacks: it has torch (CUDA), numpy, pyarrow, pyyaml, matplotlib, pytest
# and hypothesis, nothing else (no Ray, no TensorBoard, no tqdm, no extras).
GPU_MACHINE_LACKS = ("ray", "tensorboard", "tqdm", "diffusers", "transformers", "tokenizers", "sentencepiece",
                     "safetensors", "accelerate", "wandb", "mlflow", "flash_attn", "jsonschema", "pytest_timeout",
                     "torchao")


@pytest.mark.dist
def test_make_gpu_check_runs_where_only_torch_and_its_basics_are_installed(tmp_path):
    """``make gpu-check``'s two commands in a Python that hides every other package (as the
    GPU machine has none of them): the test collection has no errors, and the training
    chain (torch.distributed.run -> knapray.commands.torchrun -> Trainer, 2 gloo ranks) runs
    without TensorBoard (a warning) and without Ray, judged as on a GPU: steps ran, loss fell,
    speed and the FLOP formula printed, a profile written."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KNAPRAY_HIDE_MODULES=",".join(GPU_MACHINE_LACKS),
               PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "bare_torch"), str(REPO)]))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    probe = run("-c", "import importlib.util as u; print([u.find_spec(m) for m in ('ray', 'tensorboard', 'tqdm')])")
    assert probe.stdout.strip() == "[None, None, None]", probe.stderr  # the hiding works
    tests = run("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:timeout", "tests")
    assert tests.returncode == 0 and "error" not in tests.stdout.lower(), tests.stdout[-3000:]
    out = run("-m", "knapray.commands.gpu_check", "--cpu", "--nproc", "2", "--topology", "g2n1", "--steps", "8",
              "--profile", "--out", str(tmp_path))
    assert out.returncode == 0 and "GPU CHECK PASSED" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the tensorboard package is not installed" in out.stdout + out.stderr
    assert not (tmp_path / "cpu" / "tensorboard").exists() and (tmp_path / "cpu" / "metrics.jsonl").exists()
    text = out.stdout
    assert "steps                8 (thread_time timing, world 2, topology g2n1)" in text
    for line in ("loss first -> last", "tokens/s", "model TFLOP/s/GPU", "model FLOPs = 3 (fwd+bwd) x 2 blocks"):
        assert line in text
    assert (tmp_path / "cpu" / "summary.json").exists() and "cpu: passed" in text
    # The kernel ceiling measured beside the run, at its shape (on a GPU: the run's share of it)
    assert "kernel ceiling" in text and "not compared on CPU" in text
    # --profile: steps 5..7 on every rank (metrics.profile_steps), rank 0's summary printed
    assert "profile (rank 0):\nprofiled steps: 3," in text
    for rank in (0, 1):
        assert (tmp_path / "cpu" / "profile" / f"rank{rank}.trace.json").exists()


def _wheel(folder: Path, package: str, version: str, extra: dict[str, str] | None = None) -> Path:
    """A minimal wheel of an empty ``package`` (what a folder of optional GPU wheels holds),
    with ``extra`` files beside it (name: text)."""
    import zipfile

    dist = f"{package}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {f"{package}/__init__.py": f"__version__ = {version!r}\n", **(extra or {}),
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.mark.dist
def test_make_gpu_bench_rehearsed_where_only_torch_is_installed(tmp_path):
    """``PYTHON=python3 make gpu-bench GPU_WHEELS=...`` as the GPU machine runs it, on CPU
    (``--cpu``): the optional wheels installed offline and found, the gradient stage, a run
    profiled with its top kernels and kernel ceiling, and one JSON file with every number."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "flash_attn", "0.0.1")  # a package of that name without the kernels: not used
    # A wheel whose .pth puts a folder of its own on the path (as nvidia-cutlass-dsl does for FA4),
    # and a split-off piece of it as a .tar.xz laid over: FA3's module is found only through both.
    _wheel(wheels, "fa_stub", "0.0.1", {"fa_stub.pth": "import sys, os, fa_stub; "
                                        "sys.path.insert(0, os.path.join(fa_stub.__path__[0], 'dsl'))\n"})
    piece = tmp_path / "piece"
    (piece / "fa_stub" / "dsl").mkdir(parents=True)
    (piece / "fa_stub" / "dsl" / "flash_attn_interface.py").write_text("")
    subprocess.run(["tar", "-cJf", str(wheels / "fa_stub-dsl.tar.xz"), "-C", str(piece), "fa_stub"], check=True)
    out_json = tmp_path / "bench.json"
    # The wheel folder brings flash_attn (a stand-in here) and torchao (on the GPU machine the real
    # wheel, carried: parallel.fp8's stage; here the installed one stays visible).
    lacks = [m for m in GPU_MACHINE_LACKS if m not in ("flash_attn", "torchao")]
    env = dict(os.environ, OMP_NUM_THREADS="1", KNAPRAY_HIDE_MODULES=",".join(lacks),
               PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "bare_torch"), str(REPO)]))
    env.pop("MAKEFLAGS", None)
    out = subprocess.run(["make", "-s", "gpu-bench", f"PYTHON={sys.executable}", f"GPU_WHEELS={wheels}",
                          f"GPU_WHEELS_DIR={tmp_path / 'site'}",
                          f"GPU_BENCH_JSON={out_json}", f"GPU_BENCH_FLAGS=--cpu --no-sampling --steps 8 --out {tmp_path / 'work'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout
    assert out.returncode == 0 and "GPU CHECK PASSED" in text, text[-3000:] + out.stderr[-3000:]
    assert "attention: flash-attn installed, FA3 installed, FA4 absent, torch flash kernels torch's own (FA2)" in text
    assert "== gradients: compiled bf16 against a float64 eager copy" in text and "ratio" in text
    assert "top 10 by total time:" in text and "kernel ceiling" in text
    assert "== fp8: parallel.fp8's gradients" in text and "+fp8-tensorwise" in text, text[-3000:]
    assert "bf16 / float8: tensorwise" in text and "host syncs per step:" in text
    report = json.loads(out_json.read_text())
    assert report["gradients"][0]["passed"] and report["gradients"][0]["family"] == "wan"
    assert report["fp8"]["gradients"]["passed"] and set(report["fp8"]["matmuls"]["speedup"]) == {"tensorwise", "rowwise"}
    (run,) = report["runs"]
    assert run["name"] == "cpu" and run["steps"] == 8 and run["exit_code"] == 0 and not run["failures"]
    assert len(run["profile"]["top"]) >= 10 and run["ceiling"]["tflops"] > 0
    assert run["formula"].startswith("model FLOPs = 3 (fwd+bwd)") and run["recompiles"] == 0


def test_torchrun_without_a_corpus_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  corpus: {tmp_path / 'nowhere'}\nbalance:\n  topology: g1n1\n")
    out = _run(["-m", "knapray.commands.torchrun", "--config", str(cfg)])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.corpus" in lines[0] and "nowhere" in lines[0], out.stderr


def test_torchrun_bad_override_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  name: x\n")
    out = _run(["-m", "knapray.commands.torchrun", "--config", str(cfg), "--set", "optim.lr=fast"])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.lr" in lines[0] and "fast" in lines[0], out.stderr


def test_gpu_check_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = _run(["-m", "knapray.commands.gpu_check"])
    assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_gpu_check_stops_a_run_with_everything_under_it():
    """A run out of time goes with its children (torchrun's rank processes hold the GPU)."""
    import signal
    import time

    from knapray.testing.gpu_check import _stop_tree

    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    proc = subprocess.Popen([sys.executable, "-c", sleeper + "time.sleep(60)"], start_new_session=True)
    time.sleep(1.0)
    os.killpg(proc.pid, 0)  # the group is there (parent and child)
    _stop_tree(proc)
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break  # nobody left in the group
        time.sleep(0.1)
    else:
        pytest.fail("a process of the run's group outlived _stop_tree")


@pytest.mark.dist
def test_a_corpus_found_mostly_bad_under_torchrun_is_one_line(tmp_path):
    """Three rows in four hold an infinite latent: the ranks stop together and the user
    reads one line from rank 0, not a traceback per rank."""
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from knapray.corpus import CORPUS_SCHEMA, shard_paths
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0", steps=8, scale=4, channels=4, text_dim=16,
                                    pooled_dim=16, shards=2, seed=4), corpus, progress=False)
    for shard in shard_paths(corpus):
        rows = pq.read_table(shard).to_pylist()
        for i, row in enumerate(rows):
            if i % 4:
                row["latent"][0] = math.inf
        pq.write_table(pa.Table.from_pylist(rows, schema=CORPUS_SCHEMA), shard)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  corpus: {corpus}\n  samples_per_step: 2\nbalance:\n  topology: g1n2\n"
                   f"run:\n  name: bad\n  storage: {tmp_path}\nmodel:\n  hidden_size: 32\n  num_heads: 2\n"
                   "  depth_double: 1\n  depth_single: 1\n  rope_axes_dim: [4, 6, 6]\n")
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"--log-dir={tmp_path / 'logs'}",
                "-m", "knapray.commands.torchrun", "--config", str(cfg)])
    assert out.returncode != 0
    # torchrun itself reports its ranks' non-zero exits with a traceback of its own launcher;
    # none comes from a rank (no frame of knapray's code), and knapray says it once.
    assert "knapray/worker/" not in out.stderr and "knapray/driver/" not in out.stderr and "BadCorpus" not in out.stderr, out.stderr[-3000:]
    mine = [line for line in out.stderr.splitlines() if line.startswith("knapray torchrun: error: training failed")]
    assert len(mine) == 1 and "is mostly bad" in mine[0], out.stderr[-3000:]


FULL_JOURNAL = """\
import errno, os

_write, _journal_writes = os.write, [0]


def _write_refusing_the_journal(fd, data):
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = ""
    if "/ledger/journal-" in path:
        _journal_writes[0] += 1
        if _journal_writes[0] > {ok}:
            raise OSError(errno.ENOSPC, "No space left on device")
    return _write(fd, data)


os.write = _write_refusing_the_journal
"""


@pytest.mark.dist
def test_a_full_disk_at_the_journal_under_torchrun_is_one_line_naming_it(tmp_path):
    """Rank 0's ledger journal refuses its third write (ENOSPC, as a full disk does): the user
    reads one line naming the journal and the operation, and no rank's traceback (before:
    rank 1's gloo RuntimeError traceback, and rank 0's line without the path)."""
    from dist_utils import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus", "g2b2i64f1s0", steps=8)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_JOURNAL.replace("{ok}", "2"))  # the magic and one record
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  corpus: {corpus}\n  samples_per_step: 2\nbalance:\n  topology: g1n2\n"
                   f"run:\n  name: full\n  storage: {tmp_path}\n  max_steps: 6\ncheckpoint:\n  every: 0\n"
                   "model:\n  hidden_size: 32\n  num_heads: 2\n  depth_double: 1\n  depth_single: 1\n"
                   "  rope_axes_dim: [4, 6, 6]\n  text_dim: 16\n  pooled_dim: 16\ndistributed:\n  timeout_s: 60\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(inject), str(REPO)]), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          f"--log-dir={tmp_path / 'logs'}", "-m", "knapray.commands.torchrun", "--config", str(cfg)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout[-2000:]
    journal = tmp_path / "full" / "ledger" / "journal-000000000000.bin"
    mine = [line for line in out.stderr.splitlines() if line.startswith("knapray torchrun: error:")]
    assert len(mine) == 1, out.stderr[-4000:]
    assert f"appending to the ledger journal {journal}: No space left on device" in mine[0], mine
    # torchrun's own launcher traceback stays (it reports a failed rank so); none from a rank,
    # whose broken collective is at most a line of its own.
    assert "knapray/" not in out.stderr and out.stderr.count("Traceback (most recent call last)") <= 1, \
        out.stderr[-4000:]
    assert all(line.startswith("knapray torchrun: rank 1 stopped: a collective failed")
               for line in out.stderr.splitlines() if "Connection closed by peer" in line), out.stderr[-4000:]


def test_more_ranks_on_a_node_than_its_gpus_is_one_line_before_the_world_forms(monkeypatch):
    """``torchrun --nproc-per-node 4`` of a GPU run on a node of 2 GPUs: each rank binds the
    GPU of its local rank, and ranks 2 and 3 failed at an invalid device ordinal after the world
    had formed. ``check_launch`` (every rank, before joining) refuses it in one line."""
    import torch

    from knapray.commands.torchrun import check_launch
    from knapray.config.run import load_config

    cfg = load_config(None, ["scaling.use_gpu=true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launch(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"^scaling.use_gpu: torchrun starts 4 ranks on this node \(--nproc-per-node\), "
                                         r"each on a GPU of its own, and it has 2; --nproc-per-node 2 or fewer$"):
        check_launch(cfg)
    check_launch(load_config(None, ["scaling.use_gpu=false"]))  # a CPU run: any number of ranks
