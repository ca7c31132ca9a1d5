"""The decode node: `node.py` holds its request loop."""

from pdserve.decode_node.node import DecodeNode

__all__ = ["DecodeNode"]
