"""KV-transfer bandwidth of each backend beside its physical floors, all measured in one run.

Two processes, as in serving: a "prefill" side that owns a paged pool with one request's KV spread
over scattered blocks, and a "decode" side that owns its own pool. Each transfer is timed from
the pack on the prefill side to the ack back from the decode side, through the project's own
backends (`pdserve.kv.transfer`) and message flow (KvData header + frames, KvAck).
Floors: raw ZeroMQ loopback (the same bytes as pre-built frames, tcp and ipc) and memcpy. Each side is
pinned to its own core, as in serving.

    python -m bench.kv_bandwidth --tokens 2048 --repeats 10

`--shared-copy` measures instead the decode node's copy out of a shared pool as it serves (kv/copier.py: the
copier's thread, one batched copy a request, on a GPU its own stream and event) between
two processes: an owner process holds the pool (cuda_ipc on a GPU, shm on the CPU) and the measuring process maps it
and copies one request's scattered blocks, against a plain device copy of the same bytes (read once, written once).
On a GPU with the real model's layout (qwen3-0.6b, bf16: 112 KiB a token), for the GPU kit as a stage that writes JSON:

    python -m bench.kv_bandwidth --shared-copy --device cuda --layout qwen3-0.6b --tokens 1024 --out DIR/kv_copy
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from pathlib import Path

import torch
import zmq

from pdserve.kv.block_allocator import BlockAllocator, blocks_for
from pdserve.kv.copier import BlockCopier, Copy
from pdserve.kv.pool import KVLayout, KVPool
from pdserve.kv.transfer import make_backend
from pdserve.wire import transport
from pdserve.wire.codec import encode
from pdserve.wire.messages import PROTOCOL_VERSION, Abort, Hello, KvAck, KvHello

# the `small` built-in's KV layout: 8 layers, 4 KV heads, head dim 64, fp32 -> 16 KiB per token
LAYOUT = KVLayout(8, 4, 64, 16, "float32", "bench")
PLACEMENTS = ("consecutive", "scattered")
# --shared-copy layouts: qwen3-0.6b is Qwen3-0.6B's KV in bf16 (28 layers, 8 KV heads, head dim 128: 112 KiB a token)
LAYOUTS = {
    "small": LAYOUT,
    "qwen3-0.6b": KVLayout(28, 8, 128, 16, "bfloat16", "bench"),
    "tiny": KVLayout(2, 2, 8, 4, "float32", "bench"),
}


def _blocks(num_blocks: int, n: int, seed: int, placement: str) -> list[int]:
    """The request's blocks: as the allocator places them in a fresh pool (one run), or scattered."""
    if placement == "consecutive":
        blocks: list[int] = []
        BlockAllocator(num_blocks, LAYOUT.block_size).grow(blocks, n * LAYOUT.block_size)
        return blocks
    return random.Random(seed).sample(range(num_blocks), n)


def _pin(core: int) -> None:
    """Sender on core 0, receiver on core 1: one core per role, as `pdserve up` runs them."""
    if core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _receiver(addr: str, backend_name: str, num_blocks: int, tokens: int, raw: bool, placement: str = "") -> None:
    torch.set_num_threads(1)
    _pin(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    transport.configure(sock)
    sock.connect(addr)
    if raw:  # floor: receive `tokens` messages, then answer
        sock.send(b"ready")
        got = 0
        while True:
            parts = sock.recv_multipart(copy=False)
            if parts[0].bytes == b"stop":
                break
            got += 1
            if got == tokens:
                got = 0
                sock.send(b"ack")
        ctx.destroy(linger=0)
        return
    pool = KVPool(LAYOUT, num_blocks)
    backend = make_backend(backend_name)
    sock.send(encode(Hello(PROTOCOL_VERSION, "decode")))
    _, hello, _ = transport.recv(sock)
    source = backend.attach(hello.pool_handle, LAYOUT, "cpu")
    dst = _blocks(num_blocks, blocks_for(tokens, LAYOUT.block_size), 2, placement)
    landed = 0
    while True:
        _, msg, frames = transport.recv(sock)
        if isinstance(msg, Abort):
            break
        landed += backend.unpack(pool, dst, tokens, msg, frames, source)
        if landed == LAYOUT.num_layers:
            landed = 0
            transport.send(sock, KvAck(msg.request_id, True))
    backend.close()
    ctx.destroy(linger=0)


def _serve(addr: str) -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    transport.configure(sock)
    return ctx, sock, transport.bind(sock, addr)


def measure_backend(name: str, addr: str, tokens: int, repeats: int, placement: str) -> float:
    """GB/s of one request's KV through backend `name`, pack to ack."""
    num_blocks = 4 * blocks_for(tokens, LAYOUT.block_size)
    backend = make_backend(name)
    pool = KVPool(LAYOUT, num_blocks, data=backend.storage(LAYOUT, num_blocks, "cpu"))
    pool.data.normal_()
    src = _blocks(num_blocks, blocks_for(tokens, LAYOUT.block_size), 1, placement)
    ctx, sock, bound = _serve(addr)
    proc = mp.get_context("spawn").Process(target=_receiver, args=(bound, name, num_blocks, tokens, False, placement))
    proc.start()
    ident, _, _ = transport.recv(sock, routed=True)
    hello = KvHello(PROTOCOL_VERSION, LAYOUT.to_dict(), name, backend.handle())
    transport.send(sock, hello, identity=ident)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for header, frames in backend.pack(pool, f"r{i}", src, tokens):
            transport.send(sock, header, frames, identity=ident)
        transport.recv(sock, routed=True)  # the KvAck
        times.append(time.perf_counter() - t0)
    transport.send(sock, Abort("stop"), identity=ident)
    proc.join()
    backend.close()
    ctx.destroy(linger=0)
    return tokens * LAYOUT.bytes_per_token() / min(times[1:]) / 1e9


def measure_raw_zmq(addr: str, nbytes: int, repeats: int) -> tuple[float, float]:
    """GB/s of `nbytes` of pre-built frames over ZeroMQ, send to ack: (as one frame, as one frame per layer).

    One frame is the naive way to measure the loopback; a frame per layer is the backend's own message shape,
    and here the faster of the two, so the stricter floor."""
    return _raw_zmq(addr, nbytes, repeats, 1), _raw_zmq(addr, nbytes, repeats, LAYOUT.num_layers)


def _raw_zmq(addr: str, nbytes: int, repeats: int, chunks: int) -> float:
    payloads = [torch.randn(nbytes // 4 // chunks).numpy() for _ in range(chunks)]
    ctx, sock, bound = _serve(addr if addr.startswith("tcp") else f"{addr}{chunks}")
    proc = mp.get_context("spawn").Process(target=_receiver, args=(bound, "zmq", 1, chunks, True))
    proc.start()
    ident = sock.recv_multipart()[0]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for payload in payloads:
            sock.send_multipart([ident, payload], copy=False)
        sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    sock.send_multipart([ident, b"stop"])
    proc.join()
    ctx.destroy(linger=0)
    return nbytes / min(times[1:]) / 1e9


def measure_memcpy(nbytes: int, repeats: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def run(tokens: int, repeats: int, rounds: int = 3) -> dict:
    """`rounds` interleaved rounds of every measurement; each path keeps its best (this host is noisy)."""
    results = [_round(tokens, repeats) for _ in range(rounds)]
    out = {k: max(r[k] for r in results) if k.endswith("GBps") else results[0][k] for k in results[0]}
    for placement in PLACEMENTS:
        out[f"zmq_tcp_vs_raw_{placement}"] = out[f"zmq_tcp_GBps_{placement}"] / out["raw_zmq_tcp_GBps"]
        out[f"zmq_ipc_vs_raw_{placement}"] = out[f"zmq_ipc_GBps_{placement}"] / out["raw_zmq_ipc_GBps"]
        out[f"shm_vs_memcpy_{placement}"] = out[f"shm_GBps_{placement}"] / out["memcpy_GBps"]
        out[f"zmq_tcp_vs_raw1_{placement}"] = out[f"zmq_tcp_GBps_{placement}"] / out["raw1_zmq_tcp_GBps"]
        out[f"zmq_ipc_vs_raw1_{placement}"] = out[f"zmq_ipc_GBps_{placement}"] / out["raw1_zmq_ipc_GBps"]
    return out


def _raw_pair(kind: str, pair: tuple[float, float]) -> dict:
    one, per_layer = pair
    return {f"raw1_zmq_{kind}_GBps": one, f"raw_zmq_{kind}_GBps": max(one, per_layer)}


def _round(tokens: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    _pin(0)
    nbytes = tokens * LAYOUT.bytes_per_token()
    with tempfile.TemporaryDirectory() as tmp:
        ipc = f"ipc://{tmp}/kv.sock"
        out = {
            "tokens": tokens,
            "bytes": nbytes,
            "memcpy_GBps": measure_memcpy(nbytes, repeats),
            **_raw_pair("tcp", measure_raw_zmq("tcp://127.0.0.1:0", nbytes, repeats)),
            **_raw_pair("ipc", measure_raw_zmq(ipc + "raw", nbytes, repeats)),
        }
        for placement in PLACEMENTS:
            out[f"zmq_tcp_GBps_{placement}"] = measure_backend("zmq", "tcp://127.0.0.1:0", tokens, repeats, placement)
            out[f"zmq_ipc_GBps_{placement}"] = measure_backend("zmq", ipc + placement, tokens, repeats, placement)
            out[f"shm_GBps_{placement}"] = measure_backend("shm", "tcp://127.0.0.1:0", tokens, repeats, placement)
    return out


def to_markdown(r: dict) -> str:
    mb = r["bytes"] / 2**20
    rows = [
        "| path | blocks | GB/s | vs its floor |",
        "|---|---|---|---|",
        f"| memcpy (floor of shm) | | {r['memcpy_GBps']:.2f} | |",
        f"| raw ZeroMQ tcp, best frame shape (floor of zmq tcp) | | {r['raw_zmq_tcp_GBps']:.2f} | |",
        f"| raw ZeroMQ ipc, best frame shape (floor of zmq ipc) | | {r['raw_zmq_ipc_GBps']:.2f} | |",
        f"| raw ZeroMQ tcp, the KV as one frame | | {r['raw1_zmq_tcp_GBps']:.2f} | |",
        f"| raw ZeroMQ ipc, the KV as one frame | | {r['raw1_zmq_ipc_GBps']:.2f} | |",
    ]
    for p in PLACEMENTS:
        rows += [
            f"| pdserve shm | {p} | {r[f'shm_GBps_{p}']:.2f} | {r[f'shm_vs_memcpy_{p}']:.0%} of memcpy |",
            f"| pdserve zmq tcp | {p} | {r[f'zmq_tcp_GBps_{p}']:.2f} | {r[f'zmq_tcp_vs_raw_{p}']:.0%} of best raw tcp "
            f"({r[f'zmq_tcp_vs_raw1_{p}']:.0%} of one-frame raw) |",
            f"| pdserve zmq ipc | {p} | {r[f'zmq_ipc_GBps_{p}']:.2f} | {r[f'zmq_ipc_vs_raw_{p}']:.0%} of best raw ipc "
            f"({r[f'zmq_ipc_vs_raw1_{p}']:.0%} of one-frame raw) |",
        ]
    head = (
        f"One request's KV: {r['tokens']} tokens of `small` = {mb:.0f} MiB, best of 3 interleaved rounds of the "
        "repeats; sender on core 0, "
        "receiver on core 1. Blocks `consecutive`: as the allocator places a request in a pool with room (the "
        "usual case); `scattered`: random blocks, as in a fragmented pool."
    )
    return head + "\n\n" + "\n".join(rows)


# ---- the decode node's copy out of a shared pool ------------------------------------------------------------


def _pool_owner(conn, backend_name: str, layout: KVLayout, num_blocks: int, device: str) -> None:
    """A prefill-like process: a shared pool of known values; its handle goes to the parent, which it outlives."""
    backend = make_backend(backend_name)
    pool = KVPool(layout, num_blocks, data=backend.storage(layout, num_blocks, device))
    pool.data.copy_(torch.randn(pool.data.shape, dtype=torch.float32).to(pool.data.dtype))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # (set-up only: the pool is written once, before its handle goes)
    conn.send(backend.handle())
    conn.recv()
    backend.close()


def measure_shared_copy(device: str, layout_name: str, tokens: int, repeats: int) -> dict:
    """One request's copy out of another process's pool by the copier, against a device copy of the same bytes."""
    layout = LAYOUTS[layout_name]
    name = "cuda_ipc" if device.startswith("cuda") else "shm"
    n = blocks_for(tokens, layout.block_size)
    num_blocks = 4 * n
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_pool_owner, args=(child, name, layout, num_blocks, device))
    owner.start()
    zctx = zmq.Context()
    try:
        if not parent.poll(300):
            raise RuntimeError("the pool owner process sent no handle")
        source = make_backend(name).attach(parent.recv(), layout, device)
        dst = KVPool(layout, num_blocks, device=device)
        src_blocks, dst_blocks = _blocks(num_blocks, n, 1, "scattered"), _blocks(num_blocks, n, 2, "scattered")
        copier = BlockCopier(zctx, device)
        copy_s = []
        for i in range(repeats + 1):
            run = lambda: dst.copy_blocks_from(source, src_blocks, dst_blocks)  # noqa: E731
            copier.submit([Copy(f"r{i}", run, list)])
            [done] = copier.wait_all()
            if done.error is not None:
                raise done.error
            copy_s.append(done.copied - done.started)
        copier.close()
        nbytes = n * layout.block_size * layout.bytes_per_token()
        device_s = _device_copy_s(nbytes, device, repeats)
        source = None  # unmapped before its owner goes
    finally:
        parent.send("done")
        owner.join(timeout=60)
        zctx.destroy(linger=0)
    best = min(copy_s[1:])
    return {
        "device": device,
        "layout": layout_name,
        "transport": name,
        "tokens": tokens,
        "bytes": nbytes,
        "bytes_per_token": layout.bytes_per_token(),
        "copy_s": best,
        "copy_GBps": nbytes / best / 1e9,
        "device_copy_s": device_s,
        "device_copy_GBps": nbytes / device_s / 1e9,
        "copy_vs_device_copy": device_s / best,
    }


def _device_copy_s(nbytes: int, device: str, repeats: int) -> float:
    """The best time of a plain copy of `nbytes` on `device` (read once, written once), timed as the copier's."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def shared_copy_markdown(r: dict) -> str:
    return (
        f"{r['tokens']} tokens of `{r['layout']}` ({r['bytes'] / 2**20:.1f} MiB, scattered blocks) copied by the "
        f"decode node's copier out of another process's pool over {r['transport']} on {r['device']}: "
        f"{r['copy_s'] * 1e3:.3f} ms ({r['copy_GBps']:.1f} GB/s) against a device copy of the same bytes "
        f"{r['device_copy_s'] * 1e3:.3f} ms ({r['device_copy_GBps']:.1f} GB/s): {r['copy_vs_device_copy']:.0%} of it."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="bench/runs/kv_bandwidth")
    ap.add_argument("--shared-copy", action="store_true", help="the decode node's copy out of a shared pool")
    ap.add_argument("--device", default="cpu", help="--shared-copy: cpu (shm) or cuda[:i] (cuda_ipc)")
    ap.add_argument("--layout", default="small", choices=sorted(LAYOUTS), help="--shared-copy: the KV layout")
    a = ap.parse_args()
    if a.shared_copy:
        result = measure_shared_copy(a.device, a.layout, a.tokens, a.repeats)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(result, indent=2))
        print(shared_copy_markdown(result))
        return
    result = run(a.tokens, a.repeats)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(result, indent=2))
    md = to_markdown(result)
    Path(a.out + ".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
