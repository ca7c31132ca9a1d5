"""Triton's interpreter before 3.7 made to take a loop bound that a kernel computed: a one-element array turned into
an int by squeezing it (NumPy 2.4 refuses `int()` of one that is not 0-dimensional), only where it runs."""

from __future__ import annotations

import operator
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.runner import triton_interpreter
from tests.helpers import optional


def _before_3_7(tensor, scope) -> None:
    """What Triton 3.6's interpreter gives a tensor as its `__index__`."""
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


class _Tensor:
    def __init__(self, *values: int) -> None:
        self.handle = SimpleNamespace(data=np.array(values))


def test_a_patched_launch_indexes_one_element_scalars_and_restores_the_tensor():
    interpreter = optional("triton.runtime.interpreter")
    module = SimpleNamespace(_patch_lang_tensor=_before_3_7)
    triton_interpreter.patch_tensor_index(module)
    patched = module._patch_lang_tensor
    triton_interpreter.patch_tensor_index(module)
    assert module._patch_lang_tensor is patched, "patched once"
    scope = interpreter._LangPatchScope()
    module._patch_lang_tensor(_Tensor, scope)
    assert operator.index(_Tensor(5)) == 5
    assert range(_Tensor(2), _Tensor(9), 3) == range(2, 9, 3)  # a loop over bounds read from memory
    with pytest.raises(TypeError):
        operator.index(_Tensor(1, 2))  # a block is no scalar
    scope.restore()
    assert not hasattr(_Tensor, "__index__"), "the launch's patches are undone with the interpreter's own"


@pytest.mark.parametrize(
    ("version", "interpret", "patched"),
    [("3.6.0", "1", True), ("3.2.0", "1", True), ("3.7.0", "1", False), ("3.10.1", "1", False), ("3.6.0", "", False)],
)
def test_only_an_interpreter_before_3_7_is_patched(monkeypatch, version: str, interpret: str, patched: bool):
    triton = optional("triton")
    interpreter = optional("triton.runtime.interpreter")
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _before_3_7)  # restored after the test
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    triton_interpreter.fix_interpreter()
    assert getattr(interpreter._patch_lang_tensor, "scalar_index", False) is patched
