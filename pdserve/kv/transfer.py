"""How one request's KV moves from a prefill node's pool into a decode node's pool: three backends of the one
interface in backend.py (`KvBackend`).

- `zmq`: per layer, the request's whole blocks go as one raw frame (copy=False) after a KvData
  header, gathered into one contiguous `[2, nkv, n * bs, d]` tensor first (a slice per K/V head
  of the head-major pool); works across hosts (tcp://) or on one host (ipc://).
- `shm`: the prefill node's whole pool lives in POSIX shared memory; at pairing the decode node maps
  it once, and each transfer is only block ids over ZeroMQ and one block copy on the decode side.
- `cuda_ipc`: the same as shm for GPU pools: a CUDA IPC handle of the prefill pool crosses once,
  then the decode node copies blocks device to device. The handle names the GPU by its UUID, so
  the two processes may see different `CUDA_VISIBLE_DEVICES`, and names the owning process, so the
  decode node can tell when a restarted prefill node's old pool is gone and unmap it. With the pools on two
  GPUs (`--prefill-device cuda:0 --decode-device cuda:1`), the blocks go GPU to GPU where the decode GPU can
  access the prefill GPU as a peer, else through host memory (`copy_route`).
"""

from __future__ import annotations

import _posixshmem
import math
import mmap
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing import shared_memory

import torch

from pdserve.kv.backend import KvBackend, Message, NoSharedPool, TransferError
from pdserve.kv.block_allocator import blocks_for
from pdserve.kv.pool import DTYPES, KVLayout, KVPool
from pdserve.wire.messages import KvData
from pdserve.wire.params import KvTransport


class ZmqBackend(NoSharedPool):
    """One message per layer, so that gathering, the wire and scattering overlap layer by layer."""

    name = KvTransport.ZMQ

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int) -> Iterator[Message]:
        """Yield (header, frames) per layer: the request's whole blocks gathered into one frame."""
        blocks = block_ids[: blocks_for(num_tokens, pool.block_size)]
        for layer in range(pool.layout.num_layers):
            kv = pool.export_blocks(layer, blocks).cpu()  # [2, nkv, n_blocks * bs, d]
            yield KvData(request_id, pool.layout.dtype, list(kv.shape), layer), [kv.view(torch.uint8).numpy()]

    def unpack(
        self, pool: KVPool, dst_blocks: list[int], num_tokens: int, header: KvData, frames: list, source: None
    ) -> int:
        """Land one layer; return how many layers it carried."""
        lay = pool.layout
        n_blocks = blocks_for(num_tokens, pool.block_size)
        expected = [2, lay.num_kv_heads, n_blocks * pool.block_size, lay.head_dim]
        if header.dtype != lay.dtype or list(header.shape) != expected:
            raise TransferError(f"KV of shape {header.shape} {header.dtype}, expected {expected} {lay.dtype}")
        if not 0 <= header.layer < lay.num_layers or len(frames) != 1:
            raise TransferError(f"KV message for layer {header.layer} with {len(frames)} frames")
        nbytes = DTYPES[lay.dtype].itemsize * math.prod(expected)
        buf = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
        if buf.nbytes != nbytes:
            raise TransferError(f"KV frame of {buf.nbytes} bytes, expected {nbytes}")
        with warnings.catch_warnings():  # zmq frames are read-only; we only read them
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.frombuffer(buf, dtype=DTYPES[lay.dtype]).view(expected)
        pool.import_blocks(header.layer, dst_blocks[:n_blocks], kv)
        return 1

    def wait_landed(self, pool: KVPool) -> None:
        """Return once the KV that unpack() landed no longer reads the sender's memory (then the ack may
        go). Here unpack() read our own copy of the frames, which it has copied out (into pinned memory on a
        GPU) by the time it returns."""


class _SharedPoolBackend:
    """Shared by shm and cuda_ipc: the prefill pool is mapped once, transfers copy blocks."""

    name = "shared"
    shared_pool = True

    def alive(self, handle: dict) -> bool:
        return True

    def forget(self, handle: dict) -> None:
        pass

    def pack(self, pool: KVPool, request_id: str, block_ids: list[int], num_tokens: int) -> Iterator[Message]:
        """One header naming the source blocks; no frames."""
        n_blocks = blocks_for(num_tokens, pool.block_size)
        self.sync(pool)
        shape = [2, pool.layout.num_kv_heads, num_tokens, pool.layout.head_dim]
        yield KvData(request_id, pool.layout.dtype, shape, -1, list(block_ids[:n_blocks])), []

    def sync(self, pool: KVPool) -> None:
        """Make the pool's KV visible to another process before naming its blocks."""

    def unpack(
        self,
        pool: KVPool,
        dst_blocks: list[int],
        num_tokens: int,
        header: KvData,
        frames: list,
        source: torch.Tensor | None,
    ) -> int:
        """Copy every layer's blocks out of the mapped prefill pool; return the layers landed."""
        src_blocks = list(header.src_blocks)
        n_blocks = blocks_for(num_tokens, pool.block_size)
        if len(src_blocks) != n_blocks or len(dst_blocks) < n_blocks:
            raise TransferError(f"{len(src_blocks)} source blocks for {num_tokens} tokens")
        if source is None:
            raise TransferError("this prefill node's pool is not mapped (no handshake)")
        if any(not 0 <= b < KVPool.num_blocks_of(source, pool.block_size) for b in src_blocks):
            raise TransferError("a source block id is outside the prefill pool")
        pool.copy_blocks_from(source, src_blocks, dst_blocks[:n_blocks])
        return pool.layout.num_layers

    def wait_landed(self, pool: KVPool) -> None:
        """A copy between CPU pools is done when unpack() returns."""


class ShmBackend(_SharedPoolBackend):
    name = KvTransport.SHM

    def __init__(self) -> None:
        self._owned: shared_memory.SharedMemory | None = None
        self._mapped: dict[str, mmap.mmap] = {}

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError("--kv-transport shm is for CPU pools; use cuda_ipc on GPUs")
        shape = KVPool.shape_for(layout, num_blocks)
        nbytes = DTYPES[layout.dtype].itemsize * math.prod(shape)
        self._owned = shared_memory.SharedMemory(name=f"pdserve-{uuid.uuid4().hex[:12]}", create=True, size=nbytes)
        self._nbytes, self._num_blocks = nbytes, num_blocks
        return _view(self._owned, layout.dtype, shape, nbytes)

    def handle(self) -> dict:
        name = self._owned.name
        return {"name": name, "nbytes": self._nbytes, "num_blocks": self._num_blocks, "pool_id": name}

    def attach(self, handle: dict, layout: KVLayout, device: str) -> torch.Tensor:
        shape = KVPool.shape_for(layout, int(handle["num_blocks"]))
        nbytes = DTYPES[layout.dtype].itemsize * math.prod(shape)
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


def copy_route(src: int, dst: int, can_access_peer: Callable[[int, int], bool]) -> str:
    """How the decode GPU `dst` reads blocks of a pool on GPU `src`: "same" (one GPU), "peer" (a direct copy: torch
    enables peer access for a copy between two GPUs that have it), or "host" (no peer access: the blocks are
    gathered on the source GPU and staged through host memory). `can_access_peer(dst, src)`: as
    torch.cuda.can_device_access_peer."""
    if src == dst:
        return "same"
    return "peer" if can_access_peer(dst, src) else "host"


class CudaIpcBackend(_SharedPoolBackend):
    name = KvTransport.CUDA_IPC

    def __init__(self) -> None:
        self.routes: dict[tuple[int, int], str] = {}  # (source GPU, decode GPU) -> copy_route's answer

    def route(self, src: torch.device, dst: torch.device) -> str:
        key = (src.index, dst.index)
        if key not in self.routes:
            self.routes[key] = copy_route(*key, torch.cuda.can_device_access_peer)
        return self.routes[key]

    def unpack(
        self,
        pool: KVPool,
        dst_blocks: list[int],
        num_tokens: int,
        header: KvData,
        frames: list,
        source: torch.Tensor | None,
    ) -> int:
        """As shm's, except that a pool on another GPU without peer access is read through host memory: the
        request's blocks gathered on their GPU, copied to the host, then into the decode pool."""
        bs, n = pool.block_size, blocks_for(num_tokens, pool.block_size)
        src_blocks = list(header.src_blocks)
        if source is None or len(src_blocks) != n or self.route(source.device, pool.data.device) != "host":
            return super().unpack(pool, dst_blocks, num_tokens, header, frames, source)  # (which refuses a mistake)
        if any(not 0 <= b < KVPool.num_blocks_of(source, bs) for b in src_blocks):
            raise TransferError("a source block id is outside the prefill pool")
        staged = torch.cat([source[..., b * bs : (b + 1) * bs, :] for b in src_blocks], dim=-2).cpu()
        return super().unpack(pool, dst_blocks, num_tokens, replace(header, src_blocks=list(range(n))), [], staged)

    def storage(self, layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
        self._pool = torch.zeros(KVPool.shape_for(layout, num_blocks), dtype=DTYPES[layout.dtype], device=device)
        self._num_blocks = num_blocks
        self._pool_id = uuid.uuid4().hex
        return self._pool

    def handle(self) -> dict:
        """The pool's IPC handle, its GPU by UUID (indices depend on CUDA_VISIBLE_DEVICES) and its owner."""
        storage = self._pool.untyped_storage()
        _, h, size, offset, ref_h, ref_off, ev_h, ev_sync = storage._share_cuda_()
        return {
            "device_uuid": device_uuid(self._pool.device.index),
            "handle": h,
            "size": size,
            "offset": offset,
            "ref_handle": ref_h,
            "ref_offset": ref_off,
            "event_handle": ev_h,
            "event_sync": ev_sync,
            "num_blocks": self._num_blocks,
            "pool_id": self._pool_id,
            "owner": process_owner(),
        }

    def sync(self, pool: KVPool) -> None:
        """Nothing to wait for, and no device-wide synchronize: the blocks a prefill node names were written by steps
        its engine has finished, whose sampled tokens reached the host queued behind their KV writes on the same
        stream (docs/handoff-edges.md, "Copies out of a shared pool")."""

    def attach(self, handle: dict, layout: KVLayout, device: str) -> torch.Tensor:
        index = local_device_index(str(handle["device_uuid"]), visible_device_uuids())
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            handle["handle"],
            handle["size"],
            handle["offset"],
            handle["ref_handle"],
            handle["ref_offset"],
            handle["event_handle"],
            handle["event_sync"],
        )
        shape = KVPool.shape_for(layout, int(handle["num_blocks"]))
        t = torch.empty(0, dtype=DTYPES[layout.dtype], device=f"cuda:{index}")
        return t.set_(storage, 0, shape, _contiguous_strides(shape))

    def alive(self, handle: dict) -> bool:
        """The pool lives as long as the prefill process that allocated it."""
        owner = handle.get("owner")
        return owner_alive(owner if isinstance(owner, dict) else {})

    def forget(self, handle: dict) -> None:
        """Nothing to do: the mapping closes when the decode node drops the last tensor on it."""

    def wait_landed(self, pool: KVPool) -> None:
        """Block until unpack()'s device copies have read the prefill pool. torch runs a copy between two
        GPUs on the source GPU's current stream and makes the destination's current stream wait for it
        (on one GPU it runs on that stream), so the destination's current stream covers both cases."""
        torch.cuda.current_stream(pool.data.device).synchronize()

    def close(self) -> None:
        pass


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_device_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, in the order of its device indices."""
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_device_index(uuid_: str, local_uuids: list[str]) -> int:
    """This process's index of the GPU whose UUID is `uuid_` ("GPU-" prefix and case ignored)."""
    want = _plain_uuid(uuid_)
    for index, u in enumerate(local_uuids):
        if _plain_uuid(u) == want:
            return index
    seen = ", ".join(local_uuids) or "none"
    raise TransferError(
        f"the prefill pool is on GPU {uuid_}, which this process does not see (it sees: {seen}); "
        "give the decode node a CUDA_VISIBLE_DEVICES that includes it"
    )


def _plain_uuid(u: str) -> str:
    u = u.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def process_owner() -> dict:
    """This process, named so that another process on the host can tell whether it still runs."""
    pid = os.getpid()
    return {"pid": pid, "start": _start_time(pid), "pid_ns": _pid_namespace()}


def owner_alive(owner: dict) -> bool:
    """False only when the process `owner` names is known to be gone: no process with its pid, a zombie,
    or a later process that reuses its pid. True when this process cannot tell (another pid namespace)."""
    ns = _pid_namespace()
    if ns is None or owner.get("pid_ns") != ns or not isinstance(owner.get("pid"), int):
        return True
    start = _start_time(owner["pid"])
    return start is not None and start == owner.get("start")


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after "pid (comm)": state is field 3
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22, starttime


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


BACKENDS = {KvTransport.ZMQ: ZmqBackend, KvTransport.SHM: ShmBackend, KvTransport.CUDA_IPC: CudaIpcBackend}


def make_backend(name: KvTransport) -> KvBackend:
    return BACKENDS[name]()


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _view(shm: shared_memory.SharedMemory, dtype: str, shape, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes).view(DTYPES[dtype]).view(shape)
