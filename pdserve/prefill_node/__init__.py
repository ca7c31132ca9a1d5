"""The prefill node: `node.py` holds its request loop."""

from pdserve.prefill_node.node import PrefillNode

__all__ = ["PrefillNode"]
