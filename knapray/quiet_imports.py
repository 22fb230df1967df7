"""torchao's import, without the lines it prints that a knapray user cannot act on.

torchao (the ``fp8`` extra) is imported by peft and transformers whenever it is installed, so
by every LoRA command (``knapray memory``, ``dryrun``, ``train``, ``export`` of a LoRA run) and
by ingest's encoders, besides float8 runs. Importing it printed, before anything of
knapray's (torchao 0.18 on torch 2.13, this machine):

- ``Failed to load .../torchao/_C_mxfp8...so`` and ``.../_C_cutlass_90a.abi3.so``: its
  compiled extensions, built for one Python and one GPU architecture (torchao says
  ``Skipping import of cpp extensions`` instead on a torch older than it supports). knapray
  calls none of them: its float8 training is torchao's ``Float8Linear`` over torch's own
  scaled matmul;
- torch's deprecation warning for each Enum class torchao registers with pytree
  (``KernelPreference``, ``ScaleCalculationMode``), torchao's to change.

``load_torchao_quietly`` imports torchao first with its records about its extensions dropped,
so that a later import of it (by peft, transformers, diffusers or knapray's float8 code) finds
it loaded; torch's Enum deprecation is dropped from then on, since torchao's submodules
register more Enums as they are imported (``ScaleCalculationMode`` by transformers' quantizers,
after torchao itself). Every other record of either logger is kept (knapray registers no
Enum), and a torchao that fails to import is left to whatever needs it to report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator

_DROPPED = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
"""Logger -> what the messages of its dropped records contain."""


class _Drop(logging.Filter):
    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(t in message for t in self.texts)


@contextlib.contextmanager
def _extension_lines_dropped() -> Iterator[None]:
    logger, f = logging.getLogger("torchao"), _Drop(_DROPPED["torchao"])
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _drop_enum_deprecation() -> None:
    logger = logging.getLogger("torch.utils._pytree")
    if not any(isinstance(f, _Drop) for f in logger.filters):
        logger.addFilter(_Drop(_DROPPED["torch.utils._pytree"]))


def load_torchao_quietly() -> None:
    """Import torchao, where it is installed and not yet imported, without its import-time
    lines about extensions knapray does not use (module docstring)."""
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    _drop_enum_deprecation()
    with _extension_lines_dropped():
        try:
            import torchao  # noqa: F401
        except Exception:  # noqa: BLE001 - a broken torchao: reported by whatever imports it next
            sys.modules.pop("torchao", None)
