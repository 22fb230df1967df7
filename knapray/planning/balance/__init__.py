"""Balancing one step on given bags: ``plan_balance`` (KnapFormer's greedy and knapray's
solver), its parts (a balance group's problem, the starting plans, the local search, the
home repair, the memory budget, the chunks every rank computes) and what it returns
(``BalancePlan``). Imports ``shapes`` and ``costs``.
"""
