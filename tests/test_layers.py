"""The layering rules that the code cannot state itself: the router runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.engine.checkpoint import resolve_model


def test_the_router_loads_its_model_facts_without_torch():
    resolve_model("tiny")  # written (with torch) by this process first, as `pdserve up` does before its router
    code = ("import sys; import pdserve.router.api, pdserve.router.core; from pdserve.router.text import "
            "load_model_info; info = load_model_info('tiny'); assert info.vocab_size == 512, info; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(),
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", "the router imported torch"
