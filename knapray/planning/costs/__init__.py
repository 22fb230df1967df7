"""What a plan costs: the paper's work estimate (``WorkloadModel``), predicted seconds per rank
(``CostModel``: compute, Ulysses, routing, rank speeds), the bytes per GPU by sharding and
checkpointing mode (``MemoryModel``) and the one rule of which blocks activation
checkpointing recomputes. Imports ``shapes`` only.
"""
