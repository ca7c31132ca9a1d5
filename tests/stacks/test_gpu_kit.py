"""The GPU kit starts on a host like the GPU box: scripts/gpu_run.sh in its CPU mode, in a fresh venv that holds
only torch, transformers and triton (each with what it requires, as the box's do) and pip, plus the wheels that
`scripts/deps.py fetch` downloads for this machine's Python.

The venv is made cheaply and honestly: `python -m venv --without-pip`, then its site-packages gets symlinks to
those distributions' files (and pip's) in this interpreter's site-packages, nothing else; it does not see the
rest of this environment (no --system-site-packages). The wheels come from PyPI (pip's own cache makes a
second fetch cheap); without PyPI the test cannot build the box and is skipped, saying so. They are installed
once (all but one, into a site folder the gpu_run.sh runs start from: each installs only what its site lacks).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.kit import load_script

ROOT = Path(__file__).resolve().parents[2]
BOX_HAS = ("torch", "transformers", "triton", "pip")


def load_kit():
    return load_script(ROOT / "scripts" / "kit.py")


def _requires(dist: md.Distribution) -> list[str]:
    """Names of the distributions `dist` requires here (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def closure(names: tuple[str, ...]) -> list[md.Distribution]:
    """The distributions named and everything they require, as installed here."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            seen[name] = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional requirement this environment does not hold: the box would not either
        todo += _requires(seen[name])
    return list(seen.values())


def box_like_venv(root: Path) -> Path:
    """A venv whose site-packages links only BOX_HAS and their requirements; returns its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    for dist in closure(BOX_HAS):
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            src = base / top
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return root / "bin"


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def box(tmp_path_factory) -> tuple[Path, Path]:
    """(the box-like venv's bin folder, the wheels fetched for this machine's Python)."""
    root = tmp_path_factory.mktemp("box")
    wheels = root / "wheels"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "deps.py"),
            "fetch",
            "--dest",
            str(wheels),
            "--platform",
            *_platforms(),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:  # skipped only where PyPI is out of reach: deps.py failing on its own is a failure
        assert "Traceback" not in r.stderr and not _pypi_reachable(), r.stdout + r.stderr[-3000:]
        pytest.skip(f"the wheels could not be fetched (PyPI is out of reach): {r.stderr[-500:]}")
    return box_like_venv(root / "venv"), wheels


def _platforms() -> list[str]:
    """This machine's wheel platform tags (manylinux ones and the plain one)."""
    from packaging.tags import sys_tags

    return sorted({t.platform for t in sys_tags() if t.platform != "any"})[:20]


def _env(bin_dir: Path, tmp: Path, wheels: Path, site: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        WHEELS=str(wheels),
        OUT=str(tmp / "out"),
        GPU_RUN_WORK=str(tmp / "work"),
        GPU_RUN_SITE=str(site),
    )
    return env


@pytest.fixture(scope="module")
def site(box, tmp_path_factory) -> tuple[Path, Path]:
    """(a site folder holding every wheel's distribution but prometheus_client's, installed there by `deps.py
    install` as gpu_run.sh runs it; the wheels without prometheus_client's). The tests below run gpu_run.sh on it,
    which installs only what a site lacks: the wheels are unpacked once."""
    bin_dir, wheels = box
    root = tmp_path_factory.mktemp("site")
    partial = root / "partial"
    partial.mkdir()
    for w in wheels.glob("*.whl"):
        if not w.name.lower().startswith("prometheus_client"):
            (partial / w.name).symlink_to(w)
    argv = [
        str(bin_dir / "python3"),
        str(ROOT / "scripts" / "deps.py"),
        "install",
        "--wheels",
        str(partial),
        "--target",
        str(root / "site"),
    ]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(bin_dir, root, partial, root / "site"))
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "site", partial


def test_fetch_leaves_out_what_a_host_with_torch_transformers_and_triton_holds(box):
    """deps.py fetch's default `--have`: torch, transformers, triton and the tokenizers and safetensors transformers
    requires (the box-like venv holds each of them), so none of their wheels, nor huggingface_hub's that tokenizers
    pulls in, travels to the host."""
    deps = load_script(ROOT / "scripts" / "deps.py")
    bin_dir, wheels = box
    fetched = {deps.wheel_name(w) for w in wheels.glob("*.whl")}
    assert fetched and not fetched & {deps.normalize(n) for n in (*deps.HOST_HAS, "huggingface_hub")}, fetched
    assert {deps.normalize(n) for n in deps.HOST_HAS} <= {deps.normalize(d.name) for d in closure(BOX_HAS)}


def test_the_box_venv_lacks_the_serving_dependencies(box):
    bin_dir, _ = box
    nowhere = Path("/nonexistent")
    r = subprocess.run(
        [str(bin_dir / "python3"), str(ROOT / "scripts" / "deps.py"), "check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(bin_dir, nowhere, nowhere, nowhere),
    )
    assert r.returncode == 1
    assert "pyzmq is not installed" in r.stderr and "fastapi is not installed" in r.stderr
    assert "torch" not in r.stderr and "transformers" not in r.stderr  # those the box has


def test_a_missing_dependency_stops_gpu_run_before_anything_starts(box, site, tmp_path):
    bin_dir, _ = box
    folder, partial = site
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_run.sh"), "--cpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(bin_dir, tmp_path, partial, folder),
        timeout=300,
    )
    assert r.returncode == 3, r.stdout[-2000:]
    assert re.search(r"deps install: 0 of \d+ wheels needed here", r.stdout), r.stdout[-2000:]  # the site holds them
    assert "prometheus_client is not installed" in r.stdout
    assert "kit:" not in r.stdout  # no stage was started


def test_gpu_run_cpu_mode_passes_in_the_box_venv(box, site, tmp_path):
    bin_dir, wheels = box
    folder = tmp_path / "site"  # the shared site's entries (links), to which gpu_run.sh adds prometheus_client
    folder.mkdir()
    for entry in site[0].iterdir():
        (folder / entry.name).symlink_to(entry)
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_run.sh"), "--cpu"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(bin_dir, tmp_path, wheels, folder),
        timeout=1800,
    )
    log = r.stdout
    assert r.returncode == 0, log[-4000:]
    assert re.search(r"deps install: 1 of \d+ wheels needed here", log), log[-4000:]  # prometheus_client, not the rest
    assert re.search(r"dependencies: \d+ import", log)
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"gpu_run.log", "kit.md", "kit.json", "logs.tar.gz"}
    kit = json.loads((out / "kit.json").read_text())
    status = {s["name"]: s["status"] for s in kit["stages"]}
    assert set(status) == set(load_kit().names()), status  # every stage is reported
    ran = [s for s in kit["stages"] if "start_s" in s]  # CPU mode: one after another, none beside another
    assert not kit["concurrent"] and not any(s["concurrent"] for s in ran)
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(ran, ran[1:], strict=False)), ran
    assert all(v in ("passed", "not present in this tree") for v in status.values()), status  # none left for time
    assert [s["value"] for s in kit["stages"] if s["status"] == "passed"] == sorted(
        (s["value"] for s in kit["stages"] if s["status"] == "passed"), reverse=True
    )
    shared = {s["name"]: s.get("stack_started") for s in kit["stages"] if s.get("stack") == "fp32-colocated"}
    assert shared == {"smoke": True, "check-fp32-colocated": False}  # one stack served both stages
    shared = {s["name"]: s.get("stack_started") for s in kit["stages"] if s.get("stack") == "bench-colocated"}
    assert shared == {"bench-colocated": False, "bench-large": False}  # and bench.gpu's colocated runs, on the stack
    starter = next(s for s in kit["stages"] if s["name"] == "bench-stacks")  # started for them after the checkpoint
    assert starter["started"] == ["bench-colocated", "bench-disagg"] and "stack" not in starter
    assert set(kit["stacks"]) == {s["stack"] for s in kit["stages"] if s.get("stack")}  # every shared stack's stop
    assert all(j["pass"] and j["processes_left"] == [] for j in kit["stacks"].values()), kit["stacks"]
    assert "| bench-colocated | bench-colocated, bench-large | passed |" in (out / "kit.md").read_text()
    large = json.loads((tmp_path / "work" / "stages" / "bench-large.json").read_text())["results"]
    assert [(r["label"], r["shared_stack"].startswith("http")) for r in large] == [("sharegpt_like 4/4", True)]
    disagg = json.loads((tmp_path / "work" / "stages" / "bench-disagg.json").read_text())["results"][0]["step_floors"]
    groups = {f["node"]: {g: v["steps"] for g, v in f["groups"].items() if v["steps"]} for f in disagg}
    assert set(groups["prefill"]) == {"prompt chunks"} and "decode 1-8" in groups["decode"], groups  # each floor
    fp32 = json.loads((tmp_path / "work" / "stages" / "check-fp32-ipc.json").read_text())["stacks"]["fp32-shm"]
    assert fp32["greedy_exact"]["exact"] == 4 and fp32["sampling"]["seeds_judged"]
    assert fp32["top_k1_greedy"]["greedy"] == 4
    kv = fp32["kv_transfer"]  # every request shipped its KV, or was sent again and prefilled on the decode node
    assert kv["transfers"] >= 4 and kv["transfers"] + kv["local_prefills"] == kv["requests"] > 4
    assert status["faults"] == "passed", status
    assert_faults_checked(tmp_path / "work")
    start = json.loads((tmp_path / "work" / "stages" / "startup.json").read_text())  # a start, stage by stage
    assert start["first_completion_s"] >= start["serving_s"] > 0 and not start["warm_up"]  # the stack's cache copied
    stages = start["runs"]["this"][0]["stages"]
    assert stages["up"]["ready_after_launch_s"] > 0 and {"prefill", "decode", "router"} <= set(stages), stages
    profile = json.loads((tmp_path / "work" / "stages" / "profile.json").read_text())
    assert list(profile["steps"]) == ["decode-4", "decode-8", "chunk-64"]
    assert [profile["steps"][k]["record"]["decode_tokens"] for k in ("decode-4", "decode-8")] == [4, 8]
    assert profile["step_floors"]["decode 1-8"]["steps"] > 0 and profile["step_floors"]["prompt chunks"]["steps"] > 0
    assert (folder / "prometheus_client").is_dir()  # the serving dependencies came from the wheels, installed there
    shutil.rmtree(tmp_path / "work", ignore_errors=True)


def assert_faults_checked(work: Path) -> None:
    """The faults stage's report (gpu_check --faults on tiny over shm) shows each fault happened, not only its
    tokens: a re-dispatch counted after prefill0's kill, the stopped decode node's pool mapped then let go, every
    process of the stack gone after its stop."""
    faults = json.loads((work / "stages" / "faults.json").read_text())["stacks"]["fp32-shm"]
    kill, restart, stop = faults["prefill_kill"], faults["decode_restart"], faults["clean_stop"]
    assert kill["exact"] == kill["requests"] and kill["held_at_kill"] >= 2 and kill["redispatched"] >= 1, kill
    assert kill["killed_exit_code"] == -9
    assert restart["exact"] == restart["requests"] and restart["stopped_exit_code"] == 0, restart
    assert restart["segments_mapped"] >= 1 and restart["segments_mapped_by_restarted"] >= 1, restart
    assert restart["segments_orphaned"] == [] and restart["processes_left"] == [], restart
    assert stop["processes"] >= 3 and stop["processes_left"] == [] and stop["warnings"] == {}, stop
