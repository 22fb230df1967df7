"""Host work inside a loop that should be device work only: what a denoising step must
never do (``knapray.worker.denoise``: everything a step needs is built before it).

``NoHostWork`` watches the steps it is entered around (``denoise_rank(step_context=
watch.step)``) and records, with the knapray source line that did it:

- a value read back to the host: ``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``
  (also through ``np.asarray``), and any op the device would have to finish first:
  ``.item()`` at the dispatcher, ``nonzero``, boolean-mask indexing, blocking copies
  (``knapray.testing.step_watch.StepWatch``'s list of host synchronizations);
- a tensor built from host data: ``torch.tensor``, ``torch.as_tensor``, ``torch.from_numpy``.

On a CPU every tensor is a host tensor, so these are counted by what the code asks for,
not by what it costs here: the same calls on a GPU would wait for it or copy to it.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__array__")
TORCH_FUNCTIONS = ("tensor", "as_tensor", "from_numpy")


_KNAPRAY = str(Path(__file__).resolve().parents[1])
_HERE = ("host_watch.py", "step_watch.py")


def _where() -> str:
    """The innermost knapray source line on the stack outside the watches."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_KNAPRAY) and not frame.filename.endswith(_HERE):
            return f"{Path(frame.filename).relative_to(Path(_KNAPRAY).parent)}:{frame.lineno} ({frame.name})"
    return "outside knapray"


class NoHostWork:
    """Patches the calls above while open (``with NoHostWork() as watch``); ``watch.step``
    is a context a loop enters around each step, inside which they are recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.steps = 0
        self._inside = False
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "NoHostWork":
        for owner, names in ((torch.Tensor, TENSOR_METHODS), (torch, TORCH_FUNCTIONS)):
            for name in names:
                original = getattr(owner, name)
                self._saved.append((owner, name, original))
                setattr(owner, name, self._watched(f"{'Tensor.' if owner is torch.Tensor else 'torch.'}{name}",
                                                   original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _watched(self, what: str, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if self._inside:
                self._note(what)
            return original(*args, **kwargs)

        return call

    def _note(self, what: str) -> None:
        line = f"{what} at {_where()}"
        if line not in self.calls:
            self.calls.append(line)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step of the watched loop: the calls above, and the device synchronizations
        ``StepWatch`` names, are recorded (not raised) inside it."""
        from knapray.testing.step_watch import HostSync, StepWatch

        watch = StepWatch("cpu", torch.float32)
        watch.count_syncs = True
        self._inside = True
        self.steps += 1
        try:
            with watch:
                yield
        except HostSync as e:  # StepWatch raises at the first: record it, stop the loop
            self.calls.append(f"device sync: {e}")
            raise
        finally:
            self._inside = False
