"""Choosing the bags: a static topology from recent steps (``autotopo``), a partition of every
node chosen per step (``pertopo``), the topology rules a run names (``rules``: a spec,
``bags_of:N``, ``auto``, ``per-step``) and overlapping groups (``overlap``: short sequences
whole on ranks that also serve a bag). Imports the floors below it.
"""
