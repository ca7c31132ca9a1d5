"""The KV transfer of mock nodes (`--engine mock`): the zmq backend's messages, without KV behind them.

`full` sends what the zmq backend sends for the same request: one KvData header and one frame per layer, the
frame as many bytes as the request's whole blocks of that layer hold (zeros, from one buffer sent without a copy),
so that the wire, the sockets and the router-side timing carry the real load. `header` sends one KvData header
naming every layer and no frames, as a shared pool's transfer does. The receiving side checks the shapes and
sizes as the zmq backend does, and lands nothing. Whatever transport a pairing picks, the sender's mode decides;
the receiver takes either.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from pdserve.kv.backend import Message, NoSharedPool, TransferError
from pdserve.kv.block_allocator import blocks_for
from pdserve.kv.layout import DTYPE_BYTES, KVLayout
from pdserve.wire.messages import KvData


class MockKvBackend(NoSharedPool):
    """(Never a shared pool: a mock node's offers are pulled, whatever the transport.)"""

    def __init__(self, name: str, header_only: bool) -> None:
        self.name, self.header_only = name, header_only
        self._zeros = memoryview(b"")

    def wait_landed(self, pool) -> None:
        pass

    def pack(self, pool, request_id: str, block_ids: list[int], num_tokens: int) -> Iterator[Message]:
        """Yield (header, frames): per layer a frame of the blocks' real size, or one header for every layer."""
        lay = pool.layout
        if self.header_only:
            yield KvData(request_id, lay.dtype, self._shape(lay, num_tokens), -1, list(block_ids)), []
            return
        shape = self._shape(lay, blocks_for(num_tokens, lay.block_size) * lay.block_size)
        frame = self._frame(math.prod(shape) * DTYPE_BYTES[lay.dtype])
        for layer in range(lay.num_layers):
            yield KvData(request_id, lay.dtype, shape, layer), [frame]

    def unpack(self, pool, dst_blocks: list[int], num_tokens: int, header: KvData, frames: list, source: None) -> int:
        """Check one message as the zmq backend would; return how many layers it carried."""
        lay = pool.layout
        if header.layer == -1:  # header only (the sender's --mock-kv decides)
            if list(header.shape) != self._shape(lay, num_tokens) or frames:
                raise TransferError(f"mock KV header of shape {header.shape} with {len(frames)} frames")
            return lay.num_layers
        expected = self._shape(lay, blocks_for(num_tokens, lay.block_size) * lay.block_size)
        if header.dtype != lay.dtype or list(header.shape) != expected or len(frames) != 1:
            raise TransferError(f"KV of shape {header.shape} {header.dtype}, expected {expected} {lay.dtype}")
        nbytes = math.prod(expected) * DTYPE_BYTES[lay.dtype]
        got = len(frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0]))
        if got != nbytes or not 0 <= header.layer < lay.num_layers:
            raise TransferError(f"KV frame of {got} bytes for layer {header.layer}, expected {nbytes}")
        return 1

    @staticmethod
    def _shape(lay: KVLayout, tokens: int) -> list[int]:
        return [2, lay.num_kv_heads, tokens, lay.head_dim]

    def _frame(self, nbytes: int) -> memoryview:
        if len(self._zeros) < nbytes:
            self._zeros = memoryview(bytes(max(nbytes, 2 * len(self._zeros))))
        return self._zeros[:nbytes]
