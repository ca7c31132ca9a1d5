"""scripts/kit.py: the plan against its window, stages in order of value, a stage stopped at its budget."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.kit import load_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "kit.py"


def load():
    return load_script(SCRIPT)


def stages(kit, code: dict[str, str], budgets: dict[str, float], values: dict[str, int]):
    def argv(src):
        return lambda run, budget: [sys.executable, "-c", src]

    return tuple(kit.Stage(n, budgets[n], budgets[n], values[n], argv(c)) for n, c in code.items())


def test_named_stages_past_the_window_are_refused_in_one_line(tmp_path):
    kit = load()
    run = kit.Run("cuda:0", False, tmp_path)
    st = stages(kit, {"a": "", "b": ""}, {"a": 200, "b": 150}, {"a": 1, "b": 2})
    with pytest.raises(ValueError, match="350 s, past the 300 s window"):
        kit.plan(st, run, 300, ["a", "b"])
    chosen, left = kit.plan(st, run, 300, ["a"])
    assert [s.name for s in chosen] == ["a"] and left == {"b": "not in plan (not named)"}


def test_the_default_plan_takes_stages_by_value_while_they_fit(tmp_path):
    kit = load()
    run = kit.Run("cuda:0", False, tmp_path)
    st = stages(kit, {"a": "", "b": "", "c": ""}, {"a": 100, "b": 250, "c": 150}, {"a": 1, "b": 2, "c": 3})
    chosen, left = kit.plan(st, run, 300, None)
    assert [s.name for s in chosen] == ["c", "a"] and left == {"b": "not in plan (window)"}


def test_a_stage_absent_from_the_tree_is_reported_so(tmp_path):
    kit = load()
    run = kit.Run("cpu", True, tmp_path)
    st = (kit.Stage("x", 1, 1, 1, lambda r, b: [], kit.has_module("bench.no_such_module")),)
    chosen, left = kit.plan(st, run, 10, None)
    assert chosen == [] and left == {"x": "not present in this tree"}
    assert kit.has_module("bench.gpu", "--large-run")() and not kit.has_module("bench.gpu", "--no-such-flag")()


def test_a_stage_past_its_budget_is_stopped_and_the_next_one_runs(tmp_path, monkeypatch):
    kit = load()
    monkeypatch.setattr(kit, "KILL_GRACE_S", 2.0)
    code = {"slow": "import time; time.sleep(60)", "bad": "raise SystemExit(3)", "good": ""}
    st = stages(kit, code, {"slow": 1, "bad": 5, "good": 5}, {"slow": 3, "bad": 2, "good": 1})
    monkeypatch.setattr(kit, "STAGES", st)
    monkeypatch.setattr(kit.signal, "signal", lambda *_: None)  # the kit's SIGTERM handler: not in this process
    out = tmp_path / "out"
    rc = kit.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work")])
    report = json.loads((out / "kit.json").read_text())
    assert rc == 1
    assert [(r["name"], r["status"]) for r in report["stages"]] == [
        ("slow", "over budget"),
        ("bad", "failed"),
        ("good", "passed"),
    ]
    assert report["stages"][0]["seconds"] < 30  # stopped, not waited for
    assert "| slow | 3 | 1 |" in (out / "kit.md").read_text()


def test_every_stage_of_the_kit_has_a_cpu_command(tmp_path):
    kit = load()
    run = kit.Run("cpu", True, tmp_path)
    assert len({s.name for s in kit.STAGES}) == len(kit.STAGES)
    for s in kit.STAGES:
        argv = s.argv(run, s.budget(run))
        assert argv[0] == sys.executable and "cuda" not in " ".join(argv), s.name


def test_the_faults_stage_is_present_and_starts_its_own_nodes(tmp_path):
    """gpu_check.py has --faults, which kills and restarts nodes: the stage shares no stack of the kit's."""
    kit = load()
    stage = next(s for s in kit.STAGES if s.name == "faults")
    assert stage.present() and stage.stack is None
    argv = stage.argv(kit.Run("cpu", True, tmp_path), stage.budget(kit.Run("cpu", True, tmp_path)))
    assert "--faults" in argv and argv[argv.index("--stacks") + 1] == "fp32-shm" and "--url" not in argv


def test_the_bench_stages_share_the_kits_stacks(tmp_path):
    kit = load()
    run = kit.Run("cpu", True, tmp_path)
    by_name = {s.name: s for s in kit.STAGES}
    assert by_name["bench-colocated"].stack == by_name["bench-large"].stack == "bench-colocated"
    assert by_name["bench-disagg"].stack == "bench-disagg"
    assert kit.STACKS["bench-colocated"].max_num_seqs == (256, 4)  # bench-large's run: 256 in flight (CPU: 4)
    for name, spec in kit.STACKS.items():  # started as bench.gpu starts its own, sized for every stage sharing it
        argv = spec.argv(run, 1234)
        assert argv[argv.index("--mode") + 1] == spec.mode and argv[argv.index("--port") + 1] == "1234", name
        assert argv[argv.index("--max-num-seqs") + 1] == str(spec.max_num_seqs[True]), name
    shared = kit.Shared("bench-colocated", FakeStack(4321, tmp_path / "log"), "http://x:1", tmp_path / "tc", None)
    assert shared.args() == ["--stack", "colocated", "http://x:1", "4321", str(tmp_path / "tc")]
    assert kit.Shared("fp32-shm", None, "http://x:2", tmp_path, None).args() == ["--url", "http://x:2"]


class FakeStack:
    """A stack the kit judges the stop of: a process with a child, and a log."""

    def __init__(self, pid: int, log: Path, proc=None) -> None:
        self.proc, self.log_path = proc or type("P", (), {"pid": pid})(), log

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def test_a_shared_stacks_stop_is_judged_and_reported(tmp_path):
    kit = load()
    stacks = kit.Stacks(kit.Run("cpu", True, tmp_path), [kit.Stage("a", 30, 30, 1, lambda r, b: [], stack="s")])
    stacks.gc = load_script(SCRIPT.parent / "gpu_check.py")
    log = tmp_path / "stack.log"
    log.write_text("Producer process has been terminated before all shared CUDA tensors released\n")
    # a "stack" whose child outlives it (it ignores SIGTERM): a stop that leaves a process behind
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    proc.stdout.readline()  # the child runs
    pids = stacks.gc.descendants(proc.pid)
    try:
        stacks.open["s"] = kit.Shared("s", FakeStack(proc.pid, log, proc), "http://x", tmp_path, None)
        stacks.done(0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    judged = stacks.stops["s"]
    assert not judged["pass"] and judged["warnings"] == {"Producer process has been terminated": 1}
    assert judged["processes_left"] == pids[1:] and len(pids) == 2
    report = {"stages": [{"name": "a", "stack": "s"}], "stacks": stacks.stops}
    assert "| s | a | failed | 0 | 1 | Producer process has been terminated (1) |" in kit.stop_lines(report)
