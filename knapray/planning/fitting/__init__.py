"""Fitting the cost model to measured times: packed-batch timings (``costfit``, ``knapray
calibrate``) and every step's per-rank times while training (``livefit``). Imports the
floors below ``search``.
"""
