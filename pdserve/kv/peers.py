"""What the two sides of a KV transfer agree on before any KV moves, torch-free: the transports a node accepts,
the one a pairing uses, whether two nodes share a host, and the error a transfer raises."""

from __future__ import annotations

import socket

from pdserve.wire.protocol import KvTransport


class TransferError(ValueError):
    pass


def accepted_transports(configured: KvTransport, device: str) -> tuple[KvTransport, ...]:
    """The backends a node configured with `--kv-transport configured` moves KV with, preferred first.
    auto: a shared pool (shm on the CPU, cuda_ipc on a GPU) with peers on this host, zmq with the others."""
    if configured == KvTransport.AUTO:
        return (KvTransport.CUDA_IPC if device.startswith("cuda") else KvTransport.SHM, KvTransport.ZMQ)
    return (KvTransport(configured),)


def choose_transport(offered: list[str], accepted: tuple[KvTransport, ...], same_host: bool) -> str:
    """The first transport the prefill node offers that the decode node accepts and that reaches it
    (a shared pool only on the same host), or "" if there is none."""
    for name in offered:
        if name in accepted and (name == KvTransport.ZMQ or same_host):
            return name
    return ""


def default_host_id() -> str:
    """What tells two nodes they share a host (and so may share memory): hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
