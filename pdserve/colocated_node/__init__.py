"""The colocated node: `node.py` holds its request loop."""

from pdserve.colocated_node.node import ColocatedNode

__all__ = ["ColocatedNode"]
