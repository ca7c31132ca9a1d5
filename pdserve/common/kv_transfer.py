"""How one request's KV moves from a prefill node's pool into a decode node's pool.

One small interface, three backends:
- `zmq`: the KV is gathered into one contiguous tensor and sent as raw per-layer frames (copy=False)
  after a KvData header; works across hosts (tcp://) or on one host (ipc://).
- `shm`: the prefill node's whole pool lives in POSIX shared memory; at pairing the decode node maps
  it once, and each transfer is only block ids over ZeroMQ and one block copy on the decode side.
- `cuda_ipc`: the same as shm for GPU pools: a CUDA IPC handle of the prefill pool crosses once,
  then the decode node copies blocks device to device.

Prefill side: `storage()` (where the pool lives), `handle()` (sent in KvHello), `pack()`.
Decode side: `attach(handle)` per prefill peer, then `unpack()` per transfer.
"""

from __future__ import annotations

import enum
import uuid
import warnings
from multiprocessing import resource_tracker, shared_memory

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
    name = "zmq"

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor | None:
        return None

    def handle(self) -> dict:
        return {}

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int):
        kv = pool.export(block_ids, num_tokens).cpu()  # [L, 2, n, nkv, d]
        header = P.KvData(request_id, pool.layout.dtype, list(kv.shape))
        frames = [kv[layer].view(torch.uint8).numpy() for layer in range(kv.shape[0])]
        return header, frames

    def attach(self, handle: dict, layout: KVLayout, device: str) -> object:
        return None

    def unpack(self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: P.KvData, frames, source) -> None:
        lay = pool.layout
        expected = [lay.num_layers, 2, num_tokens, lay.num_kv_heads, lay.head_dim]
        if header.dtype != lay.dtype or list(header.shape) != expected:
            raise TransferError(f"KV of shape {header.shape} {header.dtype}, expected {expected} {lay.dtype}")
        if len(frames) != lay.num_layers:
            raise TransferError(f"{len(frames)} KV frames, expected {lay.num_layers}")
        per_layer = expected[1:]
        nbytes = DTYPES[lay.dtype].itemsize * 2 * num_tokens * lay.num_kv_heads * lay.head_dim
        layers = []
        with warnings.catch_warnings():  # zmq frames are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            for f in frames:
                buf = f.buffer if hasattr(f, "buffer") else memoryview(f)
                if buf.nbytes != nbytes:
                    raise TransferError(f"KV frame of {buf.nbytes} bytes, expected {nbytes}")
                layers.append(torch.frombuffer(buf, dtype=DTYPES[lay.dtype]).view(per_layer))
        pool.import_layers(dst_blocks, layers)

    def close(self) -> None:
        pass


class _SharedPoolBackend:
    """Shared by shm and cuda_ipc: the prefill pool is mapped once, transfers copy blocks."""

    name = "shared"

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int):
        n_blocks = -(-num_tokens // pool.block_size)
        self.sync()
        shape = [pool.layout.num_layers, 2, num_tokens, pool.layout.num_kv_heads, pool.layout.head_dim]
        return P.KvData(request_id, pool.layout.dtype, shape, list(block_ids[:n_blocks])), []

    def sync(self) -> None:
        pass

    def unpack(self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: P.KvData, frames, source) -> None:
        src_blocks = list(header.src_blocks)
        n_blocks = -(-num_tokens // pool.block_size)
        if len(src_blocks) != n_blocks or len(dst_blocks) < n_blocks:
            raise TransferError(f"{len(src_blocks)} source blocks for {num_tokens} tokens")
        if source is None:
            raise TransferError("this prefill node's pool is not mapped (no handshake)")
        if any(not 0 <= b < source.shape[1] // pool.block_size for b in src_blocks):
            raise TransferError("a source block id is outside the prefill pool")
        pool.copy_blocks_from(source, src_blocks, dst_blocks[:n_blocks])


class ShmBackend(_SharedPoolBackend):
    name = "shm"

    def __init__(self) -> None:
        self._owned: shared_memory.SharedMemory | None = None
        self._mapped: list[shared_memory.SharedMemory] = []

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
        shm = shared_memory.SharedMemory(name=str(handle["name"]))
        resource_tracker.unregister(shm._name, "shared_memory")  # the owner unlinks it, not us
        self._mapped.append(shm)
        return _view(shm, layout.dtype, shape, nbytes)

    def close(self) -> None:
        for shm in self._mapped:
            shm.close()
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
