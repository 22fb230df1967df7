"""The run config's ``parallel`` section: how a run's model is spread over its ranks
(precision, FSDP2 sharding, activation checkpointing, torch.compile). Plain values, checked
here; ``knapray.worker.parallelize`` applies them to a model."""

from __future__ import annotations

import dataclasses

from knapray.limits import MAX_MICRO_BATCHES
from knapray.planning.costs.checkpointing import AC_MODES, checkpointed_blocks

FSDP_MODES = ("none", "full", "hybrid")
PRECISIONS = ("auto", "bf16", "fp32")
COMPILE_BACKENDS = ("inductor", "aot_eager")
FP8_SCALINGS = ("tensorwise", "rowwise")


def sharding_of(fsdp: str, world_size: int | None) -> str:
    """The FSDP mode a run applies: its config's, but ``none`` on one rank (nothing to shard;
    the run computes under autocast over fp32 parameters instead). None: world unknown."""
    return "none" if world_size == 1 else fsdp


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """``parallel:`` How the model is run on the devices: precision, sharding, recomputation,
    compilation; what ``parallelize`` applies. Each field's rules (``metadata``) are checked
    when the run config is loaded (``knapray.config.run``) and again in ``__post_init__``
    for one built in code: no process group needed."""

    precision: str = dataclasses.field(default="auto", metadata={"choices": PRECISIONS})
    """Compute precision: ``bf16`` (mixed: fp32 master weights, bf16 compute under autocast,
    on CUDA and on CPU), ``fp32``, or ``auto``: bf16 on a GPU, fp32 on CPU. The trainer
    resolves it to the dtype ``parallelize`` is given (``compute_dtype``)."""
    fsdp: str = dataclasses.field(default="none", metadata={"choices": FSDP_MODES})
    """Parameter sharding (FSDP2): ``none`` (every rank holds the model; one flat all-reduce
    of gradients), ``full`` (parameters, gradients and optimizer state sharded over the
    world), ``hybrid`` (sharded within a node of ``balance.gpus_per_node`` ranks, replicated
    across nodes: a 2-D mesh). With bf16 precision FSDP gathers parameters in bf16 and
    reduces in fp32. One rank shards nothing (``for_world``)."""
    activation_checkpointing: str = dataclasses.field(default="none", metadata={"choices": AC_MODES})
    """Recompute transformer blocks in backward instead of keeping their activations:
    ``full`` (every block), ``selective`` (every block, but attention's output and
    log-sum-exp are kept, so no attention kernel runs twice: a block keeps about twice
    what ``full`` keeps), ``every_k`` (every ``ac_every``-th block: blocks k-1, 2k-1, ...
    in double-then-single order, ``knapray.planning.costs.checkpointing.checkpointed_blocks``)."""
    ac_every: int = dataclasses.field(default=2, metadata={"ge": 1, "le": MAX_MICRO_BATCHES})
    """k of ``activation_checkpointing: every_k``."""
    compile: bool = False
    """torch.compile each transformer block (dynamic shapes: packed batches change size
    every step; recompiles are counted in the metrics; attention stays eager)."""
    compile_backend: str = dataclasses.field(default="inductor", metadata={"choices": COMPILE_BACKENDS})
    """torch.compile's backend: ``inductor`` (generated kernels: what a run wants) or
    ``aot_eager`` (no code generation: compiles fast, for tests and for telling a compiler
    problem from a model one)."""
    fp8: bool = False
    """Run the linear layers of the transformer blocks (not their modulation, not the
    embedders or the final layer) as float8 matmuls, forward and backward (torchao's float8
    training, ``pip install -e '.[fp8]'``; ``knapray.worker.float8``). Needs bf16 precision;
    not with LoRA (a LoRA base is held in float8 by ``model.lora.base_dtype: fp8``)."""
    fp8_scaling: str = dataclasses.field(default="tensorwise", metadata={"choices": FP8_SCALINGS})
    """``tensorwise`` (one scale per tensor; under FSDP the weights are gathered in float8)
    or ``rowwise`` (a scale per row of each operand: closer to bf16, gathered in bf16)."""

    def __post_init__(self) -> None:
        for name, valid in (("precision", PRECISIONS), ("fsdp", FSDP_MODES), ("activation_checkpointing", AC_MODES),
                            ("compile_backend", COMPILE_BACKENDS), ("fp8_scaling", FP8_SCALINGS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        if not isinstance(self.ac_every, int) or isinstance(self.ac_every, bool) or self.ac_every < 1:
            raise ValueError(f"ac_every must be an int >= 1, got {self.ac_every!r}")
        for name in ("compile", "fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fp8 and self.precision == "fp32":
            raise ValueError("fp8 computes the block matmuls in float8 beside bf16: parallel.precision must be bf16 "
                             "(or auto on GPUs), got fp32")

    def for_world(self, world_size: int | None) -> "ParallelConfig":
        """What a world of ``world_size`` ranks applies: one rank shards nothing, FSDP there
        would only add casts and copies (``sharding_of``)."""
        return dataclasses.replace(self, fsdp=sharding_of(self.fsdp, world_size))

    def describe(self) -> dict:
        """Plain values, for JSON reports."""
        return dataclasses.asdict(self)

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        """Per block (double blocks first, then single): is it checkpointed? The one rule
        the memory model and calibration use too."""
        return checkpointed_blocks(self.activation_checkpointing, self.ac_every, num_blocks)
