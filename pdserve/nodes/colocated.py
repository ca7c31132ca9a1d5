"""The colocated node: the whole engine in one process, prompts and decodes sharing iterations.

A request's life here:
1. Generate arrives from the router; a request that can never fit the KV pool is refused at once.
2. WAITING until the scheduler admits it (FCFS, token budget, max_num_seqs, free blocks).
3. RUNNING: its prompt is computed in chunks beside running decodes; then one token an iteration,
   each streamed to the router as it is sampled.
4. FINISHED (stop token, EOS, max_tokens) or ABORTED (router's Abort): its KV is freed at once.
"""

from __future__ import annotations

from pdserve.nodes.base import NodeBase
from pdserve.wire.params import Role


class ColocatedNode(NodeBase):
    role = Role.COLOCATED
