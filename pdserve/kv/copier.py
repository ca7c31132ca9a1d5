"""The decode node's background KV copies out of a shared pool (shm, cuda_ipc), beside its steps.

One thread, started with the node, runs the copies in order: a copy is a function that copies one request's blocks
in one batched call (KVPool.copy_blocks_from), then one that returns the checksums of what landed. On a GPU the copy
runs on the thread's own CUDA stream and the thread waits for that copy's event only (never the device, nor the
stream the steps run on).
When a copy is done the thread pokes an inproc socket that the node polls, so the node takes the result at its next
look at its sockets (between its steps) even while idle. Nothing is opened per copy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq


@dataclass(eq=False)
class Copy:
    """One request's copy: what to run, and when it ran (time.perf_counter)."""

    key: str
    run: Callable[[], object]  # copies the blocks
    check: Callable[[], list[int]]  # the checksums of what landed ([]: none to compare)
    offered: float = 0.0  # (set by the node: when the request's offer was taken)
    started: float = 0.0
    copied: float = 0.0  # the blocks are in (on a GPU: the copy's event has completed)
    done: float = 0.0  # and checked
    checksums: list[int] = field(default_factory=list)
    error: Exception | None = None


class BlockCopier:
    """Runs copies on a thread; `take()` returns those done, oldest first."""

    def __init__(self, ctx: zmq.Context, device: str = "cpu") -> None:
        self.address = f"inproc://pdserve-kv-copier-{id(self):x}"
        self.wake = ctx.socket(zmq.PULL)  # the node polls it; what arrives is only a poke
        self.wake.bind(self.address)
        self._poke = ctx.socket(zmq.PUSH)  # used by the thread only
        self._poke.connect(self.address)
        self._device = device
        self._todo: queue.SimpleQueue[Copy | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Copy] = queue.SimpleQueue()
        self.in_flight = 0
        self._thread = threading.Thread(target=self._work, name="kv-copier", daemon=True)
        self._thread.start()

    def submit(self, copy: Copy) -> None:
        self.in_flight += 1
        self._todo.put(copy)

    def take(self) -> list[Copy]:
        """The copies done since the last call (and the pokes that announced them drained)."""
        while self.wake.poll(0):
            self.wake.recv()
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(done)
        return done

    def wait_all(self) -> list[Copy]:
        """Block until every copy submitted is done; return those not taken yet."""
        done = []
        while self.in_flight:
            self.wake.poll(1000)
            done += self.take()
        return done

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=5)
        self.wake.close(linger=0)
        self._poke.close(linger=0)

    def _work(self) -> None:
        stream = _side_stream(self._device)
        while (copy := self._todo.get()) is not None:
            copy.started = time.perf_counter()
            try:
                _run_on(stream, copy.run)
                copy.copied = time.perf_counter()
                copy.checksums = copy.check()
            except Exception as e:  # noqa: BLE001 - a bad copy fails its request, not the node
                copy.error = e
            copy.done = time.perf_counter()
            self._done.put(copy)
            self._poke.send(b"")


def _side_stream(device: str):
    """The copier's own CUDA stream on `device`, or None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.Stream(device=device)


def _run_on(stream, run: Callable[[], object]) -> None:
    """Run a copy; on a GPU on `stream`, then wait for it by its own event."""
    if stream is None:
        run()
        return
    import torch

    with torch.cuda.stream(stream):
        run()
        event = torch.cuda.Event()
        event.record(stream)
    event.synchronize()
