"""The one interface every KV transfer backend implements, and the in-process fake that tests move KV with.

A backend moves one request's prompt KV from a prefill node's pool into a decode node's, in four steps:
1. Prefill side, at start: `storage()` says where the pool lives (None: an ordinary tensor; shm: shared memory);
   `handle()` names it in the KvHello.
2. Decode side, at pairing: `attach(handle)` maps the prefill pool (None where nothing is mapped); `alive(handle)`
   tells when that pool is gone, `forget(handle)` unmaps it.
3. Prefill side, per pull: `pack()` yields the transfer's messages, (KvData header, frames).
4. Decode side, per message: `unpack()` lands it in the request's blocks and says how many layers it carried; once
   every layer is in, `wait_landed()` returns when the copies no longer read the sender's memory (then the KvAck
   may free it).
Implementations: `transfer.py` (zmq, shm, cuda_ipc; torch), `mock.py` (mock nodes: the messages, no KV) and
`InProcessBackend` below. Torch-free: what a pool is, the pool says (`pool.py`, or the mock engine's stand-in).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pdserve.kv.block_allocator import blocks_for
from pdserve.kv.layout import KVLayout
from pdserve.wire.messages import KvData

if TYPE_CHECKING:
    from pdserve.kv.pool import KVPool

Message = tuple[KvData, list]  # a KvData header and its raw frames, as pack() yields them and unpack() takes them


class TransferError(ValueError):
    """A KV transfer that cannot go on: a message that does not fit its request, a peer's pool that cannot be
    mapped, a lease run out."""


@runtime_checkable
class KvBackend(Protocol):
    name: str  # the transport, as --kv-transport and the pairing name it
    shared_pool: bool  # the decode node copies blocks out of the prefill pool (shm, cuda_ipc): offers name them

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> Any | None:
        """The prefill pool's storage tensor (shared where the backend shares it), or None for an ordinary one."""

    def handle(self) -> dict:
        """What the decode node needs to reach the prefill pool (sent in KvHello)."""

    def attach(self, handle: dict, layout: KVLayout, device: str) -> Any | None:
        """Map a prefill peer's pool from its handle (None where nothing is mapped); TransferError, OSError... if
        it cannot."""

    def alive(self, handle: dict) -> bool:
        """Whether the peer's pool behind `handle` still exists (only shared pools can tell)."""

    def forget(self, handle: dict) -> None:
        """Drop our mapping of a peer's pool."""

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int) -> Iterator[Message]:
        """The messages that carry the KV of `num_tokens` tokens held by `block_ids`."""

    def unpack(
        self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: KvData, frames: list, source: Any | None
    ) -> int:
        """Land one message in `dst_blocks` (from `source`, what attach() mapped); return how many layers it carried.
        TransferError when the message does not fit the request."""

    def wait_landed(self, pool: KVPool) -> None:
        """Return once the KV that unpack() landed no longer reads the sender's memory."""

    def close(self) -> None:
        """Release what the backend owns (a shared pool is unlinked)."""


class NoSharedPool:
    """The pairing side of a backend that maps nothing: the prefill pool is an ordinary tensor, its handle empty."""

    shared_pool = False

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> None:
        return None

    def handle(self) -> dict:
        return {}

    def attach(self, handle: dict, layout: KVLayout, device: str) -> None:
        return None

    def alive(self, handle: dict) -> bool:
        return True

    def forget(self, handle: dict) -> None:
        pass

    def close(self) -> None:
        pass


class InProcessBackend(NoSharedPool):
    """A fake for tests: one process, two pools, no socket. pack() yields one message per layer whose only frame is
    the exported blocks themselves ([2, nkv, n_blocks * bs, d]; a reference, not bytes), unpack() imports it.
    Every header packed is kept in `sent`, so that a test can tell what a transfer shipped."""

    name = "in_process"

    def __init__(self) -> None:
        self.sent: list[KvData] = []

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int) -> Iterator[Message]:
        blocks = block_ids[: blocks_for(num_tokens, pool.block_size)]
        for layer in range(pool.layout.num_layers):
            kv = pool.export_blocks(layer, blocks)  # [2, nkv, n_blocks * bs, d]
            header = KvData(request_id, pool.layout.dtype, list(kv.shape), layer)
            self.sent.append(header)
            yield header, [kv]

    def unpack(
        self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: KvData, frames: list, source: Any | None
    ) -> int:
        lay = pool.layout
        n_blocks = blocks_for(num_tokens, pool.block_size)
        expected = [2, lay.num_kv_heads, n_blocks * pool.block_size, lay.head_dim]
        if list(header.shape) != expected or len(frames) != 1 or list(frames[0].shape) != expected:
            raise TransferError(f"KV of shape {header.shape}, expected {expected}")
        pool.import_blocks(header.layer, dst_blocks[:n_blocks], frames[0])
        return 1

    def wait_landed(self, pool: KVPool) -> None:
        pass
