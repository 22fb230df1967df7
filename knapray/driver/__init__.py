"""The driver: what runs once per run, before and after the workers. ``preflight`` (every
check before a worker starts), ``run_dir`` (where a run lives, resume or refuse, its lock and
saved config), ``launch`` (the Ray Train edge: workers, the coordinator actor, elastic
restarts), ``report`` and ``plots`` (the run's summary, ledger and pictures from its files),
``export`` and ``lora_export`` (a run's weights as diffusers checkpoints)."""
