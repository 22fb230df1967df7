"""What a coordinator client raises, in a module of its own: the client, the node relay
and the trainer all name it, and none of them should import another for it."""

from __future__ import annotations


class CoordinatorUnavailable(RuntimeError):
    """The coordinator gave no plan within the client's timeout (actor dead, restarting,
    or a step that never completed): plan locally from an all-gather of lengths."""
