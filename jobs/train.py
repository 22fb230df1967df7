"""Entry point for `ray job submit -- python jobs/train.py --config ...` and for `make run`
(the same as `knapray train`; see knapray/commands/train.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from knapray.commands.train import main  # noqa: E402

if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
