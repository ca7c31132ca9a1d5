"""The GPU kit's stages: a plan that fits the window, each stage under its own budget (docs/gpu.md).

    python scripts/kit.py --device cuda:0 --out OUT              # the default plan: the stages that fit 300 s
    python scripts/kit.py --device cuda:0 --stages smoke bench-colocated --window 200
    python scripts/kit.py --device cpu --out OUT                 # CPU mode: every stage, tiny sizes
    python scripts/kit.py --device cuda:0 --plan-only            # the GPU plan, printed on any host; nothing runs

1. The plan: the stages named (`--stages`); by default on a GPU, the stages of this tree in order of value
   while the plan's time fits the window; in CPU mode, every stage. The plan's time (`plan_seconds`): on a GPU,
   the longest lane of the checks (`Stage.concurrent`: they run at once; the checks on one stack form one lane,
   and so do the stages naming one `Stage.lane`) plus the times of the measurements, which run one at a time; in
   CPU mode (`--no-concurrent`) every stage's time added up. A stage's time (`seconds`) is its budget plus the
   start of each measurement stack (STACKS) it starts: the `bench-stacks` stage starts them beside the checks once
   the checkpoint is built, so the measurements on them do not wait for a start (on a device of less than
   BESIDE_CHECKS_MIN_GB, not: each starts with its first stage). A plan past `--window` is
   refused, in one line, before anything runs (exit code 2).
2. Each stage runs as its own process group under its own time: a stage past it is stopped (SIGTERM, then
   SIGKILL) and reported "over budget"; the next stage still runs. On a GPU the checks run first, at once (a
   thread a lane), then the measurements, one at a time in order of value, alone on the GPU.
3. The budgets are upper bounds, so the plan often ends early: then each stage the window left out runs, in order
   of value, if its time fits what is left of the window (`Kit.fill`; "no: run in the time left" in the report).
4. A stage whose module is not in this tree (`importlib.util.find_spec`, or its option missing) is reported "not
   present in this tree"; a stage left out by the window, and not run in the time left, is reported "not in plan
   (window)". Every stage of STAGES appears in the report.
5. The stages naming one stack share it (`Stage.stack`): gpu_check's stacks (passed with `--url`) and bench.gpu's
   (STACKS, passed with `--stack`: bench-colocated and bench-large run on one). The kit starts it before the first
   of them (or in `bench-stacks`) and stops it after the last, and judges that stop as gpu_check's check (e) does
   its own: its shared-memory segments released, no "Producer process has been terminated" warning or traceback
   in its log, every process gone. A stop that is not clean fails the kit. Stacks start and stop while others run,
   so no stop is judged by the device's free memory: the kit judges that once, over its whole run
   (`device_memory`: back after the last stack stopped to what it was before the first started).
6. The report: `kit.md` and `kit.json` in `--out` (every stage; each shared stack's stop); each stage's output and
   JSON under `--work` (`logs/<stage>.out`, `stages/<stage>.json`), packed by gpu_run.sh into one tarball.

Adding a stage is one entry in STAGES.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench's and pdserve's modules, when run as `python scripts/kit.py`

from pdserve.process import unwind_once  # noqa: E402 (standard library only)

GPU_WINDOW_S = 300.0
CPU_WINDOW_S = 1500.0
KILL_GRACE_S = 15.0  # after SIGTERM, time for a stage's stacks to stop before SIGKILL
BENCH_MARGIN_S = 2.0  # bench.gpu's --budget-s: the stage's budget less this, so that it ends its run and writes its
# report before the kit stops it; --min-system-s 0: the kit, not bench.gpu, bounds the stage
PY = sys.executable


@dataclass(frozen=True)
class Run:
    """What a stage's command sees: the device, the sizes, where to write."""

    device: str
    tiny: bool
    work: Path

    @property
    def ipc(self) -> str:
        return "shm" if self.tiny else "cuda_ipc"

    @property
    def model(self) -> str:
        return "tiny" if self.tiny else "qwen3-0.6b"

    @property
    def check_model(self) -> str:
        return "tiny" if self.tiny else "small"

    def json(self, name: str) -> Path:
        return self.work / "stages" / f"{name}.json"


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # on a GPU
    cpu_budget_s: float  # in CPU mode (tiny sizes, a shared CPU)
    value: int  # higher runs first and enters the default plan first
    argv: Callable[[Run, float], list[str]] | None  # (the run, this stage's budget) -> the command; None: `starts`
    present: Callable[[], bool] = field(default=lambda: True)
    stack: str | None = None  # the stack it runs on (STACKS' or a gpu_check one): the stages naming one share it
    concurrent: bool = False  # a check: runs beside the other checks (on a GPU); else a measurement, alone
    lane: str | None = None  # a concurrent stage's lane, where it is not its stack's: the stages naming one share it
    starts: tuple[str, ...] = ()  # STACKS it starts, at once, for the measurements that run on them later

    def budget(self, run: Run) -> float:
        return self.cpu_budget_s if run.tiny else self.budget_s


def has_module(name: str, option: str | None = None) -> Callable[[], bool]:
    """The stage's module is in this tree (and its source names `option`, when given)."""

    def present() -> bool:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            return False
        return option is None or option in Path(spec.origin).read_text()

    return present


def has_option(script: str, option: str) -> Callable[[], bool]:
    return lambda: option in (ROOT / script).read_text()


# ---- the stages ------------------------------------------------------------------------------------


def check(name: str, stack: str, requests: int, sampled: int, max_tokens: int, tiny: tuple[int, int, int]):
    """gpu_check.py on one stack (`{ipc}` in the name: cuda_ipc on a GPU, shm on the CPU), the kit's shared one."""

    def argv(run: Run, budget: float) -> list[str]:
        r, s, m = tiny if run.tiny else (requests, sampled, max_tokens)
        sizes = ["--requests", str(r), "--sampled", str(s), "--max-tokens", str(m)]
        where = ["--out", str(run.json(name)), "--log-dir", str(run.work / "logs")]
        return [
            PY,
            "scripts/gpu_check.py",
            "--device",
            run.device,
            "--model",
            run.check_model,
            "--stacks",
            stack.format(ipc=run.ipc),
            *sizes,
            *where,
        ]

    return argv


def bench(system: str, requests: int, concurrency: int, tiny: tuple[int, int]):
    """bench.gpu on one system; `large` is its 1,024-request run alone (on the colocated stack). Its `--budget-s` is
    the stage's budget (BENCH_MARGIN_S less), which the kit enforces; a pdserve system runs on the kit's shared
    stack (`--stack`, added by run_stage)."""

    def argv(run: Run, budget: float) -> list[str]:
        n, c = tiny if run.tiny else (requests, concurrency)
        if system == "large":  # no main run (--requests 0): the large run alone, on colocated
            sizes = ["--systems", "colocated", "--requests", "0", "--large-run", str(n), str(c)]
        else:
            sizes = ["--systems", system, "--requests", str(n), "--concurrency", str(c), "--large-run", "0", "0"]
        where = ["--out-dir", str(run.work / "stages"), "--name", f"bench-{system}", "--no-progress"]
        limits = ["--budget-s", f"{max(budget - BENCH_MARGIN_S, 1.0):.0f}", "--min-system-s", "0"]
        count = [] if system == "colocated" else ["--no-kernel-count"]  # the kernels per step: counted once
        return [*bench_argv(run), *sizes, *limits, *count, *where]

    return argv


def bench_argv(run: Run) -> list[str]:
    return [PY, "-m", "bench.gpu", "--model", run.model, "--device", run.device]


@dataclass(frozen=True)
class BenchStack:
    """A pdserve stack as bench.gpu starts it, shared by the bench stages that name it: `--max-num-seqs` the most
    requests in flight among them (GPU, CPU)."""

    mode: str  # colocated | disagg
    max_num_seqs: tuple[int, int]
    start_s: tuple[float, float]  # its start, launch to ready (GPU, CPU): in the time of the stage that starts it

    def start(self, run: Run) -> float:
        return self.start_s[run.tiny]

    def argv(self, run: Run, port: int) -> list[str]:
        gpu = importlib.import_module("bench.gpu")
        n = self.max_num_seqs[run.tiny]
        cfg = gpu.parse_args([*bench_argv(run)[3:], "--systems", self.mode, "--concurrency", str(n)])
        return gpu.stack_argv(cfg, self.mode, port)


STACKS = {  # the kit's own stacks, beside gpu_check's (named by its plans); GPU starts: estimates (docs/gpu.md)
    "bench-colocated": BenchStack(
        "colocated", (256, 4), (25, 60)
    ),  # bench-colocated (128 in flight), bench-large (256)
    "bench-disagg": BenchStack("disagg", (128, 3), (30, 60)),
}


def checkpoint(run: Run, budget: float) -> list[str]:
    code = f"from pdserve.checkpoint import resolve_model; print(resolve_model({run.model!r}))"
    return [PY, "-c", code]


def kv_shared_copy(run: Run, budget: float) -> list[str]:
    """The decode node's copy out of a shared pool between two processes (cuda_ipc on a GPU, in Qwen3-0.6B's KV
    layout; shm on the CPU), beside a device copy of the same bytes."""
    sizes = ["--tokens", "256"] if run.tiny else ["--tokens", "1024", "--layout", "qwen3-0.6b"]
    out = str(run.work / "stages" / "kv-shared-copy")
    return [PY, "-m", "bench.kv_bandwidth", "--shared-copy", "--device", run.device, *sizes, "--out", out]


def costs(run: Run, budget: float) -> list[str]:
    model = run.check_model
    return [
        PY,
        "-m",
        "bench.costs",
        "--device",
        run.device,
        "--model",
        model,
        *(["--sizes", "tiny"] if run.tiny else ["--sizes", "gpu"]),
        "--out",
        str(run.json("costs")),
    ]


def faults(run: Run, budget: float) -> list[str]:
    """gpu_check.py --faults: on nodes it starts itself (it kills and restarts them), so on no shared stack."""
    where = ["--out", str(run.json("faults")), "--log-dir", str(run.work / "logs")]
    stack = ["--stacks", f"fp32-{run.ipc}"]
    return [PY, "scripts/gpu_check.py", "--device", run.device, "--model", run.check_model, "--faults", *stack, *where]


def attention(run: Run, budget: float) -> list[str]:
    return [PY, "-m", "bench.attention", "--device", run.device, "--json", str(run.json("attention"))]


def startup(run: Run, budget: float) -> list[str]:
    """`pdserve up` (disaggregated, both nodes on the device) from launch to its ready line and first completion,
    timed once, with each process's start stages. Its Triton kernels come from a copy of the cache the kit's
    disaggregated stack compiled (the same model and mode) where that stack ran; else an untimed start compiles
    them first."""
    on = [] if run.tiny else ["--device", run.device, "--dtype", "bfloat16", "--kv-cache-gb", "4"]
    warm = ["--triton-cache-from", str(run.work / "triton-cache" / "bench-disagg")]
    return [
        PY,
        "-m",
        "bench.startup",
        "--model",
        run.model,
        "--runs",
        "1",
        *on,
        *warm,
        "--json",
        str(run.json("startup")),
    ]


def profile(run: Run, budget: float) -> list[str]:
    return [PY, "-m", "bench.profile", "--device", run.device, "--model", run.model, "--out", str(run.json("profile"))]


STAGES: tuple[Stage, ...] = (  # name, GPU budget s, CPU budget s, value, command; the stages of a stack in a row
    # the checks (concurrent=True: at once on a GPU, each on its own stack or process); GPU budgets are estimates
    # (docs/gpu.md, "The budgets"): a gpu_check stack's start is in the budget of the first stage on it
    Stage(
        "smoke",
        40,
        90,
        100,
        check("smoke", "fp32-colocated", 3, 4, 8, (2, 2, 4)),
        stack="fp32-colocated",
        concurrent=True,
    ),
    Stage(
        "check-fp32-colocated",
        20,
        60,
        98,
        check("check-fp32-colocated", "fp32-colocated", 16, 200, 32, (2, 2, 4)),
        stack="fp32-colocated",
        concurrent=True,
    ),
    Stage(
        "check-fp32-ipc",
        45,
        90,
        95,
        check("check-fp32-ipc", "fp32-{ipc}", 16, 64, 32, (4, 12, 6)),
        stack="fp32-{ipc}",
        concurrent=True,
    ),
    Stage("faults", 50, 90, 93, faults, has_option("scripts/gpu_check.py", "--faults")),  # alone: it reads free memory
    Stage(
        "check-bf16-ipc",
        45,
        90,
        90,
        check("check-bf16-ipc", "bf16-{ipc}", 16, 64, 32, (2, 2, 4)),
        stack="bf16-{ipc}",
        concurrent=True,
    ),
    Stage("checkpoint", 30, 60, 88, checkpoint, concurrent=True, lane="models"),
    # the measurements' stacks, started beside the checks once the checkpoint is built (their time: STACKS' start)
    Stage("bench-stacks", 0, 0, 87, None, concurrent=True, lane="models", starts=("bench-colocated", "bench-disagg")),
    # the measurements: one at a time, alone on the GPU
    Stage("bench-colocated", 20, 90, 85, bench("colocated", 256, 128, (3, 3)), stack="bench-colocated"),
    Stage("bench-disagg", 20, 90, 80, bench("disagg", 256, 128, (3, 3)), stack="bench-disagg"),
    Stage("startup", 20, 60, 78, startup, has_module("bench.startup", "start_stages")),
    Stage("profile", 30, 60, 75, profile, has_module("bench.profile")),
    Stage("kv-shared-copy", 15, 60, 65, kv_shared_copy, has_module("bench.kv_bandwidth", "--shared-copy")),
    Stage(
        "check-fp32-zmq",
        45,
        90,
        60,
        check("check-fp32-zmq", "fp32-zmq", 16, 0, 32, (2, 0, 4)),
        stack="fp32-zmq",
        concurrent=True,
    ),
    Stage("bench-hf_cb", 45, 120, 50, bench("hf_cb", 256, 128, (3, 2))),
    Stage("bench-static", 40, 120, 45, bench("static", 64, 32, (3, 2))),
    Stage("attention", 15, 60, 40, attention, has_module("bench.attention")),
    Stage("costs", 30, 60, 35, costs, has_module("bench.costs", "--device")),
    Stage("bench-large", 25, 90, 30, bench("large", 1024, 256, (4, 4)), stack="bench-colocated"),
)


def names() -> list[str]:
    return [s.name for s in STAGES]


# ---- the plan --------------------------------------------------------------------------------------

# the device memory under which the measurement stacks do not start beside the checks (`bench-stacks`): together they
# hold about 72 GiB (an estimate: the measurements' three nodes with 16 GiB of KV each, the checks' seven with 1 GiB,
# and every process's CUDA context, weights and graph pool), which an 80 GB GPU may not hold
BESIDE_CHECKS_MIN_GB = 100.0


def for_memory(stages: tuple[Stage, ...], memory_gb: float | None) -> tuple[tuple[Stage, ...], dict]:
    """(the stages a device of `memory_gb` GiB runs, {stage left out: why}): under BESIDE_CHECKS_MIN_GB no stage
    starts stacks beside the checks (each measurement stack starts with its first stage instead, in its time)."""
    if memory_gb is None or memory_gb >= BESIDE_CHECKS_MIN_GB:
        return stages, {}
    why = f"not in plan (device memory {memory_gb:.0f} GiB: each measurement stack starts with its first stage)"
    return tuple(s for s in stages if not s.starts), {s.name: why for s in stages if s.starts}


def lanes(stages: list[Stage], run: Run) -> list[list[Stage]]:
    """The concurrent stages in lanes, in order of their first stage: the stages naming one lane (`Stage.lane`, else
    their stack) share it and run one after another in it; every other stage is a lane of its own."""
    out: dict[str, list[Stage]] = {}
    for s in stages:
        if s.concurrent:
            out.setdefault(s.lane or (s.stack.format(ipc=run.ipc) if s.stack else f"stage:{s.name}"), []).append(s)
    return list(out.values())


def starters(stages: list[Stage]) -> dict[str, str]:
    """{a STACKS stack the stages use: the stage that starts it}: a stage that `starts` it, else the first stage
    (in the order given, the run's) that runs on it."""
    out: dict[str, str] = {}
    for s in stages:
        for name in s.starts:
            if any(t.stack == name for t in stages):
                out.setdefault(name, s.name)
    for s in stages:
        if s.stack in STACKS:
            out.setdefault(s.stack, s.name)
    return out


def seconds(stage: Stage, run: Run, started_by: dict[str, str]) -> float:
    """The stage's time: its budget, and the start of each STACKS stack it starts (those of a stage that `starts`
    several start at once: the longest; started_by: `starters`)."""
    starts = [STACKS[n].start(run) for n, by in started_by.items() if by == stage.name]
    if stage.starts:
        return max(starts, default=0.0)
    return stage.budget(run) + sum(starts)


def plan_seconds(stages: list[Stage], run: Run, concurrent: bool) -> float:
    """The plan's time: with `concurrent`, its longest lane of concurrent stages (they run at once, before the rest)
    plus the time of the others, which run one at a time; else every stage's time added up."""
    by = starters(stages)
    if not concurrent:
        return sum(seconds(s, run, by) for s in stages)
    phase = max((sum(seconds(s, run, by) for s in lane) for lane in lanes(stages, run)), default=0.0)
    return phase + sum(seconds(s, run, by) for s in stages if not s.concurrent)


def plan(
    stages: tuple[Stage, ...], run: Run, window: float, names: list[str] | None, concurrent: bool = False
) -> tuple[list, dict]:
    """(the stages to run, in order of value; {stage name: why it is not run}). Raises ValueError, in one line,
    when the stages named do not exist or the plan's time (`plan_seconds`) does not fit the window. A stage that
    only `starts` stacks is in a plan with a stage that runs on one of them."""
    by_value = sorted(stages, key=lambda s: -s.value)
    absent = {s.name: "not present in this tree" for s in by_value if not s.present()}
    if names is not None:
        unknown = sorted(set(names) - {s.name for s in stages})
        if unknown:
            raise ValueError(f"no such stage: {', '.join(unknown)} (stages: {', '.join(s.name for s in stages)})")
        chosen = [s for s in by_value if s.name in names and s.name not in absent]
        total = plan_seconds(chosen, run, concurrent)
        if total > window:
            raise ValueError(f"plan refused: its budgets add up to {total:.0f} s, past the {window:.0f} s window")
        left = {s.name: "not in plan (not named)" for s in by_value if s.name not in names and s.name not in absent}
        return unused_starters(chosen, absent | left)
    chosen, left = [], {}
    for s in by_value:
        if s.name in absent:
            continue
        if plan_seconds([*chosen, s], run, concurrent) <= window:
            chosen.append(s)
        else:
            left[s.name] = "not in plan (window)"
    return unused_starters(chosen, absent | left)


def unused_starters(chosen: list[Stage], left: dict) -> tuple[list, dict]:
    """The plan less each stage that would only start stacks no stage of it runs on."""
    by = starters(chosen)
    idle = {s.name for s in chosen if s.starts and s.name not in by.values()}
    return [s for s in chosen if s.name not in idle], left | {
        n: "not in plan (no stage runs on its stacks)" for n in idle
    }


# ---- the shared stacks ----------------------------------------------------------------------------


@dataclass
class Shared:
    """A stack the kit started: what its stages are given, and what its stop is judged by."""

    name: str
    stack: object  # bench.systems.Stack
    url: str
    triton_cache: Path

    def args(self) -> list[str]:
        """The stage's arguments: bench.gpu's `--stack`, gpu_check's `--url`."""
        if self.name in STACKS:
            pid = str(self.stack.proc.pid)
            return ["--stack", STACKS[self.name].mode, self.url, pid, str(self.triton_cache)]
        return ["--url", self.url]


class Stacks:
    """The stacks the stages share: each starts before the first stage that runs on it (within that stage's time),
    or in a stage that `starts` it (a start that outlasts that time goes on for the next stage on it), and stops
    once the last stage that may run on it is done; its stop is judged as gpu_check's (e) judges its own (`stops`),
    but for the device's free memory, which other stacks move: the kit judges that once, over its whole run
    (`device_memory`)."""

    def __init__(self, run: Run, stages: list[Stage]) -> None:
        self.run, self.open = run, {}
        self.users = Counter(s.stack.format(ipc=run.ipc) for s in stages if s.stack)  # stages yet to finish on each
        self.stops: dict[str, dict] = {}  # each stopped stack: its clean stop
        self.lock = threading.Lock()
        self.starting: dict[str, Shared] = {}  # the stacks being started, not yet ready

    def gpu_check(self):
        with self.lock:  # (lanes' threads may ask at once: it is loaded once)
            return gpu_check_module()

    def get(self, name: str, timeout: float) -> Shared:
        if name not in self.open:  # a stack is started by one thread: its lane's, or its starting stage's
            self.start(name, timeout)
        return self.open[name]

    def start(self, name: str, timeout: float) -> Shared:
        """Starts the stack, or goes on waiting for a start an earlier stage's time ran out on: a stack not ready
        within `timeout` (TimeoutError) goes on starting for the next stage on it (stopped by `done` if none is
        left); one whose launcher exits is stopped, and its error raised."""
        with self.lock:
            shared = self.starting.get(name)
        if shared is None:
            gc, run = self.gpu_check(), self.run
            port = gc.free_port()
            log_dir, cache = run.work / "logs", run.work / "triton-cache" / name
            with self.lock, importlib.import_module("bench.gpu").triton_cache(cache):  # it compiles into its folder
                if STOPPING.is_set():  # the kit stops: no stack starts after close() looked
                    raise RuntimeError("the kit is stopping")
                stack = gc.Stack(self.argv(gc, name, port), log_dir / f"kit.{name}.log")  # (the folder: os.environ)
                shared = self.starting[name] = Shared(name, stack, f"http://127.0.0.1:{port}", cache)
        try:
            shared.stack.wait_ready(timeout)
        except BaseException as e:
            if isinstance(e, Exception) and shared.stack.proc.poll() is None and not STOPPING.is_set():
                raise TimeoutError(f"not ready within {timeout:.0f} s; it goes on starting for the next stage") from e
            self.abandon(name)
            raise
        with self.lock:  # ready: open, unless the kit began stopping meanwhile (close() stops the open ones)
            stopping = self.starting.pop(name, None) is None or STOPPING.is_set()
            if not stopping:
                self.open[name] = shared
        if stopping:
            shared.stack.stop()
            raise RuntimeError("the kit is stopping")
        return shared

    def abandon(self, name: str) -> None:
        """Stops a stack that is starting (not yet ready), if it is."""
        with self.lock:
            shared = self.starting.pop(name, None)
        if shared is not None:
            shared.stack.stop()

    def start_all(self, names: list[str], timeout: float) -> dict[str, Exception]:
        """Starts the stacks at once, a thread each; {name: why it did not start} for those that did not."""
        errors: dict[str, Exception] = {}

        def one(name: str) -> None:
            try:
                self.get(name, timeout)
            except Exception as e:
                errors[name] = e

        threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    def argv(self, gc, name: str, port: int) -> list[str]:
        run = self.run
        if name in STACKS:
            return STACKS[name].argv(run, port)
        a = gc.build_parser().parse_args(["--device", run.device, "--model", run.check_model])
        a.kv_cache_gb = 0.25 if run.tiny else 1.0
        plan = next(p for p in gc.plans(run.device) if p.name == name)
        return gc.stack_argv(a, plan, port)

    def done(self, stage: Stage) -> None:
        """`stage` finished, or will not run: its stack stops if no other stage may run on it."""
        if not stage.stack:
            return
        name = stage.stack.format(ipc=self.run.ipc)
        with self.lock:
            self.users[name] -= 1
            last = self.users[name] <= 0
            shared = self.open.pop(name, None) if last else None
        if last:
            self.abandon(name)  # a start no stage waited out
        if shared is not None:
            judged = self.stop(shared)
            with self.lock:
                self.stops[name] = judged

    def stop(self, shared: Shared) -> dict:
        """Stops the stack; gpu_check's (e) on it: its pools released, its log free of the stop warnings, and every
        process of the stack gone."""
        gc, stack = self.gpu_check(), shared.stack
        pids = gc.descendants(stack.proc.pid)
        segments = gc.mapped_segments(pids)
        stack.stop()
        judged = gc.check_clean_stop(stack.log_path, segments, self.run.device, None)
        judged["processes_left"] = [p for p in pids if alive(p)]
        judged["pass"] = judged["pass"] and not judged["processes_left"]
        return judged

    def close(self) -> None:
        with self.lock:
            starting = list(self.starting)
        for name in starting:  # the kit stops while a lane starts one: it stops, and that lane's start fails
            self.abandon(name)
        with self.lock:
            left = [self.open.pop(name) for name in list(self.open)]
        for shared in left:
            self.stops[shared.name] = self.stop(shared)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@functools.cache
def gpu_check_module():
    """scripts/gpu_check.py, loaded once (it imports torch): its stacks, checks and device memory figures."""
    return load_script(ROOT / "scripts" / "gpu_check.py")


def load_script(path: Path):
    """A script beside this one as a module (its dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---- running a stage -------------------------------------------------------------------------------


def run_stage(stage: Stage, run: Run, env: dict, stacks: Stacks, t0: float, budget: float, alone: bool = True) -> dict:
    """Runs one stage under `budget` seconds (`seconds`: its stack's start included, where it starts one): its
    command in its own process group, or (`Stage.starts`) the start of its stacks that a stage will run on.
    `start_s` and `end_s` count from the kit's start `t0`."""
    start = time.monotonic()
    r = {"name": stage.name, "value": stage.value, "budget_s": budget, "concurrent": not alone}
    r["start_s"] = round(start - t0, 2)
    if stage.starts:
        names = [n for n in stage.starts if stacks.users[n] > 0]
        errors = stacks.start_all(names, budget)
        r |= ended(start, t0) | {"status": status_of(errors.values())}
        r["started"] = [n for n in names if n not in errors]
        if errors:
            r["error"] = "; ".join(f"stack {n}: {type(e).__name__}: {e}" for n, e in errors.items())
        return r
    shared = []
    if stage.stack and STOPPING.is_set():  # no stack starts once the kit stops
        return r | ended(start, t0) | {"status": "not run (the kit stopped)"}
    if stage.stack:
        name = stage.stack.format(ipc=run.ipc)
        r["stack_started"] = name not in stacks.open  # else the stack an earlier stage started serves this one too
        try:
            shared = stacks.get(name, budget).args()
        except Exception as e:  # a stack that does not start fails the stage; the next stage still runs
            return r | ended(start, t0) | {"status": status_of([e]), "error": f"stack {name}: {e}"}
        r["stack"] = name
    left = budget - (time.monotonic() - start)  # the command's budget: the stage's, less its stack's start
    argv = stage.argv(run, left) + shared
    rc, status = command(argv, env, run.work / "logs" / f"{stage.name}.out", left)
    r |= ended(start, t0) | {"status": status, "exit_code": rc}
    return r | {"command": " ".join(argv[1:]), "summary": summary(run, stage.name)}


def status_of(errors) -> str:
    """A stage's status from its stacks' start errors: "over budget" where each start only ran out of time."""
    errors = list(errors)
    if not errors:
        return "passed"
    return "over budget" if all(isinstance(e, TimeoutError) for e in errors) else "failed"


def ended(start: float, t0: float) -> dict:
    now = time.monotonic()
    return {"seconds": round(now - start, 1), "end_s": round(now - t0, 2)}


def command(argv: list[str], env: dict, log: Path, budget: float) -> tuple[int | None, str]:
    """(exit code, status) of one command in its own process group, stopped at `budget` seconds."""
    if STOPPING.is_set():  # the kit is stopping: a lane's next stage does not start
        return None, "not run (the kit stopped)"
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        RUNNING.add(proc)
        try:
            rc = proc.wait(timeout=max(budget, 0.1))
        except subprocess.TimeoutExpired:
            stop(proc)
            return None, "over budget"
        except BaseException:  # the kit itself is stopped: so is its stage
            stop(proc)
            raise
        finally:
            RUNNING.discard(proc)
    if rc != 0 and STOPPING.is_set():
        return rc, "stopped (the kit stopped)"
    return rc, "passed" if rc == 0 else "failed"


RUNNING: set[subprocess.Popen] = set()  # the stages' commands running now (in the concurrent phase, several)
STOPPING = threading.Event()


def stop_all() -> None:
    """The kit ends: every stage command still running stops with it, those of other threads too, and no lane
    starts another."""
    STOPPING.set()
    for proc in list(RUNNING):
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def summary(run: Run, name: str) -> dict:
    """The scalar fields of the stage's JSON (stages/<name>.json), if it wrote one."""
    path = run.json(name)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {"unreadable": path.name}
    return {k: v for k, v in data.items() if isinstance(v, str | int | float | bool)}


# ---- the report ------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [
        f"# GPU kit: {report['device']}, window {report['window_s']:.0f} s, {report['total_s']:.0f} s in all",
        "",
        "| stage | value | budget s | seconds | result | started at s | beside the other checks | in the plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["stages"]:
        secs = f"{r['seconds']:.1f}" if "seconds" in r else ""
        at = f"{r['start_s']:.1f}" if "start_s" in r else ""
        beside = {True: "yes", False: "no"}.get(r.get("concurrent"), "")
        planned = ("no: run in the time left" if r.get("filled") else "yes") if at else ""
        cells = [r["name"], r["value"], f"{r['budget_s']:.0f}", secs, r["status"], at, beside, planned]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines + stop_lines(report) + memory_lines(report)) + "\n"


def memory_lines(report: dict) -> list[str]:
    """On a GPU, the device's memory over the whole run (`device_memory`), which alone can fail a kit whose stages
    and stops all passed."""
    m = report.get("device_memory")
    if not m:
        return []
    verdict = "passed" if m["pass"] else f"failed: more than {m['slack_mb']:.0f} MiB short"
    return [
        "",
        f"Device memory no other process holds: {m['device_free_mb_before']:.0f} MiB before the first stack started, "
        f"{m['device_free_mb_after']:.0f} MiB after the last stopped: {verdict}.",
    ]


def stop_lines(report: dict) -> list[str]:
    """Each shared stack's stop, judged as gpu_check's (e) judges its own."""
    stops = report.get("stacks") or {}
    if not stops:
        return []
    lines = ["", "| shared stack | stages | clean stop | segments left | processes left | warnings |"]
    lines.append("|---|---|---|---|---|---|")
    for name, j in stops.items():
        stages = ", ".join(r["name"] for r in report["stages"] if r.get("stack") == name)
        warnings = ", ".join(f"{w} ({n})" for w, n in j["warnings"].items())
        verdict = "passed" if j["pass"] else "failed"
        lines.append(
            f"| {name} | {stages} | {verdict} | {len(j['segments_left'])} | {len(j['processes_left'])} | {warnings} |"
        )
    return lines


def plan_text(chosen: list[Stage], left: dict, run: Run, window: float, concurrent: bool) -> str:
    """The plan as `--plan-only` prints it: each planned stage's time and where it runs, then the stages left out."""
    by = starters(chosen)
    lane_of = {s.name: i + 1 for i, lane in enumerate(lanes(chosen, run)) for s in lane} if concurrent else {}
    total = plan_seconds(chosen, run, concurrent)
    lines = [f"kit plan on {run.device}: {len(chosen)} stages, {total:.0f} s of a {window:.0f} s window", ""]
    lines += ["| stage | value | time s | runs |", "|---|---|---|---|"]
    for s in chosen:
        where = f"with the checks, lane {lane_of[s.name]}" if s.name in lane_of else "alone, in order of value"
        starts = [n for n, b in by.items() if b == s.name]
        where += f"; starts {', '.join(starts)}" if starts else ""
        lines.append(f"| {s.name} | {s.value} | {seconds(s, run, by):.0f} | {where} |")
    for name, why in left.items():
        stage = next(t for t in STAGES if t.name == name)
        then = ": runs after the plan if its time fits what is left" if why == "not in plan (window)" else ""
        lines.append(f"| {name} | {stage.value} | {seconds(stage, run, {}):.0f} | {why}{then} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu: CPU mode (tiny sizes, shm for cuda_ipc)")
    p.add_argument("--window", type=float, default=None, help=f"seconds; default {GPU_WINDOW_S:.0f} on a GPU")
    p.add_argument("--stages", nargs="+", default=None, help="run these stages (default: what fits, by value)")
    p.add_argument(
        "--concurrent",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the checks (Stage.concurrent) at once, before the measurements (default: on a GPU, not on the CPU)",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the plan (each stage's time, where it runs, what is left out and why), run nothing; needs no GPU",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help=f"plan for a GPU of this much memory (default: the device's; with --plan-only, {BESIDE_CHECKS_MIN_GB:.0f}"
        f" or more): under {BESIDE_CHECKS_MIN_GB:.0f} GiB the measurement stacks start after the checks, not beside",
    )
    p.add_argument("--out", type=Path, default=Path("kit-out"), help="kit.md and kit.json go here")
    p.add_argument("--work", type=Path, default=Path("kit-work"), help="each stage's log and JSON go here")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    unwind_once(signal.SIGTERM, exit_code=True)  # unwinds: the running stages and the stacks stop
    run = Run(a.device, not a.device.startswith("cuda"), a.work.resolve())
    window = a.window or (CPU_WINDOW_S if run.tiny else GPU_WINDOW_S)
    concurrent = not run.tiny if a.concurrent is None else a.concurrent
    memory_gb = a.device_memory_gb
    if memory_gb is None and not (run.tiny or a.plan_only):
        memory_gb = gpu_check_module().device_total_gb(run.device)
    stages, too_big = for_memory(STAGES, memory_gb)
    try:
        chosen, left = plan(stages, run, window, a.stages or (names() if run.tiny else None), concurrent)
    except ValueError as e:
        print(f"kit: {e}")
        return 2
    left |= too_big
    print(plan_text(chosen, left, run, window, concurrent), flush=True)
    if a.plan_only:
        return 0
    for d in (a.out, run.work / "logs", run.work / "stages"):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    if run.tiny:  # the Triton kernels of the attention stage and of bench.gpu's kernel count: by Triton's interpreter
        env.setdefault("TRITON_INTERPRET", "1")
    planned_s = plan_seconds(chosen, run, concurrent)
    report = {"device": a.device, "window_s": window, "planned_s": planned_s, "concurrent": concurrent, "stages": []}
    STOPPING.clear()
    spare = [s for s in sorted(STAGES, key=lambda s: -s.value) if left.get(s.name) == "not in plan (window)"]
    kit = Kit(run, env, Stacks(run, chosen + spare), report, a.out, left, starters(chosen), window)
    report["stacks"] = kit.stacks.stops  # filled as each shared stack stops
    gc = None if run.tiny else kit.stacks.gpu_check()
    free_before = gc.free_device_mb(run.device) if gc else None
    try:
        if concurrent:
            kit.phase(lanes(chosen, run))
        for stage in [s for s in chosen if not (concurrent and s.concurrent)]:
            kit.lane([stage], alone=True)
        kit.fill(spare)
    finally:
        stop_all()
        kit.stacks.close()
        write(report, a.out, kit.t0, stage_list(report["stages"], kit.left, run))  # a stopped kit's too: its stops
    if gc:  # the driver frees a stopped process's memory shortly after it exits
        gc.wait_until(lambda: free_before - gc.free_device_mb(run.device) <= gc.RELEASE_SLACK_MB)
        free_after = gc.free_device_mb(run.device)
        moved = free_before - free_after
        report["device_memory"] = {
            "device_free_mb_before": free_before,
            "device_free_mb_after": free_after,
            "slack_mb": gc.RELEASE_SLACK_MB,
            "pass": moved <= gc.RELEASE_SLACK_MB,
        }
    report = write(report, a.out, kit.t0, stage_list(report["stages"], kit.left, run))
    ran = {r["name"] for r in report["stages"] if "start_s" in r}
    passed = all(r["status"] == "passed" for r in report["stages"] if r["name"] in ran)
    memory = report.get("device_memory", {}).get("pass", True)
    return 0 if passed and memory and all(j["pass"] for j in kit.stacks.stops.values()) else 1


@dataclass
class Kit:
    """The planned stages' run: lanes of stages, one after another or (the checks) at once, into one report; then
    the stages the window left out, each that fits the time left."""

    run: Run
    env: dict
    stacks: Stacks
    report: dict
    out: Path
    left: dict
    started_by: dict[str, str]  # the plan's `starters`
    window: float = GPU_WINDOW_S
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lane(self, stages: list[Stage], alone: bool, filled: bool = False) -> None:
        """The stages in order, each under its own time; a stack of theirs stops after the last stage on it."""
        for stage in stages:
            budget = seconds(stage, self.run, self.started_by)
            r = run_stage(stage, self.run, self.env, self.stacks, self.t0, budget, alone)
            self.stacks.done(stage)
            with self.lock:
                self.report["stages"].append(r | ({"filled": True} if filled else {}))
                print(f"== [{r['end_s']:.0f} s] {r['name']}: {r['status']} in {r['seconds']:.0f} s", flush=True)
                write(self.report, self.out, self.t0, stage_list(self.report["stages"], self.left, self.run))

    def fill(self, spare: list[Stage]) -> None:
        """The stages the window left out of the plan, in order of value, alone: each runs if its time (its stack's
        start included, unless the stack is still up) fits what is left of the window; the budgets are upper
        bounds, so the planned stages often leave time."""
        for stage in spare:
            if STOPPING.is_set():
                return
            stack = stage.stack.format(ipc=self.run.ipc) if stage.stack else None
            self.started_by = {stack: stage.name} if stack in STACKS and stack not in self.stacks.open else {}
            if seconds(stage, self.run, self.started_by) <= self.window - (time.monotonic() - self.t0):
                self.left.pop(stage.name)
                self.lane([stage], alone=True, filled=True)
            else:
                self.stacks.done(stage)  # it will not run: its stack may stop

    def phase(self, lanes: list[list[Stage]]) -> None:
        """The lanes at once, a thread each; returns when every one is done."""
        errors: list[BaseException] = []

        def lane(stages: list[Stage]) -> None:
            try:
                self.lane(stages, alone=False)
            except BaseException as e:  # raised again in the kit's own thread, once every lane is done
                errors.append(e)

        threads = [threading.Thread(target=lane, args=(stages,), daemon=True) for stages in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


def stage_list(ran: list[dict], left: dict, run: Run) -> list[dict]:
    """Every stage: those run, in their order, then the rest with why they did not run."""
    by_name = {s.name: s for s in STAGES}
    rest = [
        {"name": n, "value": by_name[n].value, "budget_s": by_name[n].budget(run), "status": w} for n, w in left.items()
    ]
    return ran + rest


def write(report: dict, out: Path, t0: float, stages: list[dict]) -> dict:
    full = {**report, "stages": stages, "total_s": time.monotonic() - t0}
    (out / "kit.json").write_text(json.dumps(full, indent=2))
    (out / "kit.md").write_text(markdown(full))
    return full


if __name__ == "__main__":
    sys.exit(main())
