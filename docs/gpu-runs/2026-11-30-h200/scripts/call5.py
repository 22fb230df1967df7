"""The sampling section's side by side, with the traceback of any failure; on a failure in
the warm-up, once more without knapray's warm-up (the untimed first loop compiles instead)."""
import json
import os
import sys
import time
import traceback

import knapray.worker.denoise as denoise
from knapray.testing import sample_bench as sb

log = lambda line: print(line, flush=True)  # noqa: E731
t0 = time.perf_counter()
try:
    r = sb.flux_side_by_side(sb.FLUX_DEV, "cuda", repeats=2, log=log)
except Exception:  # noqa: BLE001
    traceback.print_exc()
    sys.stdout.flush()
    print(f"== failed after {time.perf_counter() - t0:.0f} s; again without knapray's warm-up", flush=True)
    denoise.warm_up = lambda model, steps=1: None
    r = sb.flux_side_by_side(sb.FLUX_DEV, "cuda", repeats=2, log=log)
r.pop("rows_latents", None)
open(os.path.join(os.environ["OUT"], "side_by_side.json"), "w").write(json.dumps(r, indent=1, default=str))
print(f"done in {time.perf_counter() - t0:.0f} s")
