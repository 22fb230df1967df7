"""The run configuration: its sections (``run``: every section of a run config, the YAML
loader with its one-line errors, ``load_config``; ``parallel``: the parallel section the
worker applies). Below the worker and the driver, above the models and the coordinator whose
sections it embeds."""
