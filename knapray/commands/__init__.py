"""Every command's argument parsing and ``main``, above the library packages (which keep no
command-line code): ``flags`` (flag definitions every subcommand shares), ``registry``
(subcommands whose module is imported only when used), and one module per command, each
with ``add_arguments(parser)`` and ``run(args) -> int`` (and ``main(argv) -> int`` where it
is also run with ``python -m``): the ``knapray`` subcommands ``train``, ``synthetic``,
``ingest``, ``plan``, ``simulate``, ``parity``, ``memory``, ``dryrun``, ``reference``,
``export``, ``sample`` (the sampler itself is ``models/sampling.py``) and ``calibrate``;
``torchrun`` (training without Ray) and the checks run as ``python -m
knapray.commands.<name>``: ``gpu_check`` (``make gpu-check``, ``make gpu-bench``),
``elastic_check`` and ``memory_check``, whose libraries are in ``testing/``.
``benchmarks/`` (``knapray bench``) sits on this floor too and keeps each benchmark's
arguments next to its code."""
