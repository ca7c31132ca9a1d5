"""How one request's KV moves from a prefill node's pool into a decode node's pool.

One small interface, three backends:
- `zmq`: per layer, the request's whole blocks go as one raw frame (copy=False) after a KvData
  header, gathered into one contiguous `[2, nkv, n * bs, d]` tensor first (a slice per K/V head
  of the head-major pool); works across hosts (tcp://) or on one host (ipc://).
- `shm`: the prefill node's whole pool lives in POSIX shared memory; at pairing the decode node maps
  it once, and each transfer is only block ids over ZeroMQ and one block copy on the decode side.
- `cuda_ipc`: the same as shm for GPU pools: a CUDA IPC handle of the prefill pool crosses once,
  then the decode node copies blocks device to device.

Prefill side: `storage()` (where the pool lives), `handle()` (sent in KvHello), `pack()`.
Decode side: `attach(handle)` per prefill peer, then `unpack()` per transfer.
"""

from __future__ import annotations

import _posixshmem
import enum
import mmap
import os
import uuid
import warnings
from multiprocessing import shared_memory

import torch

from pdserve.common import protocol as P
from pdserve.common.kv_cache import DTYPES, KVLayout, KVPool


class TransferState(enum.Enum):
    PENDING = "pending"  # offered, waiting for the decode node to reserve blocks
    TRANSFERRING = "transferring"  # data sent, waiting for the ack
    DONE = "done"
    FAILED = "failed"


class TransferError(ValueError):
    pass


class ZmqBackend:
    """One message per layer, so that gathering, the wire and scattering overlap layer by layer."""

    name = "zmq"

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor | None:
        return None

    def handle(self) -> dict:
        return {}

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int):
        """Yield (header, frames) per layer: the request's whole blocks gathered into one frame."""
        blocks = block_ids[: -(-num_tokens // pool.block_size)]
        for layer in range(pool.layout.num_layers):
            kv = pool.export_blocks(layer, blocks).cpu()  # [2, nkv, n_blocks * bs, d]
            yield P.KvData(request_id, pool.layout.dtype, list(kv.shape), layer), [kv.view(torch.uint8).numpy()]

    def attach(self, handle: dict, layout: KVLayout, device: str) -> object:
        return None

    def alive(self, handle: dict) -> bool:
        """Whether the peer's pool behind `handle` still exists (only shared pools can tell)."""
        return True

    def forget(self, handle: dict) -> None:
        """Drop our mapping of a peer's pool."""

    def unpack(self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: P.KvData, frames, source) -> int:
        """Land one layer; return how many layers it carried."""
        lay = pool.layout
        n_blocks = -(-num_tokens // pool.block_size)
        expected = [2, lay.num_kv_heads, n_blocks * pool.block_size, lay.head_dim]
        if header.dtype != lay.dtype or list(header.shape) != expected:
            raise TransferError(f"KV of shape {header.shape} {header.dtype}, expected {expected} {lay.dtype}")
        if not 0 <= header.layer < lay.num_layers or len(frames) != 1:
            raise TransferError(f"KV message for layer {header.layer} with {len(frames)} frames")
        nbytes = DTYPES[lay.dtype].itemsize * _numel(expected)
        buf = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
        if buf.nbytes != nbytes:
            raise TransferError(f"KV frame of {buf.nbytes} bytes, expected {nbytes}")
        with warnings.catch_warnings():  # zmq frames are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.frombuffer(buf, dtype=DTYPES[lay.dtype]).view(expected)
        pool.import_blocks(header.layer, dst_blocks[:n_blocks], kv)
        return 1

    def close(self) -> None:
        pass


class _SharedPoolBackend:
    """Shared by shm and cuda_ipc: the prefill pool is mapped once, transfers copy blocks."""

    name = "shared"

    def alive(self, handle: dict) -> bool:
        return True

    def forget(self, handle: dict) -> None:
        pass

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int):
        """One header naming the source blocks; no frames."""
        n_blocks = -(-num_tokens // pool.block_size)
        self.sync()
        shape = [2, pool.layout.num_kv_heads, num_tokens, pool.layout.head_dim]
        yield P.KvData(request_id, pool.layout.dtype, shape, -1, list(block_ids[:n_blocks])), []

    def sync(self) -> None:
        pass

    def unpack(self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: P.KvData, frames, source) -> int:
        """Copy every layer's blocks out of the mapped prefill pool; return the layers landed."""
        src_blocks = list(header.src_blocks)
        n_blocks = -(-num_tokens // pool.block_size)
        if len(src_blocks) != n_blocks or len(dst_blocks) < n_blocks:
            raise TransferError(f"{len(src_blocks)} source blocks for {num_tokens} tokens")
        if source is None:
            raise TransferError("this prefill node's pool is not mapped (no handshake)")
        if any(not 0 <= b < KVPool.num_blocks_of(source, pool.block_size) for b in src_blocks):
            raise TransferError("a source block id is outside the prefill pool")
        pool.copy_blocks_from(source, src_blocks, dst_blocks[:n_blocks])
        return pool.layout.num_layers


class ShmBackend(_SharedPoolBackend):
    name = "shm"

    def __init__(self) -> None:
        self._owned: shared_memory.SharedMemory | None = None
        self._mapped: dict[str, mmap.mmap] = {}

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError("--kv-transport shm is for CPU pools; use cuda_ipc on GPUs")
        shape = KVPool.shape_for(layout, num_blocks)
        nbytes = DTYPES[layout.dtype].itemsize * _numel(shape)
        self._owned = shared_memory.SharedMemory(name=f"pdserve-{uuid.uuid4().hex[:12]}", create=True, size=nbytes)
        self._nbytes, self._num_blocks = nbytes, num_blocks
        return _view(self._owned, layout.dtype, shape, nbytes)

    def handle(self) -> dict:
        return {"name": self._owned.name, "nbytes": self._nbytes, "num_blocks": self._num_blocks}

    def attach(self, handle: dict, layout: KVLayout, device: str) -> torch.Tensor:
        shape = KVPool.shape_for(layout, int(handle["num_blocks"]))
        nbytes = DTYPES[layout.dtype].itemsize * _numel(shape)
        if int(handle["nbytes"]) != nbytes:
            raise TransferError("shared pool size does not match its layout")
        fd = _posixshmem.shm_open("/" + str(handle["name"]), os.O_RDWR, mode=0o600)
        try:  # mapped directly: a SharedMemory here would let our resource tracker unlink the owner's segment
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._mapped[str(handle["name"])] = mm
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(DTYPES[layout.dtype]).view(shape)

    def alive(self, handle: dict) -> bool:
        """The owner unlinks its segment when it stops (its resource tracker does, if it was killed)."""
        return os.path.exists(f"/dev/shm/{handle.get('name', '')}")

    def forget(self, handle: dict) -> None:
        self._mapped.pop(str(handle.get("name", "")), None)  # unmapped once the last tensor on it is gone

    def close(self) -> None:
        self._mapped.clear()  # the maps close when the last tensor on them is gone
        if self._owned is not None:
            self._owned.unlink()
            self._owned = None


class CudaIpcBackend(_SharedPoolBackend):
    name = "cuda_ipc"

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
        self._pool = torch.zeros(KVPool.shape_for(layout, num_blocks), dtype=DTYPES[layout.dtype], device=device)
        self._num_blocks = num_blocks
        return self._pool

    def handle(self) -> dict:
        storage = self._pool.untyped_storage()
        dev, h, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
        return {"device": dev, "handle": h, "size": size, "offset": offset, "ref_handle": ref_h,
                "ref_offset": ref_off, "event_handle": ev_h, "event_sync": ev_sync,
                "num_blocks": self._num_blocks}  # fmt: skip

    def sync(self) -> None:
        torch.cuda.synchronize()

    def attach(self, handle: dict, layout: KVLayout, device: str) -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared_cuda(
            handle["device"], handle["handle"], handle["size"], handle["offset"], handle["ref_handle"],
            handle["ref_offset"], handle["event_handle"], handle["event_sync"],
        )  # fmt: skip
        shape = KVPool.shape_for(layout, int(handle["num_blocks"]))
        t = torch.empty(0, dtype=DTYPES[layout.dtype], device=f"cuda:{handle['device']}")
        return t.set_(storage, 0, shape, _contiguous_strides(shape))

    def close(self) -> None:
        pass


BACKENDS = {"zmq": ZmqBackend, "shm": ShmBackend, "cuda_ipc": CudaIpcBackend}


def make_backend(name: str):
    return BACKENDS[name]()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _view(shm: shared_memory.SharedMemory, dtype: str, shape, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes).view(DTYPES[dtype]).view(shape)
