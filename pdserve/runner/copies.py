"""Copies between host and device that never make the host wait for the work queued on the device.

On a GPU, a step's forward and sampling are queued on the device's stream and the host goes on (the
node does its I/O meanwhile, see `Engine.launch`). A plain `torch.tensor(values, device="cuda")` or
`.to("cuda")` of pageable memory would stop that: torch waits for the stream after such a copy, so the
host would sit until the queued forward is done. Small host values therefore go through pinned memory
with `non_blocking=True` (torch's pinned-memory cache keeps the buffer alive until its copy has run),
and results come back the same way, into pinned memory, with an event that says when they are there.
On the CPU both are the plain tensors: nothing is queued, so there is nothing to wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of host `values` (a list or a CPU tensor) on `device`, without waiting for its stream."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


@dataclass
class HostCopy:
    """A device tensor on its way to the host: `wait()` returns it once it is there."""

    host: torch.Tensor  # pinned on a GPU host; the tensor itself on the CPU
    done: torch.cuda.Event | None  # recorded after the copy on the device's stream; None when nothing was queued

    @classmethod
    def of(cls, t: torch.Tensor) -> HostCopy:
        """Start copying `t` to the host (queued behind the work that computes it)."""
        if t.device.type != "cuda":
            return cls(t, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        return cls(host, done)

    def wait(self) -> torch.Tensor:
        """The copy on the host: blocks until the device has run everything queued before it."""
        if self.done is not None:
            self.done.synchronize()
        return self.host
