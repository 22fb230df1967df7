"""Starting Ray for a knapray command: every ``ray.init`` of knapray goes through
``init_ray``.

Given an address (``--address``, ``$RAY_ADDRESS``) it joins that cluster. Otherwise it starts
a single-machine Ray, and that Ray listens on 127.0.0.1 only: Ray's default, its node's own
address, has the GCS, the raylet, every worker and the dashboard agent listen on every
interface of the machine, open to its network (with no other node ever joining). Ray binds
them to the loopback interface exactly when its node's address is 127.0.0.1, and takes
that address only when Ray clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, what
it does on macOS and Windows; read when ``ray`` is imported, so ``init_ray`` sets Ray's
constant for the start). ``all_interfaces=True`` (``--ray-all-interfaces``) keeps Ray's
default, for the rare machine whose embedded Ray other machines must reach.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

LOOPBACK = "127.0.0.1"
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def address_given(address: str | None = None) -> str | None:
    """The cluster a command joins: ``address``, else ``$RAY_ADDRESS``, else None (it starts
    its own)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_ray(ray: Any, *, address: str | None = None, all_interfaces: bool = False, **kwargs: Any) -> Any:
    """``ray.init(**kwargs)``: joins ``address`` (or ``$RAY_ADDRESS``) if there is one, else
    starts a single-machine Ray bound to 127.0.0.1 (``all_interfaces``: to every interface,
    Ray's default). Returns what ``ray.init`` returns."""
    joined = address_given(address)
    if joined is not None:
        return ray.init(address=joined, **kwargs)
    if all_interfaces:
        return ray.init(**kwargs)
    with loopback_only():
        return ray.init(**kwargs)


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Inside: a Ray node started by this process takes 127.0.0.1 as its address (so each of
    its processes listens there only); Ray's setting as it was afterwards."""
    from ray._private import ray_constants  # Ray's switch, read where the node's address is chosen

    before_const = ray_constants.ENABLE_RAY_CLUSTER
    before_env = os.environ.get(_CLUSTERS_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_CLUSTERS_ENV] = "0"  # for the processes Ray starts that look it up themselves
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_const
        if before_env is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = before_env
