"""What-if over many steps: planning a run's steps (``runner``, ``knapray plan``), the
step-time simulator (``sim``, ``knapray simulate``) and the newest balancers' ideas beside
knapray's planners (``rivals``, ``simulate --rivals``). The top floor.
"""
