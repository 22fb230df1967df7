"""The settings ``parallelize`` gives torch.compile (``knapray.worker.parallelize``): graphs
with knapray's autograd Functions kept by AOTAutograd's cache, and the blocks' float
attributes taken as constants, so that no block is traced and compiled twice."""

from __future__ import annotations

import pytest
import torch

from knapray.indexing import gather_rows


def test_a_graph_holding_knapray_functions_is_kept_by_aot_autograds_cache() -> None:
    """torch leaves a graph with a custom ``autograd.Function`` out of AOTAutograd's cache:
    every process that compiled a block traced its joint graph again. ``parallelize`` lets
    the cache keep them: the second compile of the same graph (a new process, or here after
    resetting Dynamo) is a hit, and without the setting it is a bypass."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    from knapray.config.parallel import ParallelConfig
    from knapray.models import MMDiT
    from knapray.testing.parity import parity_config
    from knapray.worker.parallelize import parallelize

    def loss(table, index):
        return gather_rows(table * 2, index).float().square().sum()

    def compile_twice() -> dict:
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            table = torch.ones(3, 4, requires_grad=True)
            torch.compile(loss, backend="inductor")(table, torch.tensor([0, 1, 1, 2])).backward()
        return dict(counters["aot_autograd"])

    with functorch_config.patch(autograd_cache_allow_custom_autograd_functions=False):  # as it was, after
        before = compile_twice()
        assert before.get("autograd_cache_bypass", 0) >= 1 and not before.get("autograd_cache_hit"), before
        parallelize(MMDiT(parity_config()), ParallelConfig(compile=True))  # sets it, as every compiled run does
        assert functorch_config.autograd_cache_allow_custom_autograd_functions
        after = compile_twice()
        assert after.get("autograd_cache_hit") == 1 and not after.get("autograd_cache_bypass"), after


def test_a_blocks_float_attributes_do_not_make_it_compile_twice() -> None:
    """A block class's forward is compiled with the module as an input, so a norm's ``eps``
    came in as a symbolic float; the graph specializes it, and torch's float pass, which runs
    after the graph was traced and handed to AOTAutograd, restarted the analysis: the backend
    was called twice for the one frame. With ``specialize_floats`` it is called once."""
    import torch._dynamo.config as dynamo_config

    from knapray.worker.parallelize import specialize_floats

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eps = 1e-6
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.nn.functional.layer_norm(x, (8,), eps=self.eps))

    def backend_calls() -> int:
        calls = []

        def backend(gm, example_inputs):
            calls.append(gm)
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(Norm.forward, backend=backend, dynamic=True)
        compiled(Norm(), torch.randn(5, 8)).sum().backward()
        return len(calls)

    with dynamo_config.patch(specialize_float=False):  # as it was, after
        assert backend_calls() == 2  # traced and handed over, then again with eps specialized
        specialize_floats()
        assert dynamo_config.specialize_float
        assert backend_calls() == 1


def test_an_empty_y_grid_launches_nothing_where_the_launcher_divides_by_zero(monkeypatch):
    """torch 2.10/2.11's grid for a 2-D tiled Triton kernel divided by zero when the kernel had
    no y rows (on an H200, torch 2.11: a compiled double block called without text, in its text
    q/k norm). Here the unguarded grid (that torch's code, put back in place) fails the same way
    at ``ynumel`` 0; after ``guard_empty_y_grids`` it is a launch of no blocks, and a grid with
    rows is what it was."""
    from torch._inductor.runtime import triton_heuristics as th

    from knapray.worker.parallelize import guard_empty_y_grids

    grid = th.Grid2DWithYZOverflow

    def unguarded(self, meta):  # as torch 2.10 and 2.11 generate it
        self.x_grid = self.ceildiv("xnumel", meta.get("XBLOCK"))
        self.prefix = [self.assign_tmp("y_grid_raw_", self.ceildiv("ynumel", meta.get("YBLOCK"))),
                       self.assign_tmp("y_grid_div_", self.ceildiv("y_grid_raw_", th.get_max_y_grid()))]
        self.y_grid = self.ceildiv("y_grid_raw_", "y_grid_div_")
        self.z_grid = "y_grid_div_"

    monkeypatch.setattr(grid, "generate", unguarded)
    meta = {"XBLOCK": 64, "YBLOCK": 16}

    def launch(ynumel: int) -> tuple[int, int, int]:
        g = grid(inductor_meta={})
        g.generate(meta)
        return g.eval_slow({**meta, "xnumel": 128, "ynumel": ynumel})

    with pytest.raises(ZeroDivisionError):
        launch(0)
    big = 16 * 65535 * 3  # y blocks past CUDA's limit: split into z
    before = launch(100), launch(big)
    assert guard_empty_y_grids() and not guard_empty_y_grids()  # patched once
    assert launch(0) == (2, 0, 0)
    assert (launch(100), launch(big)) == before == ((2, 7, 1), (2, 65535, 3))
