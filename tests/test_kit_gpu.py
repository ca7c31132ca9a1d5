"""scripts/kit.py's GPU mode, checked on the CPU: the commands and stacks the kit builds for a GPU run (`--device
cuda:0`, bfloat16, cuda_ipc, qwen3-0.6b) are ones their targets accept, and no stage writes into the kit's `--out`
(on the GPU box only what is there comes back). Nothing runs: each target's own parser is called on the built
command, with torch answering as on a one-GPU host."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.kit import load_script

ROOT = Path(__file__).parents[1]
PATH_FLAGS = ("--out", "--json", "--out-dir", "--log-dir")  # where a stage writes


class Parsed(Exception):
    """Raised in place of running a command, once its parser has taken its arguments."""


@pytest.fixture
def gpu(monkeypatch):
    """torch as on the GPU box: CUDA available, one device (no stage here touches it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def kit():
    return load_script(ROOT / "scripts" / "kit.py")


def gpu_commands(kit, run) -> dict[str, list[str]]:
    """{stage: its command on a GPU, as run_stage gives it: with its shared stack's arguments}."""
    out = {}
    for s in kit.STAGES:
        if s.argv is None:
            continue
        argv = s.argv(run, s.budget(run))
        if s.stack:
            name = s.stack.format(ipc=run.ipc)
            stack = SimpleNamespace(proc=SimpleNamespace(pid=4321))
            argv += kit.Shared(name, stack, "http://127.0.0.1:8000", run.work / "triton-cache" / name).args()
        out[s.name] = argv
    return out


def parsed(argv: list[str], monkeypatch) -> argparse.Namespace:
    """The arguments of `argv` ([python, -m, module, ...] or [python, script, ...]) as its target's main() parses
    them; its main() stops there."""
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    module, args = (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    main = importlib.import_module(module).main if argv[1] == "-m" else load_script(ROOT / module).main
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        m.setattr(sys, "argv", [module, *args])
        try:
            main()
        except Parsed as p:
            return p.args[0]
        except SystemExit as e:
            pytest.fail(f"{module} refused the kit's arguments {args} (exit {e.code})")
    pytest.fail(f"{module}'s main() did not parse its arguments")


def test_every_gpu_command_is_one_its_target_parses(tmp_path, monkeypatch, gpu, kit):
    run = kit.Run("cuda:0", False, tmp_path)
    gc = load_script(ROOT / "scripts" / "gpu_check.py")
    stacks = {p.name for p in gc.plans(run.device)}
    commands = gpu_commands(kit, run)
    assert set(commands) == {s.name for s in kit.STAGES if s.argv}
    for name, argv in commands.items():
        assert argv[0] == sys.executable, name
        if argv[1] == "-c":  # the checkpoint stage's code
            compile(argv[2], name, "exec")
            continue
        a = parsed(argv, monkeypatch)
        assert a.device == run.device, name  # each target runs on the GPU, bench.startup's `pdserve up` too
        if argv[1] == "scripts/gpu_check.py":  # a stack of gpu_check's on this device, or nothing is checked
            assert a.stacks and set(a.stacks) <= stacks, (name, a.stacks)
            assert a.faults or a.url, name  # a check runs on the kit's stack
            assert not a.faults or gc.fault_plans(a), name
    gpu, by_name = importlib.import_module("bench.gpu"), {s.name: s for s in kit.STAGES}
    for name, argv in commands.items():  # bench.gpu's own checks of its configuration, as on the GPU box
        if argv[1:3] == ["-m", "bench.gpu"]:
            cfg = gpu.parse_args(argv[3:])
            assert (cfg.device, cfg.dtype, cfg.model) == (run.device, "bfloat16", "qwen3-0.6b"), name
            stack = by_name[name].stack
            assert [s.system for s in cfg.shared] == ([kit.STACKS[stack].mode] if stack else []), name


def test_every_gpu_stack_is_one_pdserve_up_starts(tmp_path, monkeypatch, gpu, kit):
    """The stacks the kit starts (gpu_check's, bench.gpu's) and the one bench.startup times: `pdserve up` parses
    each, plans its nodes on the GPU, and each node's config and the router's command are accepted."""
    from pdserve import cli, launcher

    run = kit.Run("cuda:0", False, tmp_path)
    gc = load_script(ROOT / "scripts" / "gpu_check.py")
    names = {s.stack.format(ipc=run.ipc) for s in kit.STAGES if s.stack} | set(kit.STACKS)
    ups = {name: kit.Stacks(run, list(kit.STAGES)).argv(gc, name, 8000)[3:] for name in names}
    ups["startup"] = startup_up_args(kit, run, monkeypatch)
    for name, up in ups.items():
        a = cli.build_parser().parse_args(up)
        nodes = launcher.plan(a, tmp_path)
        for role, node_argv, _ in nodes:
            cfg = cli.node_config(cli.build_parser().parse_args(node_argv[3:]))
            assert cfg.engine.device == run.device, (name, role)
            if "cuda_ipc" in name or name == "bench-disagg":
                assert cfg.kv_transport == "cuda_ipc", (name, role)
        cli.build_parser().parse_args(launcher.router_argv(a, launcher.planned_infos(nodes), "x")[3:])


class Started(Exception):
    """Raised in place of starting a process: its command."""


def startup_up_args(kit, run, monkeypatch) -> list[str]:
    """The `pdserve up` arguments bench.startup starts, as the kit's startup stage runs it."""
    import bench.startup

    def popen(argv, **_):
        raise Started(argv)

    argv = next(s for s in kit.STAGES if s.name == "startup").argv(run, 20.0)
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", argv[2:])
        m.setattr("pdserve.checkpoint.resolve_model", Path)
        m.setattr(bench.startup.subprocess, "Popen", popen)
        with pytest.raises(Started) as started:
            bench.startup.main()
    up = started.value.args[0]
    return up[up.index("pdserve") + 1 :]


def test_no_gpu_stage_writes_into_the_kits_out(tmp_path, kit):
    """Each stage's files go under --work (packed by gpu_run.sh into one tarball): $OUT holds only gpu_run.sh's
    four files, of the eight a GPU run may bring back. bench.gpu writes into $OUT unless given --out-dir."""
    run = kit.Run("cuda:0", False, tmp_path / "work")
    for name, argv in gpu_commands(kit, run).items():
        paths = [Path(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in PATH_FLAGS]
        assert all(p.is_relative_to(run.work) for p in paths), (name, paths)
        if argv[1:3] == ["-m", "bench.gpu"]:
            assert "--out-dir" in argv, name


@pytest.mark.parametrize("after, rc", [(99_990.0, 0), (99_000.0, 1)])
def test_a_gpu_run_judges_the_device_memory_and_kit_md_says_so(tmp_path, monkeypatch, kit, after, rc):
    """On a GPU the checks run at once, then the measurements, and the kit judges the device's free memory over its
    whole run (gpu_check's free_device_mb, answering here as a GPU would): memory that did not come back, after the
    driver had a moment to free it, fails the kit even where every stage passed, and kit.md says so."""
    free = iter([100_000.0, 98_000.0, 98_500.0, after])  # before; then back in steps, as the driver frees it
    last = []

    def free_device_mb(device):
        last[:] = [next(free, last[0] if last else None)]
        return last[0]

    def wait_until(cond, timeout=10.0):  # gpu_check's, without its sleeps: a few looks
        return any(cond() for _ in range(4))

    fake = SimpleNamespace(
        free_device_mb=free_device_mb, wait_until=wait_until, RELEASE_SLACK_MB=64, device_total_gb=lambda device: 141.0
    )
    monkeypatch.setattr(kit, "gpu_check_module", lambda: fake)
    monkeypatch.setattr(kit.signal, "signal", lambda *_: None)
    command = lambda run, budget: [sys.executable, "-c", "pass"]  # noqa: E731
    stages = (kit.Stage("check", 30, 30, 9, command, concurrent=True), kit.Stage("measure", 30, 30, 8, command))
    monkeypatch.setattr(kit, "STAGES", stages)
    out = tmp_path / "out"
    assert kit.main(["--device", "cuda:0", "--out", str(out), "--work", str(tmp_path / "work")]) == rc
    report = json.loads((out / "kit.json").read_text())
    assert report["concurrent"] and [s["concurrent"] for s in report["stages"]] == [True, False]
    assert all(s["status"] == "passed" for s in report["stages"])
    assert report["device_memory"]["pass"] == (rc == 0)
    verdict = "passed" if rc == 0 else "failed: more than 64 MiB short"
    line = f"100000 MiB before the first stack started, {after:.0f} MiB after the last stopped: {verdict}."
    assert line in (out / "kit.md").read_text()


@pytest.mark.parametrize("memory_gb, beside", [(None, True), (141.0, True), (79.6, False)])
def test_on_a_smaller_gpu_the_measurement_stacks_start_after_the_checks(kit, tmp_path, memory_gb, beside):
    """The checks' stacks and the measurements' together hold about 72 GiB: on an 80 GB GPU bench-stacks is left
    out, and each measurement stack starts with its first stage, its start in that stage's time."""
    run = kit.Run("cuda:0", False, tmp_path)
    stages, left = kit.for_memory(kit.STAGES, memory_gb)
    chosen, _ = kit.plan(stages, run, 10_000, None, concurrent=True)
    by = kit.starters(chosen)
    assert ("bench-stacks" in [s.name for s in chosen]) is beside and ("bench-stacks" in left) is not beside
    first = by["bench-colocated"]
    assert first == ("bench-stacks" if beside else "bench-colocated")
    colocated = next(s for s in chosen if s.name == "bench-colocated")
    start = kit.STACKS["bench-colocated"].start(run)
    assert kit.seconds(colocated, run, by) == colocated.budget_s + (0 if beside else start)
