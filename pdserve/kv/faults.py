"""Deliberate KV transfer faults, for tests and drills (`--kv-fault-rate`, off by default).

A prefill node with a fault rate damages that share of its transfers on the real path of whichever
backend carries them, after the backend packed them and before they reach the socket:
- drop: one message never goes (zmq: one layer; a shared pool: the offer's block ids, so that the decode node
  pulls them as over zmq);
- delay: the transfer goes DELAY_S late (a shared pool: the whole offer);
- truncate: one message loses data (zmq: half a layer's frame; a shared pool: the offer's last source block id);
- corrupt: one message's data is wrong (zmq: one byte of a layer's real rows flipped; a shared pool: one of the
  offer's source block ids names another block of the pool).
The decode node must notice each (a missing layer by its wait for the KV, a wrong size by the backend,
wrong data by the per-layer checksums of the offer) and never decode from such KV. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import random

from pdserve.kv.backend import Message
from pdserve.wire.messages import KvData

DELAY_S = 0.3


class FaultInjector:
    """Picks the transfers to damage, and damages their messages."""

    def __init__(self, rate: float, kinds: tuple[str, ...], seed: int = 0) -> None:
        self.rate, self.kinds = rate, kinds
        self.rng = random.Random(seed)  # which transfers, and which fault: the n-th pull's fate is fixed by the seed
        self.damage_rng = random.Random(seed + 1)  # where in a transfer (its draws depend on the transfer's size)

    def pick(self) -> str | None:
        """The fault for the next transfer, or None to leave it alone."""
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        return self.rng.choice(self.kinds)

    def damage(self, kind: str, messages: list[Message], num_tokens: int, pool_blocks: int) -> list[Message]:
        """`messages` with one of them dropped, truncated or corrupted (a delay is the caller's to make)."""
        i = self.damage_rng.randrange(len(messages))
        header, frames = messages[i]
        if kind == "drop":
            return messages[:i] + messages[i + 1 :]
        if kind == "truncate":
            messages[i] = _truncated(header, frames)
        elif kind == "corrupt":
            messages[i] = self._corrupted(header, frames, num_tokens, pool_blocks)
        return messages

    def _corrupted(self, header: KvData, frames: list, num_tokens: int, pool_blocks: int) -> Message:
        if not frames:  # a shared pool: name a wrong source block
            blocks = list(header.src_blocks)
            j = self.damage_rng.randrange(len(blocks))
            blocks[j] = (blocks[j] + 1 + self.damage_rng.randrange(max(1, pool_blocks - 1))) % max(1, pool_blocks)
            return dataclasses.replace(header, src_blocks=blocks), frames
        data = bytearray(memoryview(frames[0]).cast("B"))  # [2, nkv, n_blocks * bs, d] as bytes
        row_bytes = len(data) // (math.prod(header.shape) // header.shape[-1])
        data[self.damage_rng.randrange(max(1, num_tokens * row_bytes))] ^= 0xFF  # within the first head's real rows
        return header, [data, *frames[1:]]


def _truncated(header: KvData, frames: list) -> Message:
    if not frames:
        return dataclasses.replace(header, src_blocks=list(header.src_blocks)[:-1]), frames
    data = memoryview(frames[0]).cast("B")
    return header, [data[: len(data) // 2], *frames[1:]]
