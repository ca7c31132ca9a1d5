"""KV export/import and the transfer backends in-process (CPU): zmq frames and shared memory; cuda_ipc's
GPU naming and owner liveness on the CPU, its transfer between two processes on a GPU."""

from __future__ import annotations

import inspect
import multiprocessing
import subprocess
import sys

import pytest
import torch
import zmq

from pdserve.kv.backend import InProcessBackend, KvBackend
from pdserve.kv.faults import FaultInjector
from pdserve.kv.mock import MockKvBackend
from pdserve.kv.peers import KvPeer, KvTransfer, TransferState
from pdserve.kv.pool import KVLayout, KVPool
from pdserve.kv.transfer import (
    BACKENDS,
    CudaIpcBackend,
    TransferError,
    copy_route,
    local_device_index,
    make_backend,
    process_owner,
)
from pdserve.wire import transport
from pdserve.wire.messages import KvData
from tests.helpers import export_tokens, import_tokens

LAYOUT = KVLayout(3, 2, 8, 4, "float32", "fp")


def _filled_pool(backend=None, num_blocks: int = 16) -> KVPool:
    storage = backend.storage(LAYOUT, num_blocks, "cpu") if backend else None
    pool = KVPool(LAYOUT, num_blocks, data=storage)
    pool.data.copy_(torch.randn(pool.data.shape))
    return pool


def _request_kv(pool: KVPool, blocks: list[int], n: int) -> torch.Tensor:
    return export_tokens(pool, blocks, n)  # [L, 2, nkv, n, d]


def test_export_import_round_trip():
    src, dst = _filled_pool(), KVPool(LAYOUT, 16)
    kv = export_tokens(src, [7, 2, 11], 10)
    assert kv.shape == (3, 2, 2, 10, 8) and kv.is_contiguous()
    import_tokens(dst, [0, 5, 9], kv)
    assert torch.equal(export_tokens(dst, [0, 5, 9], 10), kv)


def _through_zmq(header: KvData, frames: list):
    """Send one message over a real inproc socket pair and receive it as the decode node would."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://kv")
    b.connect("inproc://kv")
    transport.send(a, header, frames)
    _, msg, got = transport.recv(b)
    ctx.destroy(linger=0)
    return msg, got


@pytest.mark.parametrize("name", ["zmq", "shm"])
@pytest.mark.parametrize(("src_blocks", "dst_blocks"), [([3, 8, 1], [4, 5, 12]), ([5, 6, 7], [9, 10, 11])])
def test_backend_moves_one_requests_kv(name, src_blocks, dst_blocks):
    """Scattered blocks are gathered and scattered; consecutive ones move as one slice per head."""
    sender, receiver = make_backend(name), make_backend(name)
    src, dst = _filled_pool(sender), KVPool(LAYOUT, 16)
    try:
        source = receiver.attach(sender.handle(), LAYOUT, "cpu")
        landed = 0
        for header, frames in sender.pack(src, "r", src_blocks, 10):
            msg, got = _through_zmq(header, frames)
            landed += receiver.unpack(dst, dst_blocks, 10, msg, got, source)
        assert landed == LAYOUT.num_layers
        assert torch.equal(export_tokens(dst, dst_blocks, 10), export_tokens(src, src_blocks, 10))
        untouched = [b for b in range(16) if b not in dst_blocks]
        assert not export_tokens(dst, untouched, 4 * len(untouched)).any()  # nothing landed elsewhere
    finally:
        receiver.close()
        sender.close()


INTERFACE = [m for m in dir(KvBackend) if not m.startswith("_") and callable(getattr(KvBackend, m))]


@pytest.mark.parametrize("cls", [*BACKENDS.values(), MockKvBackend, InProcessBackend], ids=lambda c: c.__name__)
def test_every_backend_implements_the_one_interface(cls):
    """Each backend has every method of KvBackend, with its parameters by name and order (what the engine and the
    nodes call them with), and a transport name."""
    backend = cls("zmq", header_only=False) if cls is MockKvBackend else cls()
    assert len(INTERFACE) == 9 and isinstance(backend, KvBackend) and isinstance(backend.name, str)
    for method in INTERFACE:
        want = list(inspect.signature(getattr(KvBackend, method)).parameters)
        assert list(inspect.signature(getattr(cls, method)).parameters) == want, method


def test_the_in_process_fake_moves_one_requests_kv_and_refuses_a_wrong_shape():
    fake = InProcessBackend()
    assert isinstance(fake, KvBackend)
    src, dst = _filled_pool(), KVPool(LAYOUT, 16)
    landed = sum(fake.unpack(dst, [4, 5, 12], 10, h, f, None) for h, f in fake.pack(src, "r", [3, 8, 1], 10))
    assert landed == LAYOUT.num_layers == len(fake.sent)
    assert torch.equal(export_tokens(dst, [4, 5, 12], 10), export_tokens(src, [3, 8, 1], 10))
    assert [h.shape[2] for h in fake.sent] == [12] * LAYOUT.num_layers  # whole blocks: 3 of 4 tokens
    header, frames = next(fake.pack(src, "r", [3, 8], 8))
    with pytest.raises(TransferError):
        fake.unpack(dst, [4, 5, 12], 10, header, frames, None)  # 2 blocks sent, 3 expected


def test_a_transfer_only_moves_forward():
    t = KvTransfer("r", KvPeer(b"prefill-0"), TransferState.QUEUED)
    with pytest.raises(ValueError):
        t.pulled(0)  # no pull before the offer
    t.move(TransferState.OFFERED)
    t.pulled(3)
    assert t.state is TransferState.PULLED and t.first_block == 3 and t.pulled_at > 0
    for state in TransferState:
        with pytest.raises(ValueError):
            t.move(state)


def test_zmq_backend_refuses_a_wrong_frame():
    backend = make_backend("zmq")
    src, dst = _filled_pool(), KVPool(LAYOUT, 16)
    header, frames = next(backend.pack(src, "r", [3, 8], 8))
    with pytest.raises(TransferError):
        backend.unpack(dst, [0, 1, 2], 12, header, frames, None)  # expects 3 blocks, got 2
    with pytest.raises(TransferError):
        backend.unpack(dst, [0, 1], 8, header, [frames[0][:-4]], None)


def test_shm_backend_refuses_foreign_block_ids():
    sender, receiver = make_backend("shm"), make_backend("shm")
    _filled_pool(sender)
    dst = KVPool(LAYOUT, 16)
    try:
        source = receiver.attach(sender.handle(), LAYOUT, "cpu")
        bad = KvData("r", "float32", [4, 2, 2, 8], -1, [99])
        with pytest.raises(TransferError):
            receiver.unpack(dst, [0], 4, bad, [], source)
    finally:
        receiver.close()
        sender.close()


def test_layout_mismatch_is_named():
    other = KVLayout(3, 2, 8, 16, "bfloat16", "fp").to_dict()
    why = LAYOUT.mismatch(other)
    assert "block_size" in why and "dtype" in why and "num_layers" not in why
    assert LAYOUT.mismatch(LAYOUT.to_dict()) == ""


def test_shm_backend_notices_a_gone_owner():
    sender, receiver = make_backend("shm"), make_backend("shm")
    _filled_pool(sender)
    handle = sender.handle()
    receiver.attach(handle, LAYOUT, "cpu")
    assert receiver.alive(handle)
    sender.close()  # the owner stops and unlinks its segment
    assert not receiver.alive(handle)
    receiver.forget(handle)
    receiver.close()


UUIDS = ["6bd2ab7e-1a2b-4c3d-9e8f-000000000000", "GPU-0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0"]


def test_local_device_index_maps_a_uuid_to_this_process_index():
    assert local_device_index("6bd2ab7e-1a2b-4c3d-9e8f-000000000000", UUIDS) == 0
    assert local_device_index("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", UUIDS) == 1  # "GPU-" and case ignored
    assert local_device_index("GPU-6BD2AB7E-1A2B-4C3D-9E8F-000000000000", list(reversed(UUIDS))) == 1


@pytest.mark.parametrize("local", [UUIDS[1:], []])
def test_local_device_index_refuses_a_gpu_this_process_does_not_see(local):
    with pytest.raises(TransferError, match="CUDA_VISIBLE_DEVICES") as e:
        local_device_index(UUIDS[0], local)
    assert UUIDS[0] in str(e.value)


def test_cuda_ipc_pool_owner_is_alive_while_its_process_runs():
    backend = make_backend("cuda_ipc")
    me = process_owner()
    assert backend.alive({"owner": me})
    assert not backend.alive({"owner": {**me, "start": str(int(me["start"]) + 1)}}), "a reused pid is not the owner"
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=60)
    assert not backend.alive({"owner": {**me, "pid": int(out)}}), "an ended process owns nothing"
    assert backend.alive({"owner": {**me, "pid_ns": "pid:[0]"}}), "another pid namespace: cannot tell, so alive"
    assert backend.alive({}) and backend.alive({"owner": None}) and backend.alive({"owner": [1]})


def _cuda_ipc_owner(conn, layout: KVLayout, num_blocks: int) -> None:
    """A prefill-like process: a cuda_ipc pool filled with known values, its handle sent to the parent."""
    backend = make_backend("cuda_ipc")
    pool = KVPool(layout, num_blocks, data=backend.storage(layout, num_blocks, "cuda:0"))
    pool.data.copy_(torch.arange(pool.data.numel(), dtype=torch.float32).view(pool.data.shape))
    torch.cuda.synchronize()  # written before the handle goes (a prefill node's steps are finished before it offers)
    conn.send(backend.handle())
    conn.recv()  # keep the pool until the parent is done with it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_moves_blocks_between_processes():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_cuda_ipc_owner, args=(child, LAYOUT, 16))
    owner.start()
    try:
        assert parent.poll(120), "the owner process sent no handle"
        handle = parent.recv()
        receiver = make_backend("cuda_ipc")
        source = receiver.attach(handle, LAYOUT, "cuda:0")
        assert receiver.alive(handle)
        dst = KVPool(LAYOUT, 16, device="cuda:0")
        header = KvData("r", "float32", [2, 2, 10, 8], -1, [3, 8, 1])
        assert receiver.unpack(dst, [4, 5, 12], 10, header, [], source) == LAYOUT.num_layers
        receiver.wait_landed(dst)
        expected = KVPool(LAYOUT, 16, data=torch.arange(dst.data.numel(), dtype=torch.float32).view(dst.data.shape))
        assert torch.equal(export_tokens(dst, [4, 5, 12], 10).cpu(), export_tokens(expected, [3, 8, 1], 10))
        del source
    finally:
        parent.send("done")
        owner.join(timeout=60)
    assert not receiver.alive(handle)


def test_checksums_follow_the_kv_not_its_blocks_and_see_one_flipped_byte():
    src, dst = _filled_pool(), KVPool(LAYOUT, 16)
    import_tokens(dst, [9, 0, 4], export_tokens(src, [2, 3, 4], 10))
    sums = src.checksums([2, 3, 4], 10)
    assert len(sums) == LAYOUT.num_layers and dst.checksums([9, 0, 4], 10) == sums
    dst.data[0, 0, 0, 4 * 4 + 1, 0] += 1  # the last token (10th, in block 4) is at slot 4 * 4 + 1
    assert [a == b for a, b in zip(dst.checksums([9, 0, 4], 10), sums, strict=True)] == [False, True, True]
    dst.data[1, 1, 1, 4 * 4 + 2, 0] += 1  # past the 10 tokens: not the request's KV
    assert dst.checksums([9, 0, 4], 10)[1:] == sums[1:]


@pytest.mark.parametrize("name", ["zmq", "shm"])
@pytest.mark.parametrize("kind", ["truncate", "corrupt"])
def test_an_injected_fault_is_refused_or_fails_the_checksums(name, kind):
    backend = make_backend(name)
    src = _filled_pool(backend)
    dst, blocks = KVPool(LAYOUT, 16), [3, 8, 1]
    messages = FaultInjector(1.0, (kind,)).damage(kind, list(backend.pack(src, "r", blocks, 10)), 10, 16)
    try:
        for header, frames in messages:
            got_header, got_frames = _through_zmq(header, frames)
            backend.unpack(dst, [4, 5, 12], 10, got_header, got_frames, src.data)
    except TransferError:
        assert kind == "truncate"
    else:
        assert kind == "corrupt" and dst.checksums([4, 5, 12], 10) != src.checksums(blocks, 10)
    finally:
        backend.close()


def test_the_fault_schedule_is_fixed_by_the_seed_whatever_the_damage_draws():
    """Which pulls get which fault depends only on the seed and the pull's number: damaging transfers of any size
    (whose draws vary with it) does not move the later faults, so a test's faults do not hang on request order."""
    kinds = ("drop", "delay", "truncate", "corrupt")
    alone = FaultInjector(0.05, kinds)
    schedule = [alone.pick() for _ in range(400)]
    busy = FaultInjector(0.05, kinds)
    picked = []
    for i in range(400):
        picked.append(busy.pick())
        if picked[-1] is not None:
            header = KvData("r", "float32", [2, 1, 16 * (i + 1), 4], layer=0)
            busy.damage("corrupt", [(header, [bytearray(16 * (i + 1) * 4 * 4 * 2)])], 3 + i % 7, 64)
    assert picked == schedule and sum(k is not None for k in schedule) >= 10


@pytest.mark.parametrize(
    ("src", "dst", "peers", "route"),
    [(0, 0, set(), "same"), (0, 1, {(1, 0)}, "peer"), (0, 1, set(), "host"), (1, 0, {(1, 0)}, "host")],
)
def test_two_gpus_copy_peer_to_peer_only_where_the_decode_gpu_has_peer_access(src, dst, peers, route):
    asked = []

    def can_access_peer(a: int, b: int) -> bool:
        asked.append((a, b))
        return (a, b) in peers

    assert copy_route(src, dst, can_access_peer) == route
    assert asked == ([] if src == dst else [(dst, src)])  # the decode GPU's access to the prefill GPU


def test_cuda_ipc_stages_blocks_through_the_host_where_the_gpus_are_no_peers():
    """The host route's copy, run on CPU pools (the route given, as a GPU pair without peer access would give it)."""
    backend, src, dst = CudaIpcBackend(), _filled_pool(), KVPool(LAYOUT, 16)
    cpu = src.data.device
    backend.routes[(cpu.index, cpu.index)] = "host"
    header = KvData("r", LAYOUT.dtype, [2, 2, 10, 8], -1, [3, 8, 1])
    assert backend.unpack(dst, [4, 12, 5], 10, header, [], src.data) == LAYOUT.num_layers
    assert torch.equal(export_tokens(dst, [4, 12, 5], 10), export_tokens(src, [3, 8, 1], 10))
    assert backend.route(cpu, cpu) == "host"
    for blocks, error in (([3, 99, 1], "outside"), ([3, 8], "source blocks")):
        with pytest.raises(TransferError, match=error):
            backend.unpack(dst, [4, 12, 5], 10, KvData("r", LAYOUT.dtype, [2, 2, 10, 8], -1, blocks), [], src.data)
