"""Triton's interpreter (`TRITON_INTERPRET=1`: the kernels on the CPU, as the tests run them) taking a loop bound
that a kernel computed, with Triton before 3.7 and NumPy 2.4 or later.

The interpreter holds a kernel's scalars as one-element NumPy arrays. Before Triton 3.7 it turned one into a Python
int (a `range` bound: the attention kernel's key loop) by `int(array)`, which NumPy 2.4 refuses for an array that is
not 0-dimensional: every attention launch raised TypeError. Triton 3.7 squeezes the array first; `fix_interpreter`
makes the older interpreters do the same (torch 2.11 pins Triton 3.6). Nothing changes on a GPU, where no
interpreter runs.
"""

from __future__ import annotations

import os
import re

FIXED_IN = (3, 7)  # the first Triton whose interpreter squeezes a scalar before int()


def scalar_index(tensor) -> int:
    """An interpreted scalar tensor as a Python int (`__index__`)."""
    return int(tensor.handle.data.squeeze())


def patch_tensor_index(interpreter) -> None:
    """Make `interpreter` (the module `triton.runtime.interpreter`) give each launch's tensors `scalar_index` as their
    `__index__`, after its own patches (undone with them when the launch ends). Idempotent."""
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_index", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", scalar_index)

    patched.scalar_index = True
    interpreter._patch_lang_tensor = patched


def fix_interpreter() -> None:
    """Under `TRITON_INTERPRET=1` with a Triton before 3.7, patch its interpreter (`patch_tensor_index`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton

    if tuple(int(n) for n in re.findall(r"\d+", triton.__version__)[:2]) >= FIXED_IN:
        return
    import triton.runtime.interpreter as interpreter

    patch_tensor_index(interpreter)
