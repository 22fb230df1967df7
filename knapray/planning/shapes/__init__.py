"""What a step is made of: the data mix (the paper's data codes), the bags a world is cut into
(``Topology``: specs, balance groups, node placement, every rank's solo bag), the aligned
blocks of a node, and a step's lengths as flat arrays. The bottom floor of ``planning``:
it imports nothing else of it.
"""
