"""Every synchronizing CUDA op of a rank process, by its knapray call stack, counted."""
import atexit
import collections
import os
import sys
import traceback
import warnings

_counts = collections.Counter()
_steps = []


def _show(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    if "synchroniz" not in text:
        return _orig(message, category, filename, lineno, file, line)
    frames = [f for f in traceback.extract_stack()[:-1] if "knapray" in f.filename]
    key = tuple(f"{f.filename.split('knapray/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:])
    _counts[key] += 1


def _report():
    if not _counts:
        return
    out = os.environ.get("SYNC_SITES_OUT")
    lines = [f"== synchronizing CUDA ops by knapray stack (pid {os.getpid()}), count over the run:"]
    for key, n in _counts.most_common():
        lines.append(f"{n:6d}  " + "  <  ".join(reversed(key)))
    text = "\n".join(lines) + "\n"
    sys.stderr.write(text)
    if out:
        with open(out, "a") as f:
            f.write(text)


def _arm():
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")


_orig = warnings.showwarning
warnings.showwarning = _show
warnings.filterwarnings("always", message=".*synchroniz.*")
atexit.register(_report)
if os.environ.get("SYNC_SITES_ARM") == "1" and "LOCAL_RANK" in os.environ:  # a rank under torch.distributed.run
    _arm()
