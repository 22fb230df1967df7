"""Host -> device copies that never block the host on the device.

A copy from pageable host memory to a GPU is synchronous: the host waits until the stream
has run everything queued before it (``memcpy_and_sync``). Inside a training step that is
GPU idle time counted as compute. ``host_to_device`` copies from pinned memory with
``non_blocking=True`` instead (the caching host allocator keeps the pinned buffer alive
until the copy has run).

A ``cuda`` device without CUDA can only be a fake one (``FakeTensorMode``, what
``knapray dryrun`` runs a step on with the CPU build, which cannot copy to it at all):
there only the shape and dtype matter, and an empty tensor on the device stands in.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(
    value: np.ndarray | torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``value`` (a numpy array or a CPU tensor) on ``device`` (None: the CPU) in ``dtype``
    (None: its own), without a blocking copy."""
    t = torch.as_tensor(np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value, dtype=dtype)
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if not torch.cuda.is_available():  # a fake CUDA device (knapray dryrun)
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    if t.device.type == "cuda":
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)
