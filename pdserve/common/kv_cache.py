"""The paged KV pool: one preallocated tensor, addressed by block ids and token slots.

Layout: `data[layer, slot, kv, head, dim]` with `slot = block * block_size + offset`, i.e.
[L, num_blocks * block_size, 2, num_kv_heads, head_dim]. One index_select on a layer gathers a
request's keys and values together; one block of every layer is a strided slice (for block copies
between pools). The pool can live in shared memory, so that a decode node on the same host copies
blocks straight out of a prefill node's pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pdserve.common.block_allocator import BlockAllocator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on before KV moves between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_fingerprint: str

    def to_dict(self) -> dict:
        return asdict(self)

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    def mismatch(self, other: dict) -> str:
        """A readable list of the fields that differ from `other`, or "" when they pair."""
        mine = self.to_dict()
        diffs = [f"{k}: {mine[k]!r} here, {other.get(k)!r} there" for k in mine if other.get(k) != mine[k]]
        return "; ".join(diffs)


class KVPool:
    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str = "cpu", data: torch.Tensor | None = None
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
        shape = self.shape_for(layout, num_blocks)
        if data is None:
            data = torch.zeros(shape, dtype=DTYPES[layout.dtype], device=device)
        elif tuple(data.shape) != shape:
            raise ValueError(f"KV pool storage has shape {tuple(data.shape)}, expected {shape}")
        self.data = data  # [L, NB*bs, 2, nkv, d]
        self.allocator = BlockAllocator(num_blocks, layout.block_size)

    @staticmethod
    def shape_for(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
        return (layout.num_layers, num_blocks * layout.block_size, 2, layout.num_kv_heads, layout.head_dim)

    def slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of every token position in [start, end) of a request owning `block_ids`."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def export(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """One request's KV as a contiguous [L, n, 2, nkv, d] tensor."""
        return torch.stack([self.export_layer(i, block_ids, num_tokens) for i in range(self.layout.num_layers)])

    def export_layer(self, layer: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """One layer of one request's KV: contiguous [n, 2, nkv, d]."""
        idx = self.slots(block_ids, 0, num_tokens).to(self.data.device)
        return self.data[layer].index_select(0, idx)

    def export_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks of one layer as [n_blocks, bs * 2 * nkv * d]: a view when they are consecutive
        (nothing copied), else gathered."""
        rows = self.data[layer].view(self.num_blocks, -1)
        if is_run(block_ids):
            return rows[block_ids[0] : block_ids[0] + len(block_ids)]
        return rows.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=self.data.device))

    def import_blocks(self, layer: int, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write whole blocks of one layer ([n_blocks, block elements]) into `block_ids`."""
        dst = self.data[layer].view(self.num_blocks, -1)
        rows = rows.to(self.data.device)
        if is_run(block_ids):
            dst[block_ids[0] : block_ids[0] + len(block_ids)].copy_(rows)
        else:
            dst.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=self.data.device), rows)

    def import_(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write an exported [L, n, 2, nkv, d] tensor into the blocks `block_ids`."""
        for layer, layer_kv in enumerate(kv):
            self.import_layer(layer, block_ids, layer_kv)

    def import_layer(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write one layer's [n, 2, nkv, d] KV into the blocks `block_ids`."""
        idx = self.slots(block_ids, 0, kv.shape[0]).to(self.data.device)
        self.data[layer].index_copy_(0, idx, kv.to(self.data.device))

    def copy_blocks_from(self, src: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy whole blocks out of another pool's storage `src` (same layout), one slice per run."""
        L = self.layout.num_layers
        dst_view = self.data.view(L, self.num_blocks, -1)  # [L, NB, bs*2*nkv*d]: a block is one row
        src_view = src.view(L, src.shape[1] // self.block_size, -1)
        for s, d, n in _runs(src_blocks, dst_blocks):
            dst_view[:, d : d + n].copy_(src_view[:, s : s + n])


def is_run(block_ids: list[int]) -> bool:
    """True when the blocks are consecutive ids in order (one slice of the pool)."""
    return (
        bool(block_ids)
        and block_ids[-1] - block_ids[0] == len(block_ids) - 1
        and all(b - a == 1 for a, b in zip(block_ids, block_ids[1:], strict=False))
    )


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge (src, dst) block pairs into runs that are consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
