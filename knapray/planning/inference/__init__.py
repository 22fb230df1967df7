"""Planning sampling: a batch of jobs over bags and one bag's step as a ``BalancePlan``
(``sampling``), a sampling gang's memory per rank and phase (``sampling_memory``), the
serving scheduler the gang runs (``scheduler``) and the serving simulator (``serving``).
Imports the floors below ``search`` and ``fitting``.
"""
