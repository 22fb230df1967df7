"""Compiled bf16 gradients against a float64 eager copy, parameter by parameter, on the
families' real blocks and sequences of thousands of tokens (``knapray.testing.grad_truth``).

On the code before ``knapray.indexing``, Flux's compiled bf16 conditioning gradients were
13-15x worse than its blocks' matrix products (``mod.lin`` 23% off float64, the guidance,
timestep and pooled MLPs 16%), while the loss still fell; and Wan's blocks did not compile
at all (their attention ops were wrapped as a plain callable). ``make gpu-bench`` runs the
same comparison on CUDA.
"""

from __future__ import annotations

import pytest

from knapray.testing.grad_truth import RATIO_BAR, gradient_errors


# Flux in both bf16 modes (autocast: one rank, no FSDP; bf16 parameters: FSDP's), Wan in
# FSDP's (its autocast mode keeps its tables in fp32 already: ratio 0.47 here, not run).
@pytest.mark.parametrize("family, mode", [("flux", "autocast"), ("flux", "bf16_params"), ("wan", "bf16_params"),
                                          ("qwen_image", "bf16_params")])
def test_compiled_bf16_gradients_as_exact_as_the_matmuls(family: str, mode: str) -> None:
    report = gradient_errors(family, mode, device="cpu", compile=True)
    assert report.tokens > 7000
    assert len(report.per_token) >= 8 and len(report.errors) - len(report.per_token) >= 8
    # bf16 is bf16: the yardstick itself is a few roundings, not fp32-exact, nor broken.
    assert 2e-3 < report.yardstick < 3e-2, report.summary()
    assert report.ratio <= RATIO_BAR, report.summary()
