"""What two KV pools must agree on before KV moves between them; torch-free, so that a mock node can state it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def mismatch(self, other: dict) -> str:
        """A readable list of the fields that differ from `other`, or "" when they pair."""
        mine = self.to_dict()
        diffs = [f"{k}: {mine[k]!r} here, {other.get(k)!r} there" for k in mine if other.get(k) != mine[k]]
        return "; ".join(diffs)
