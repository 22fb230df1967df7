"""The settings ``parallelize`` gives torch.compile (``knapray.worker.parallelize``): graphs
with knapray's autograd Functions kept by AOTAutograd's cache, and the blocks' float
attributes taken as constants, so that no block is traced and compiled twice."""

from __future__ import annotations

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
