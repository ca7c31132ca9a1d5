"""Where the router learns which nodes to serve: a fixed list (the default), or a Ray cluster's registry.

A membership source answers, each time the router polls it, the whole set of nodes to serve now;
the router connects the new ones and drops the ones that left (their requests fail as a dead node's
do). The Ray source reads the controller actor that `pdserve up --ray` runs (pdserve/ray_cluster.py):
nodes register there when they start, again after Ray restarts them, and drop out when they stop
renewing their entry.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.wire.params import Role

log = logging.getLogger("pdserve.router")
RAY_NAMESPACE = "pdserve"


def controller_name(deployment: str) -> str:
    """The name of a deployment's controller actor in RAY_NAMESPACE."""
    return f"{deployment}-controller"


@dataclass(frozen=True)
class Member:
    """One node to serve: its role, router-facing address, and (decode nodes) KV address."""

    role: Role
    addr: str
    kv_addr: str = ""


class FixedMembership:
    """The addresses given on the command line, for good."""

    def __init__(self, cfg: RouterConfig) -> None:
        members = [Member(Role.COLOCATED, a) for a in cfg.colocated] + [Member(Role.PREFILL, a) for a in cfg.prefill]
        members += [Member(Role.DECODE, a, kv) for a, kv in zip(cfg.decode, cfg.decode_kv, strict=True)]
        self._members = members

    async def members(self) -> list[Member]:
        return list(self._members)

    def close(self) -> None:
        pass


class RayMembership:
    """The nodes registered with a deployment's controller actor on a Ray cluster."""

    def __init__(self, address: str, deployment: str) -> None:
        import ray  # only with --ray: the fixed mode needs no Ray installed

        self._ray = ray
        if not ray.is_initialized():
            on_term = signal.getsignal(signal.SIGTERM)
            ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
            signal.signal(signal.SIGTERM, on_term)  # the server's own graceful stop, not Ray's sys.exit
        try:
            self.controller = ray.get_actor(controller_name(deployment), namespace=RAY_NAMESPACE)
        except ValueError:
            raise RuntimeError(f"no pdserve deployment {deployment!r} on the Ray cluster at {address}") from None

    async def members(self) -> list[Member]:
        entries = await self.controller.members.remote()
        return [Member(Role(e["role"]), e["listen"], e.get("kv_listen", "")) for e in entries]

    def close(self) -> None:
        self._ray.shutdown()


def make_membership(cfg: RouterConfig) -> FixedMembership | RayMembership:
    if cfg.ray_address:
        return RayMembership(cfg.ray_address, cfg.ray_deployment)
    return FixedMembership(cfg)
