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
  (``KernelPreference``, ``ScaleCalculationMode``), torchao's to change;
- diffusers' "Unable to import `torchao` Tensor objects. This may affect loading checkpoints
  serialized with `torchao`" (diffusers 0.42 on torchao 0.18, whose ``torchao.dtypes`` no
  longer has ``NF4Tensor``), when its quantizers are imported by the first model it loads: a
  VAE at every ``knapray sample`` and ``ingest``. knapray loads no torchao-serialized model.

``load_torchao_quietly`` imports torchao first with its records about its extensions dropped,
so that a later import of it (by peft, transformers, diffusers or knapray's float8 code) finds
it loaded; torch's Enum deprecation and diffusers' line are dropped from then on, since
torchao's submodules register more Enums as they are imported (``ScaleCalculationMode`` by
transformers' quantizers, after torchao itself) and diffusers imports its quantizers later.
Every other record of these loggers is kept (knapray registers no Enum), and a torchao that
fails to import is left to whatever needs it to report.
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
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
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


LASTING = ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")
"""The loggers whose ``_DROPPED`` records are dropped for good, not only during torchao's import."""


def _drop_lasting() -> None:
    for name in LASTING:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(_DROPPED[name]))


def load_torchao_quietly() -> None:
    """Import torchao, where it is installed and not yet imported, without its import-time
    lines about extensions knapray does not use (module docstring)."""
    if importlib.util.find_spec("torchao") is None:
        return
    _drop_lasting()
    if "torchao" in sys.modules:
        return
    with _extension_lines_dropped():
        try:
            import torchao  # noqa: F401
        except Exception:  # noqa: BLE001 - a broken torchao: reported by whatever imports it next
            sys.modules.pop("torchao", None)
