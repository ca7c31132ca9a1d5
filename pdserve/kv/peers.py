"""The two sides of KV transfers, torch-free: what they agree on before any KV moves (the transports a node accepts,
the one a pairing uses, whether two nodes share a host), the error a transfer raises, and the records both roles
keep: a peer (`KvPeer`) and a request's transfer with its state (`KvTransfer`, `TransferState`)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pdserve.wire.params import KvTransport

if TYPE_CHECKING:
    from pdserve.kv.backend import KvBackend

L = TypeVar("L")  # how a peer is reached
R = TypeVar("R")  # the request a transfer carries the KV of


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


class TransferState(StrEnum):
    """Where one request's KV stands between two nodes, as either side tracks it. A transfer moves only forward:
    QUEUED (prefill side: the offer waits for the pairing) → OFFERED (the offer went: the decode node waits for
    blocks) → PULLED (the pull named the first block to ship: the KV is on its way). It ends when its record goes
    (acknowledged, landed, failed, cancelled or aborted)."""

    QUEUED = "queued"
    OFFERED = "offered"
    PULLED = "pulled"


NEXT_STATE = {TransferState.QUEUED: TransferState.OFFERED, TransferState.OFFERED: TransferState.PULLED}


@dataclass(eq=False)
class KvPeer(Generic[L]):
    """The other end of KV transfers, as either role keeps it. `link` is how to reach it: the prefill node's sockets
    to one decode node, the decode node's routing id of one prefill connection. Pairing sets `backend` (the transport
    both chose) and, on the decode side, the prefill pool's `handle` and what `backend.attach` mapped of it."""

    link: L
    name: str = ""  # in logs and errors (prefill side: the decode node's address)
    backend: KvBackend | None = None
    paired: bool = False
    refused: str = ""  # why the decode node refused to pair (prefill side)
    handle: dict = field(default_factory=dict)  # the prefill pool's, from its KvHello (decode side)
    source: Any | None = None  # the prefill pool mapped by backend.attach (decode side; None over zmq)


@dataclass(eq=False)
class KvTransfer(Generic[R]):
    """One request's KV between two nodes, as either side tracks it (see TransferState)."""

    request: R
    peer: KvPeer
    state: TransferState = TransferState.OFFERED
    started: float = field(default_factory=time.monotonic)  # prefill side: the lease's start, renewed by KvWaiting
    pulled_at: float = 0.0  # time.monotonic() of the pull
    first_block: int = 0  # the first prompt block pulled (the decode node had the KV of those before cached)
    checksums: list[int] = field(default_factory=list)  # the sender's CRC-32 per layer of the KV it ships
    layers_landed: int = 0  # decode side
    offered: Any | None = None  # decode side: the offer's KvData naming the prompt's blocks in a shared pool
    offered_at: float = 0.0  # decode side: time.perf_counter() of the offer
    copying: bool = False  # decode side: the background copy out of the shared pool runs
    cancelled: bool = False  # decode side: aborted while copying (its blocks are freed once the copy is done)

    def move(self, to: TransferState) -> None:
        """Go one state forward; ValueError for any other move."""
        if NEXT_STATE.get(self.state) is not to:
            raise ValueError(f"a KV transfer cannot go from {self.state} to {to}")
        self.state = to

    def pulled(self, first_block: int) -> None:
        """The pull: KV from prompt block `first_block` on is on its way."""
        self.move(TransferState.PULLED)
        self.pulled_at, self.first_block = time.monotonic(), first_block
