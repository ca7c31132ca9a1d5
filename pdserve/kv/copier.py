"""Work a node does beside its loop, on a thread of its own: the decode node's KV copies out of a shared pool (shm,
cuda_ipc), the prefill node's checksums of the KV it offers.

A `Worker` runs its jobs in order on one thread, started with the node. When a job is done the thread pokes an
inproc socket that the node polls, so the node takes the result at its next look at its sockets (between its steps)
even while idle. Nothing is opened per job.

`BlockCopier` is the decode node's: a job is a burst of copies (the requests whose blocks the scheduler reserved in
one look), each request's blocks in one batched call (KVPool.copy_blocks_from), then its checksums of what landed.
On the CPU each copy and its check run one after another, every request handed out as soon as it is checked; on a
GPU the burst's copies are queued on the thread's own CUDA stream and the thread waits for one event after them
(never the device, nor the stream the steps run on), then checks each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq


class Worker:
    """Runs jobs on a thread, in order; `take()` returns the results of those done, oldest first."""

    def __init__(self, ctx: zmq.Context, name: str, work: Callable[[Any], list]) -> None:
        """`work(job)` runs on the thread and returns the results the job yields (each handed out once by take());
        it must not raise."""
        self.address = f"inproc://pdserve-{name}-{id(self):x}"
        self.wake = ctx.socket(zmq.PULL)  # the node polls it; what arrives is only a poke
        self.wake.bind(self.address)
        self._poke = ctx.socket(zmq.PUSH)  # used by the thread only
        self._poke.connect(self.address)
        self._work_on = work
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight = 0  # results not taken yet
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Any, results: int = 1) -> None:
        """Queue a job that yields `results` results."""
        self.in_flight += results
        self._todo.put(job)

    def take(self) -> list:
        """The results done since the last call (and the pokes that announced them drained)."""
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

    def wait_all(self) -> list:
        """Block until every job submitted is done; return the results not taken yet."""
        done = []
        while self.in_flight:
            self.wake.poll(1000)
            done += self.take()
        return done

    def close(self) -> None:
        if self.wake.closed:
            return
        self._todo.put(None)
        self._thread.join(timeout=5)
        self.take()  # results not taken hold what their jobs ran on (a decode node's copies: the pool they read)
        self.wake.close(linger=0)
        self._poke.close(linger=0)

    def _work(self) -> None:
        while (job := self._todo.get()) is not None:
            for result in self._work_on(job):
                self._done.put(result)
                self._poke.send(b"")


@dataclass(eq=False)
class Copy:
    """One request's copy: what to run, how to check what landed, and when it ran (time.perf_counter)."""

    key: str
    run: Callable[[], object] | None  # copies the request's blocks (KVPool.copy_blocks_from, one batched call)
    check: Callable[[], list[int]] | None  # the checksums of what landed ([]: none to compare)
    offered: float = 0.0  # (set by the node: when the request's offer was taken)
    started: float = 0.0
    copied: float = 0.0  # the blocks are in (on a GPU: the copy's event has completed)
    done: float = 0.0  # and checked
    landed: float = 0.0  # (set by the node: when its loop marked the KV landed, the request admitted)
    checksums: list[int] = field(default_factory=list)
    error: Exception | None = None

    def release(self) -> None:
        """Drop what the copy ran on (the pools it read, through `run` and `check`): its record stays, its times."""
        self.run = self.check = None


class BlockCopier(Worker):
    """Runs bursts of copies (the requests whose blocks were reserved together) on a thread, one job a burst;
    `take()` returns the copies done, oldest first."""

    def __init__(self, ctx: zmq.Context, device: str = "cpu") -> None:
        self._device, self._stream, self._stream_made = device, None, False
        super().__init__(ctx, "kv-copier", self._copy)

    def submit(self, burst: list[Copy]) -> None:  # type: ignore[override]
        super().submit(burst, len(burst))

    def _copy(self, burst: list[Copy]):
        if not self._stream_made:
            self._stream, self._stream_made = _side_stream(self._device), True
        if self._stream is None:  # the CPU: a copy is done when its call returns; each is handed out once checked
            for copy in burst:
                copy.started = time.perf_counter()
                _run_and_check(copy, copied=None)
                yield copy
            return
        import torch

        with torch.cuda.stream(self._stream):  # every copy of the burst queued, then waited for by one event
            for copy in burst:
                copy.started = time.perf_counter()
                try:
                    copy.run()
                except Exception as e:  # noqa: BLE001 - a bad copy fails its request, not the node
                    copy.error = e
            event = torch.cuda.Event()
            event.record(self._stream)
        event.synchronize()
        copied = time.perf_counter()
        for copy in burst:
            _run_and_check(copy, copied)
            yield copy


def _run_and_check(copy: Copy, copied: float | None) -> None:
    """Run a copy (unless it ran already: `copied`, when), then check what landed; an error is kept, not raised."""
    try:
        if copied is None:
            copy.run()
        copy.copied = copied or time.perf_counter()
        if copy.error is None:
            copy.checksums = copy.check()
    except Exception as e:  # noqa: BLE001 - a bad copy fails its request, not the node
        copy.error = e
        copy.copied = copy.copied or time.perf_counter()
    copy.done = time.perf_counter()


def _side_stream(device: str):
    """The copier's own CUDA stream on `device`, or None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.Stream(device=device)
