"""The ``knapray`` command's shared pieces: ``flags`` (flag definitions every subcommand
shares), ``registry`` (subcommands whose module is imported only when used), and the
subcommands whose code lives in packages that keep no command-line code (``plan``,
``simulate``, ``parity``, ``memory``, ``reference``, ``export``, ``sample``: the sampler
itself is ``models/sampling.py``). The other subcommands keep their arguments next to
their code: ``train/job.py``, ``corpus/ingest.py``, ``commands/calibrate.py``, ``benchmarks/``."""
