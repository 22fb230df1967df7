"""The training worker: what runs in each rank's process, under any launcher (Ray Train or
torchrun). ``trainer`` (the loop) with its parts: ``step_planner`` (a step's plan, from the
coordinator or made locally), ``ledger_keeper`` and ``ledger_files`` (the sample ledger),
``balanced`` (the model on a plan), ``parallelize`` (FSDP2, checkpointing, compile),
``checkpoint`` and ``safe_dcp``, ``optim``, ``ema``, ``guard`` (bad data), ``metrics`` and
``sinks``, ``timing``, ``profiling``, ``startup``, ``validation``; ``context``: what a
launcher gives the trainer. Nothing here starts Ray or reads the command line."""
