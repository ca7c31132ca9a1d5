"""scripts/kit.py: the plan against its window, stages in order of value, a stage stopped at its budget."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
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


def concurrent_stages(kit, spec: dict[str, tuple]):
    """{name: (budget, value, concurrent, stack, code)} -> stages."""
    return tuple(
        kit.Stage(n, b, b, v, (lambda c: lambda run, budget: [sys.executable, "-c", c])(code), stack=st, concurrent=cc)
        for n, (b, v, cc, st, code) in spec.items()
    )


def test_the_plans_time_is_its_longest_lane_of_checks_plus_the_rest(tmp_path):
    kit = load()
    run = kit.Run("cuda:0", False, tmp_path)
    st = concurrent_stages(
        kit,
        {
            "a": (30, 9, True, "s", ""),  # a and b share stack s: one lane, 50 s
            "b": (20, 8, True, "s", ""),
            "c": (40, 7, True, None, ""),  # a lane of its own
            "m": (100, 6, False, None, ""),  # measurements: one after another
            "n": (60, 5, False, None, ""),
        },
    )
    assert [[s.name for s in lane] for lane in kit.lanes(list(st), run)] == [["a", "b"], ["c"]]
    assert kit.plan_seconds(list(st), run, True) == 50 + 100 + 60
    assert kit.plan_seconds(list(st), run, False) == 30 + 20 + 40 + 100 + 60
    with pytest.raises(ValueError, match="210 s, past the 200 s window"):
        kit.plan(st, run, 200, ["a", "b", "c", "m", "n"], concurrent=True)
    chosen, _ = kit.plan(st, run, 210, ["a", "b", "c", "m", "n"], concurrent=True)
    assert len(chosen) == 5
    chosen, left = kit.plan(st, run, 160, None, concurrent=True)  # c fits beside a and b at no cost; n does not
    assert [s.name for s in chosen] == ["a", "b", "c", "m"] and left == {"n": "not in plan (window)"}
    chosen, left = kit.plan(st, run, 160, None, concurrent=False)
    assert [s.name for s in chosen] == ["a", "b", "c", "n"] and left == {"m": "not in plan (window)"}


def test_the_checks_run_at_once_then_the_measurements_one_at_a_time(tmp_path, monkeypatch):
    """Each check waits for the other's file: run one after the other, the first would wait past its budget."""
    kit = load()
    monkeypatch.setattr(kit, "KILL_GRACE_S", 2.0)
    monkeypatch.setattr(kit.signal, "signal", lambda *_: None)
    flag = tmp_path / "flag"

    def meet(me: str, other: str) -> str:
        return (
            f"import pathlib, time; pathlib.Path({str(flag)!r} + {me!r}).touch()\n"
            f"while not pathlib.Path({str(flag)!r} + {other!r}).exists(): time.sleep(0.05)"
        )

    st = concurrent_stages(
        kit,
        {
            "x": (120, 9, True, None, meet("x", "y")),
            "y": (120, 8, True, None, meet("y", "x")),
            "slow": (1, 7, True, None, "import time; time.sleep(60)"),  # a check past its budget: stopped
            "m": (60, 6, False, None, "import time; time.sleep(0.2)"),
            "n": (60, 5, False, None, "import time; time.sleep(0.2)"),
        },
    )
    monkeypatch.setattr(kit, "STAGES", st)
    out = tmp_path / "out"
    rc = kit.main(["--device", "cpu", "--concurrent", "--out", str(out), "--work", str(tmp_path / "work")])
    report = json.loads((out / "kit.json").read_text())
    r = {s["name"]: s for s in report["stages"]}
    assert rc == 1 and report["concurrent"] and report["planned_s"] == 120 + 60 + 60
    assert {n: s["status"] for n, s in r.items()} == {
        "x": "passed",
        "y": "passed",
        "slow": "over budget",
        "m": "passed",
        "n": "passed",
    }
    assert r["x"]["start_s"] < r["y"]["end_s"] and r["y"]["start_s"] < r["x"]["end_s"]  # they overlapped
    assert r["x"]["concurrent"] and not r["m"]["concurrent"]
    checks_end = max(r[n]["end_s"] for n in ("x", "y", "slow"))
    assert checks_end <= r["m"]["start_s"] and r["m"]["end_s"] <= r["n"]["start_s"]  # alone, in order of value
    assert [s["name"] for s in report["stages"]][-2:] == ["m", "n"]


def test_a_lane_runs_its_stacks_stages_in_order_and_stops_the_stack_after_the_last(tmp_path, monkeypatch):
    kit = load()
    run = kit.Run("cpu", True, tmp_path / "work")
    for d in ("logs", "stages"):
        (run.work / d).mkdir(parents=True)
    st = concurrent_stages(kit, {"a": (30, 9, True, "s", ""), "b": (30, 8, True, "s", ""), "c": (30, 7, True, "t", "")})
    stacks = kit.Stacks(run, list(st))
    started, stopped = [], []

    def get(name, timeout):
        if name not in stacks.open:
            started.append(name)
            stacks.open[name] = kit.Shared(name, None, f"http://{name}", tmp_path)
        return stacks.open[name]

    monkeypatch.setattr(stacks, "get", get)
    monkeypatch.setattr(stacks, "stop", lambda shared: stopped.append(shared.name) or {"pass": True})
    report = {"device": "cpu", "window_s": 100, "stages": []}
    k = kit.Kit(run, dict(os.environ), stacks, report, tmp_path, {}, {})
    monkeypatch.setattr(kit, "command", lambda argv, env, log, budget: (0, "passed"))
    k.phase(kit.lanes(list(st), run))
    r = {s["name"]: s for s in report["stages"]}
    assert sorted(started) == ["s", "t"]
    assert r["a"]["stack_started"] and not r["b"]["stack_started"] and r["a"]["end_s"] <= r["b"]["start_s"]
    assert sorted(stopped) == ["s", "t"] and set(stacks.stops) == {"s", "t"} and stacks.open == {}


def test_every_stack_is_shared_by_checks_only_or_by_measurements_only():
    kit = load()
    kinds = {}
    for s in kit.STAGES:
        if s.stack:
            kinds.setdefault(s.stack, set()).add(s.concurrent)
    assert all(len(k) == 1 for k in kinds.values()), kinds
    concurrent = {s.name for s in kit.STAGES if s.concurrent}
    assert concurrent == {
        "smoke",
        "check-fp32-colocated",
        "check-fp32-ipc",
        "check-bf16-ipc",
        "check-fp32-zmq",
        "checkpoint",
        "bench-stacks",
    }
    by_name = {s.name: s for s in kit.STAGES}  # the measurements' stacks start beside the checks, once built
    assert by_name["bench-stacks"].lane == by_name["checkpoint"].lane and set(by_name["bench-stacks"].starts) == set(
        kit.STACKS
    )
    for s in kit.STAGES:  # a stage that starts stacks comes before every stage on them, in CPU mode's order too
        assert all(t.value < s.value for t in kit.STAGES if t.stack in s.starts), s.name


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
        if s.starts:  # it starts stacks, the kit's own way (`Stacks.start_all`)
            assert s.argv is None and s.concurrent
            continue
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
    shared = kit.Shared("bench-colocated", FakeStack(4321, tmp_path / "log"), "http://x:1", tmp_path / "tc")
    assert shared.args() == ["--stack", "colocated", "http://x:1", "4321", str(tmp_path / "tc")]
    assert kit.Shared("fp32-shm", None, "http://x:2", tmp_path).args() == ["--url", "http://x:2"]
    argv = by_name["bench-colocated"].argv(run, 30.0)  # bench.gpu bounded by the stage, not by its own minimum
    assert argv[argv.index("--budget-s") + 1] == "28" and argv[argv.index("--min-system-s") + 1] == "0"
    counted = [
        s.name
        for s in kit.STAGES
        if s.name.startswith("bench-") and s.argv and "--no-kernel-count" not in s.argv(run, 30.0)
    ]
    assert counted == ["bench-colocated"]  # bench.gpu's kernel count: once a kit


class FakeStack:
    """A stack the kit judges the stop of: a process with a child, and a log."""

    def __init__(self, pid: int, log: Path, proc=None) -> None:
        self.proc, self.log_path = proc or type("P", (), {"pid": pid})(), log

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def test_a_shared_stacks_stop_is_judged_and_reported(tmp_path):
    kit = load()
    stage = kit.Stage("a", 30, 30, 1, lambda r, b: [], stack="s")
    stacks = kit.Stacks(kit.Run("cpu", True, tmp_path), [stage])
    log = tmp_path / "stack.log"
    log.write_text("Producer process has been terminated before all shared CUDA tensors released\n")
    # a "stack" whose child outlives it (it ignores SIGTERM): a stop that leaves a process behind
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    proc.stdout.readline()  # the child runs
    pids = stacks.gpu_check().descendants(proc.pid)
    try:
        stacks.open["s"] = kit.Shared("s", FakeStack(proc.pid, log, proc), "http://x", tmp_path)
        stacks.done(stage)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    judged = stacks.stops["s"]
    assert not judged["pass"] and judged["warnings"] == {"Producer process has been terminated": 1}
    assert judged["processes_left"] == pids[1:] and len(pids) == 2
    report = {"stages": [{"name": "a", "stack": "s"}], "stacks": stacks.stops}
    assert "| s | a | failed | 0 | 1 | Producer process has been terminated (1) |" in kit.stop_lines(report)


def test_when_the_kit_stops_the_running_checks_stop_and_no_lane_starts_another(tmp_path, monkeypatch):
    kit = load()
    monkeypatch.setattr(kit, "KILL_GRACE_S", 2.0)
    run = kit.Run("cpu", True, tmp_path / "work")
    for d in ("logs", "stages"):
        (run.work / d).mkdir(parents=True)
    after = tmp_path / "after"
    st = concurrent_stages(
        kit,
        {
            "x": (600, 9, True, "s", "import time; time.sleep(600)"),
            "x2": (600, 8, True, "s", f"import pathlib; pathlib.Path({str(after)!r}).touch()"),
        },
    )
    stacks = kit.Stacks(run, list(st))
    monkeypatch.setattr(stacks, "get", lambda name, timeout: kit.Shared(name, None, "http://s", tmp_path))
    monkeypatch.setattr(stacks, "stop", lambda shared: {"pass": True})
    report = {"device": "cpu", "window_s": 1200, "stages": []}
    k = kit.Kit(run, dict(os.environ), stacks, report, tmp_path, {}, {})
    phase = threading.Thread(target=k.phase, args=(kit.lanes(list(st), run),))
    phase.start()
    while not kit.RUNNING:  # x's command runs
        time.sleep(0.05)
    (proc,) = kit.RUNNING
    kit.stop_all()
    phase.join()
    assert proc.returncode is not None and not kit.RUNNING
    assert [(r["name"], r["status"]) for r in report["stages"]] == [
        ("x", "stopped (the kit stopped)"),
        ("x2", "not run (the kit stopped)"),
    ]
    assert not after.exists()


def test_a_measurement_stack_started_beside_the_checks_costs_the_measurements_nothing(tmp_path, monkeypatch):
    """A stack's start is in the time of the stage that starts it: a `starts` stage in the checks' phase (its lane:
    after the checkpoint), else the first measurement on it."""
    kit = load()
    monkeypatch.setattr(kit, "STACKS", {"S": kit.BenchStack("colocated", (4, 4), (15, 15))})
    run = kit.Run("cuda:0", False, tmp_path)
    st = (
        kit.Stage("build", 10, 10, 9, lambda r, b: [], concurrent=True, lane="L"),
        kit.Stage("starter", 0, 0, 8, None, concurrent=True, lane="L", starts=("S",)),
        kit.Stage("check", 30, 30, 7, lambda r, b: [], concurrent=True),
        kit.Stage("m1", 20, 20, 6, lambda r, b: [], stack="S"),
        kit.Stage("m2", 30, 30, 5, lambda r, b: [], stack="S"),
    )
    assert [[s.name for s in lane] for lane in kit.lanes(list(st), run)] == [["build", "starter"], ["check"]]
    assert kit.starters(list(st)) == {"S": "starter"}
    assert kit.plan_seconds(list(st), run, True) == max(10 + 15, 30) + 20 + 30
    chosen, _ = kit.plan(st, run, 1000, ["build", "check", "m1", "m2"], concurrent=True)  # m1 starts it
    assert kit.starters(chosen) == {"S": "m1"} and kit.plan_seconds(chosen, run, True) == 30 + (20 + 15) + 30
    chosen, left = kit.plan(st, run, 1000, ["build", "starter", "check"], concurrent=True)  # nothing runs on S
    assert [s.name for s in chosen] == ["build", "check"]
    assert left["starter"] == "not in plan (no stage runs on its stacks)"


def test_the_stages_the_window_left_out_run_in_the_time_the_plan_leaves(tmp_path, monkeypatch):
    """Budgets are upper bounds: after the plan, each stage the window left out runs, by value, if its time (its
    stack's start included when the stack is down) fits what is left of the window; the others stay out."""
    kit = load()
    monkeypatch.setattr(kit, "STACKS", {"S": kit.BenchStack("colocated", (4, 4), (145, 145))})
    run = kit.Run("cuda:0", False, tmp_path / "work")
    for d in ("logs", "stages"):
        (run.work / d).mkdir(parents=True)
    st = (
        kit.Stage("a", 100, 100, 9, lambda r, b: [sys.executable, "-c", ""]),
        kit.Stage("on-s", 10, 10, 8, lambda r, b: [sys.executable, "-c", ""], stack="S"),  # 10 + 145 to start S
        kit.Stage("b", 60, 60, 7, lambda r, b: [sys.executable, "-c", ""]),
        kit.Stage("huge", 600, 600, 6, lambda r, b: [sys.executable, "-c", ""]),
    )
    monkeypatch.setattr(kit, "STAGES", st)
    chosen, left = kit.plan(st, run, 150, None)
    assert [s.name for s in chosen] == ["a"] and set(left) == {"on-s", "b", "huge"}  # 100 + 60 > 150
    spare = [s for s in st if s.name in left]

    def kit_run(stacks, left):
        report = {"device": "cuda:0", "window_s": 150, "stages": []}
        return kit.Kit(run, dict(os.environ), stacks, report, tmp_path, left, kit.starters(chosen), window=150)

    stacks = kit.Stacks(run, chosen + spare)
    k = kit_run(stacks, dict(left))
    k.lane(chosen, alone=True)
    k.fill(spare)
    r = {s["name"]: s for s in k.report["stages"]}
    assert list(r) == ["a", "b"] and r["b"]["filled"] and not r["a"].get("filled")  # on-s: S's start does not fit
    assert r["b"]["status"] == "passed" and r["b"]["budget_s"] == 60
    assert k.left == {"on-s": "not in plan (window)", "huge": "not in plan (window)"} and stacks.users["S"] == 0
    md = kit.markdown(kit.write(k.report, tmp_path, k.t0, kit.stage_list(k.report["stages"], k.left, run)))
    assert "| b | 7 | 60 |" in md and md.count("no: run in the time left") == 1
    stacks = kit.Stacks(run, [st[1]])  # S still up (an earlier stage's): on-s fits, for its own 10 s
    stacks.open["S"] = kit.Shared("S", FakeStack(4321, tmp_path / "log"), "http://s", tmp_path)
    monkeypatch.setattr(stacks, "stop", lambda shared: {"pass": True})
    k = kit_run(stacks, {"on-s": "not in plan (window)"})
    k.fill([st[1]])
    (r,) = k.report["stages"]
    assert (r["name"], r["status"], r["budget_s"], r["stack_started"]) == ("on-s", "passed", 10, False)
    assert k.left == {} and stacks.open == {}  # its last stage done: S stopped


def test_a_starting_stage_starts_at_once_the_stacks_a_stage_will_run_on(tmp_path, monkeypatch):
    kit = load()
    both = {"S": kit.BenchStack("colocated", (4, 4), (20, 20)), "T": kit.BenchStack("disagg", (4, 4), (30, 30))}
    monkeypatch.setattr(kit, "STACKS", both)
    run = kit.Run("cpu", True, tmp_path)
    starter = kit.Stage("starter", 0, 0, 9, None, concurrent=True, starts=("S", "T"))
    m = kit.Stage("m", 10, 10, 5, lambda r, b: [], stack="S")
    stacks = kit.Stacks(run, [starter, m])  # nothing runs on T: it is not started
    waiting = threading.Barrier(2, timeout=5)
    calls = []

    def get(name, timeout):
        calls.append((name, timeout))
        if name == "S":
            raise TimeoutError("not ready in 20 s")
        return kit.Shared(name, None, "http://t", tmp_path)

    monkeypatch.setattr(stacks, "get", get)
    r = kit.run_stage(starter, run, {}, stacks, time.monotonic(), kit.seconds(starter, run, kit.starters([starter, m])))
    assert calls == [("S", 20)] and r["status"] == "over budget" and r["started"] == []
    assert r["error"] == "stack S: TimeoutError: not ready in 20 s"
    stacks = kit.Stacks(run, [starter, m, kit.Stage("n", 10, 10, 4, lambda r, b: [], stack="T")])

    def meet(name, timeout):  # each waits for the other: they start at once
        waiting.wait()
        stacks.open[name] = kit.Shared(name, None, "http://t", tmp_path)
        return stacks.open[name]

    monkeypatch.setattr(stacks, "get", meet)
    r = kit.run_stage(starter, run, {}, stacks, time.monotonic(), 30)
    assert r["status"] == "passed" and r["started"] == ["S", "T"] and set(stacks.open) == {"S", "T"}


def test_a_stack_start_that_outlasts_its_stage_goes_on_for_the_next_stage_on_it(tmp_path, monkeypatch):
    kit = load()
    run = kit.Run("cpu", True, tmp_path)
    (tmp_path / "logs").mkdir()
    noop = lambda r, b: [sys.executable, "-c", ""]  # noqa: E731
    a, b = kit.Stage("a", 1, 1, 2, noop, stack="s"), kit.Stage("b", 30, 30, 1, noop, stack="s")
    gate = tmp_path / "ready"  # the stack says it serves once this file exists
    serve = (
        f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)\n"
        "print('pdserve is serving', flush=True)\ntime.sleep(60)"
    )
    launches = []

    def argv(gc, name, port):
        launches.append(name)
        return [sys.executable, "-c", serve]

    stacks = kit.Stacks(run, [a, b])
    monkeypatch.setattr(stacks, "argv", argv)
    monkeypatch.setattr(stacks, "stop", lambda shared: shared.stack.stop() or {"pass": True})
    t0 = time.monotonic()
    try:
        r = kit.run_stage(a, run, dict(os.environ), stacks, t0, 1.0)
        stacks.done(a)
        assert r["status"] == "over budget" and "goes on starting" in r["error"], r
        (starting,) = stacks.starting.values()
        assert starting.stack.proc.poll() is None  # not stopped: b waits for it
        gate.touch()
        r = kit.run_stage(b, run, dict(os.environ), stacks, t0, 30)
        stacks.done(b)
        assert r["status"] == "passed" and r["stack"] == "s" and launches == ["s"], r
        assert starting.stack.proc.poll() is not None and stacks.stops == {"s": {"pass": True}}
    finally:
        stacks.close()

    # a start no later stage waits for is stopped once its last stage is done
    gate.unlink()
    stacks = kit.Stacks(run, [a])
    monkeypatch.setattr(stacks, "argv", argv)
    try:
        r = kit.run_stage(a, run, dict(os.environ), stacks, t0, 1.0)
        (starting,) = stacks.starting.values()
        stacks.done(a)
        assert r["status"] == "over budget" and stacks.starting == {} and starting.stack.proc.poll() is not None
    finally:
        stacks.close()


def test_once_the_kit_stops_no_stack_starts_and_one_that_gets_ready_is_stopped(tmp_path, monkeypatch):
    """A lane whose start was abandoned by the kit's stop must not start the next stack after close() looked, and a
    start that ends after it must not leave its stack running."""
    kit = load()
    run = kit.Run("cpu", True, tmp_path)
    (tmp_path / "logs").mkdir()
    noop = lambda r, b: [sys.executable, "-c", ""]  # noqa: E731
    stage = kit.Stage("a", 30, 30, 1, noop, stack="s")
    serve = "import time\nprint('pdserve is serving', flush=True)\ntime.sleep(60)"
    stacks = kit.Stacks(run, [stage])
    monkeypatch.setattr(stacks, "argv", lambda gc, name, port: [sys.executable, "-c", serve])
    kit.STOPPING.set()
    try:
        r = kit.run_stage(stage, run, dict(os.environ), stacks, time.monotonic(), 30)
        assert r["status"] == "not run (the kit stopped)" and not stacks.starting and not stacks.open
        with pytest.raises(RuntimeError, match="the kit is stopping"):
            stacks.start("s", 30)
        assert not stacks.starting and not stacks.open
    finally:
        kit.STOPPING.clear()
    # the kit stops while the stack starts: once ready, it is stopped, not opened
    ready = threading.Event()
    real = stacks.gpu_check().Stack

    made = []

    class Racing(real):
        def wait_ready(self, timeout_s):
            made.append(self)
            super().wait_ready(timeout_s)
            kit.STOPPING.set()  # close() ran meanwhile
            ready.set()

    monkeypatch.setattr(stacks.gpu_check(), "Stack", Racing)
    try:
        with pytest.raises(RuntimeError, match="the kit is stopping"):
            stacks.start("s", 30)
        assert ready.is_set() and not stacks.open and not stacks.starting
        assert made[0].proc.poll() is not None, "a stack ready after the kit stopped was left running"
    finally:
        kit.STOPPING.clear()
        stacks.close()


def test_cpu_mode_runs_its_stages_with_tritons_interpreter(tmp_path, monkeypatch):
    """The attention stage and bench.gpu's kernel count need TRITON_INTERPRET=1 on the CPU: the kit sets it there."""
    kit = load()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kit.signal, "signal", lambda *_: None)
    seen = tmp_path / "seen"
    code = f"import os, pathlib; pathlib.Path({str(seen)!r}).write_text(os.environ.get('TRITON_INTERPRET', 'unset'))"
    monkeypatch.setattr(kit, "STAGES", stages(kit, {"a": code}, {"a": 30}, {"a": 1}))
    assert kit.main(["--device", "cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    assert seen.read_text() == "1"


def test_the_gpu_plan_is_printed_without_a_gpu_and_nothing_runs(tmp_path, capsys):
    kit = load()
    out = tmp_path / "out"
    argv = ["--device", "cuda:0", "--window", "284", "--plan-only", "--out", str(out), "--work", str(tmp_path / "w")]
    assert kit.main(argv) == 0
    text = capsys.readouterr().out
    chosen, left = kit.plan(kit.STAGES, kit.Run("cuda:0", False, tmp_path), 284, None, True)
    total = kit.plan_seconds(chosen, kit.Run("cuda:0", False, tmp_path), True)
    assert text.startswith(f"kit plan on cuda:0: {len(chosen)} stages, {total:.0f} s of a 284 s window")
    assert all(f"| {s.name} | {s.value} |" in text for s in kit.STAGES)  # every stage: planned, or why not
    assert text.count("runs after the plan if its time fits") == len(left) > 0
    assert "| bench-stacks | 87 | 30 | with the checks, lane 4; starts bench-colocated, bench-disagg |" in text
    assert not out.exists()


def test_the_kit_runs_as_a_script_from_any_folder_without_pythonpath(tmp_path):
    """`python scripts/kit.py` as gpu_run.sh and a user run it: its stages' checks import bench's modules, which are
    no installed package, so the script finds them from its own tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, str(SCRIPT), "--plan-only", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kit plan on cuda:0:") and "| bench-colocated | 85 |" in done.stdout
