"""Progress bars: tqdm where it is installed, else a plain line every tenth of the way
(the GPU check machine has torch but not tqdm; nothing there may need it)."""

from __future__ import annotations

import sys
from typing import Any


class _Lines:
    """The part of tqdm's interface knapray uses, printing ``desc: n/total`` lines."""

    def __init__(self, total: int | None, desc: str, unit: str, disable: bool) -> None:
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.n, self._next = 0, 0.0

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.disable or not self.total:
            return
        if self.n >= self._next or self.n >= self.total:
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}", file=sys.stderr, flush=True)
            self._next = self.n + self.total / 10

    def set_postfix(self, **_: Any) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, unit: str, *, disable: bool = False, **kwargs: Any):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc, unit, disable)
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, **kwargs)
