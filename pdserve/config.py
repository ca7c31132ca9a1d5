"""One frozen config per process. Validation raises ValueError with a message a user can act on.

A field made with `option(...)` is also a command-line flag: its default and help text live here and
nowhere else (pdserve/flags.py builds every verb's parser from these fields).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.checkpoint import BUILTIN_MODELS
from pdserve.wire.params import NODE_ROLES, KvTransport, Role

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
CPU_KERNELS = ("auto", "on", "off")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
KV_TRANSPORTS = tuple(KvTransport)
ROLES = NODE_ROLES
KV_ROLES = (Role.PREFILL, Role.DECODE)  # the roles that move KV between nodes
KV_FAILURE_POLICIES = ("recompute", "fail")
KV_FAULT_KINDS = ("drop", "delay", "truncate", "corrupt")
LAUNCH_MODES = ("disagg", "colocated")
PLACEMENTS = ("pack", "spread")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PLAN_WORKLOADS = ("chat", "long-prompt", "long-answer")  # pdserve plan's (pdserve/plan/plan.py)
ENGINES = ("model", "mock")  # model: run the checkpoint; mock: no model (engine/mock.py)
MOCK_STEP_S = (0.003, 1e-5, 2e-5, 0.0)  # a mock step's seconds: a + b*tokens + c*requests (+ d*attended context)
MOCK_KV_MODES = ("full", "header")  # mock KV transfers: the real bytes, or the headers only


def option(default: Any, help: str, *, flag: str = "", env: str = "", repr: bool = True, **argparse_options) -> Any:
    """A config field that is also a flag. `flag` names it when `--field-name` does not; `env` names an environment
    variable whose value, when set, is the parser's default; `argparse_options` (type, choices, action, nargs,
    metavar, const) go to add_argument as they are."""
    meta = {"help": help, "flag": flag, "env": env, "argparse": argparse_options}
    return field(default=default, repr=repr, metadata=meta)


def comma_list(text: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'); the flag form of a tuple field."""
    return tuple(x for x in text.split(",") if x)


def comma_floats(text: str) -> tuple[float, ...]:
    """'0.003,1e-5' -> (0.003, 1e-05); the flag form of a tuple of numbers."""
    return tuple(float(x) for x in comma_list(text))


def _model() -> Any:
    return option(
        "tiny", f"checkpoint folder (config.json, weights, tokenizer files), or a built-in: {', '.join(BUILTIN_MODELS)}"
    )


def _drain_timeout_s() -> Any:
    return option(30.0, "on SIGTERM: how long requests in flight may take to finish before they fail", type=float)


def _zmq_keys() -> Any:
    return option("", "CurveZMQ key folder (make it with `pdserve keys DIR`); none: plain sockets")


def _deployment_name() -> Any:
    return option("pdserve", "the deployment's name on the Ray cluster (`pdserve up --ray --name`)")


def parse_cores(spec: str) -> tuple[int, ...]:
    """'0', '0-3' or '0,2,5' -> a tuple of core ids ('' -> no pinning)."""
    cores: list[int] = []
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        try:
            cores.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"cannot read CPU core list {spec!r}: use '0', '0-3' or '0,2'") from None
    return tuple(cores)


def max_model_len(config) -> int:
    """The longest sequence the model attends over exactly (a sliding window caps it)."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)
    return limit


def eos_token_ids(config) -> tuple[int, ...]:
    """The model's EOS ids, as its config lists them (one id, a list, or none)."""
    eos = getattr(config, "eos_token_id", None)
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized")


def check_key_dir(path: str) -> None:
    """A --zmq-keys folder must hold what `pdserve keys` writes."""
    if not path:
        return
    missing = [f for f in KEY_FILES if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise ValueError(f"--zmq-keys {path!r} lacks {', '.join(missing)}; make the folder with `pdserve keys DIR`")


DEVICE = re.compile(r"cpu|cuda(:\d+)?")  # what --device and the per-role devices may name


MOCK_COSTS_KEYS = (
    "prefill_base_s",
    "prefill_per_token_s",
    "prefill_per_token_ctx_s",
    "decode_base_s",
    "decode_per_seq_s",
    "decode_per_ctx_token_s",
)


def read_mock_costs(path: str) -> dict[str, float]:
    """The step costs of a bench.costs JSON file (its "costs": every MOCK_COSTS_KEYS number, none negative);
    ValueError: one line that says what is wrong with the file."""
    if not os.path.isfile(path):
        raise ValueError(f"--mock-costs {path!r} is not a file (write one with python -m bench.costs)")
    try:
        with open(path, encoding="utf-8") as f:
            costs = json.load(f)["costs"]
        values = {k: float(costs[k]) for k in MOCK_COSTS_KEYS}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--mock-costs {path!r} is not a bench.costs JSON file: {e!r}") from None
    if not all(v >= 0 for v in values.values()):
        raise ValueError(f"--mock-costs {path!r} has a negative or NaN cost")
    return values


@dataclass(frozen=True)
class EngineConfig:
    model: str = _model()
    dtype: str = option("float32", "dtype of the weights and activations", choices=DTYPE_CHOICES)
    device: str = option("cpu", "cpu or cuda:N")
    max_num_seqs: int = option(16, "the most requests one engine step runs", type=int)
    max_num_batched_tokens: int = option(512, "tokens one engine step runs (prompt chunks and decode tokens)", type=int)
    block_size: int = option(16, "tokens per KV block", type=int)
    num_kv_blocks: int | None = option(
        None, "KV blocks in the pool (default: as many as --kv-cache-gb holds)", type=int
    )
    kv_cache_gb: float = option(0.25, "memory of the KV pool in GiB", type=float)
    cpu_cores: tuple[int, ...] = option(
        (),
        "pin the process to these cores, e.g. 0, 0-3 or 0,2 (default: no pinning)",
        type=parse_cores,
        metavar="CORES",
    )
    cpu_kernels: str = option(
        "auto",
        "pdserve's C kernels (paged decode attention, fused norms, silu*mul; CPU, "
        "float32): on, off (torch's ops), auto (on where they apply and build)",
        choices=CPU_KERNELS,
    )
    attention_backend: str = option(
        "auto",
        "auto: Triton kernels on CUDA, pdserve's C kernels on the CPU; triton: paged kernels; torch: SDPA per request",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = option(
        False, "no CUDA graphs: every step runs eagerly (docs/gpu-step.md)", action="store_true"
    )
    async_scheduling: bool | None = option(
        None,
        "schedule and pack step N+1 while step N runs, its input tokens read on the device "
        "(docs/async-scheduling.md; model engines, not prefill nodes); default: on for a cuda device, off on the cpu",
        action=argparse.BooleanOptionalAction,
    )
    prefix_caching: bool = option(
        True,
        "recompute every prompt from its first token: share no cached prefix KV (docs/prefix-caching.md)",
        flag="--no-prefix-caching",
        action="store_false",
    )
    engine: str = option(
        "model",
        "mock: no model and no torch; the real scheduler, KV accounting and protocol, a "
        "modelled step time and made-up tokens (router tests and benchmarks)",
        choices=ENGINES,
    )
    mock_step_s: tuple[float, ...] = option(
        MOCK_STEP_S,
        "mock: a step takes A + B*tokens + C*requests (+ D*attended context) seconds; give A,B,C[,D]",
        type=comma_floats,
        metavar="A,B,C[,D]",
    )
    mock_costs: str = option(
        "",
        "mock: the step time of a bench.costs JSON file (its prefill or decode costs, by "
        "the node's role) instead of --mock-step-s",
    )
    mock_kv: str = option(
        "full", "mock: KV transfers carry the real number of bytes (full) or their headers only", choices=MOCK_KV_MODES
    )

    def __post_init__(self) -> None:
        self._check_mock()
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {self.dtype!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"--cpu-kernels must be one of {', '.join(CPU_KERNELS)}")
        if self.cpu_kernels == "on" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("--cpu-kernels on needs --device cpu and --dtype float32; use auto or off")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.cpu_kernels == "on" and self.attention_backend != "auto":
            raise ValueError("--cpu-kernels on uses pdserve's CPU attention; leave --attention-backend at auto")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"--device must be 'cpu' or 'cuda:N', not {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be at least 1")
        if self.kv_cache_gb <= 0:
            raise ValueError("--kv-cache-gb must be positive")
        if self.cpu_cores and os.cpu_count() and max(self.cpu_cores) >= os.cpu_count():
            raise ValueError(f"--cpu-cores {self.cpu_cores} names a core this machine lacks ({os.cpu_count()} cores)")

    @property
    def schedules_ahead(self) -> bool:
        """--async-scheduling as given, else by device: on a GPU the host's step overlaps the device's; on the CPU a
        launch computes its step before it returns, so there is nothing to overlap (docs/async-scheduling.md)."""
        return self.device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling

    def _check_mock(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if len(self.mock_step_s) not in (3, 4) or not all(x >= 0 for x in self.mock_step_s):
            raise ValueError(
                "--mock-step-s takes 3 or 4 non-negative numbers: A,B,C[,D] (seconds a step, per token, "
                "per request[, per attended context token])"
            )
        if self.mock_kv not in MOCK_KV_MODES:
            raise ValueError(f"--mock-kv must be one of {', '.join(MOCK_KV_MODES)}")
        if self.mock_costs:
            read_mock_costs(self.mock_costs)

    def num_blocks_for(self, bytes_per_token: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_gb * 2**30) // (bytes_per_token * self.block_size))


@dataclass(frozen=True)
class NodeConfig:
    """A colocated, prefill or decode node: where it listens and how it moves KV."""

    role: Role
    engine: EngineConfig
    listen: str = option("tcp://127.0.0.1:0", "router-facing address")
    kv_listen: str = option("tcp://127.0.0.1:0", "decode node: where prefill nodes ship KV")
    kv_transport: KvTransport = option(
        KvTransport.ZMQ, "how KV moves from prefill to decode nodes", type=KvTransport, choices=KV_TRANSPORTS
    )
    kv_lease_s: float = option(
        30.0,
        "how long a prefill node holds the KV of a prompt it offered until a decode node has it (renewed while the "
        "decode node waits for room); a decode node gives up on a pulled prompt's KV after half of it",
        type=float,
    )
    ready_file: str = option("", "once serving, write the node's bound addresses (JSON) to this file")
    host_id: str = option("", "nodes with the same host id may share memory (default: hostname and boot id)")
    drain_timeout_s: float = _drain_timeout_s()
    zmq_keys: str = _zmq_keys()
    kv_failure: str = option(
        "recompute",
        "decode node, a prompt's KV lost or damaged on the way: recompute it there, or fail it",
        choices=KV_FAILURE_POLICIES,
    )
    kv_fault_rate: float = option(
        0.0, "prefill node, for tests and drills: damage this share of KV transfers on purpose", type=float
    )
    kv_fault_kinds: tuple[str, ...] = option(
        KV_FAULT_KINDS,
        f"comma-separated, one picked at random each time: {', '.join(KV_FAULT_KINDS)} (with --kv-fault-rate)",
        type=comma_list,
    )
    stats_interval_s: float = option(
        0.5,
        "seconds between a node's stats to its routers (its load, KV use and counters; its heartbeat too)",
        type=float,
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}")
        on_gpu = self.engine.device.startswith("cuda")
        if self.role in KV_ROLES and self.kv_transport == KvTransport.CUDA_IPC and not on_gpu:
            raise ValueError(
                f"--kv-transport cuda_ipc moves KV between GPUs: this {self.role} node needs "
                f"--device cuda:N, not {self.engine.device!r}"
            )
        if self.kv_lease_s <= 0:
            raise ValueError("--kv-lease-s must be positive")
        if self.drain_timeout_s <= 0:
            raise ValueError("--drain-timeout-s must be positive")
        if self.stats_interval_s <= 0:
            raise ValueError("--stats-interval-s must be positive")
        self._check_kv_faults()
        check_key_dir(self.zmq_keys)
        for addr in (self.listen, self.kv_listen):
            if not addr.startswith(("tcp://", "ipc://")):
                raise ValueError(f"address {addr!r} must start with tcp:// or ipc://")

    def _check_kv_faults(self) -> None:
        if self.kv_failure not in KV_FAILURE_POLICIES:
            raise ValueError(f"--kv-failure must be one of {', '.join(KV_FAILURE_POLICIES)}")
        if not 0 <= self.kv_fault_rate <= 1:
            raise ValueError("--kv-fault-rate must be in [0, 1]")
        if not self.kv_fault_kinds or set(self.kv_fault_kinds) - set(KV_FAULT_KINDS):
            raise ValueError(f"--kv-fault-kinds takes a comma-separated list of {', '.join(KV_FAULT_KINDS)}")


@dataclass(frozen=True)
class RouterConfig:
    model: str = _model()
    host: str = option("127.0.0.1", "address the HTTP API listens on")
    port: int = option(8000, "port the HTTP API listens on", type=int)
    colocated: tuple[str, ...] = option((), "colocated nodes' addresses", nargs="*", metavar="ADDR")
    prefill: tuple[str, ...] = option((), "prefill nodes' addresses", nargs="*", metavar="ADDR")
    decode: tuple[str, ...] = option((), "decode nodes' router-facing addresses", nargs="*", metavar="ADDR")
    decode_kv: tuple[str, ...] = option(
        (), "decode nodes' KV addresses, in --decode's order", nargs="*", metavar="ADDR"
    )
    skip_tokenizer: bool = option(
        False,
        "serve a checkpoint without tokenizer files: prompts as token ids only, "
        "answers as token ids (return_token_ids), text fields empty",
        action="store_true",
    )
    served_model_name: str = option("", "the model id the API lists and answers to (default: --model)")
    node_timeout_s: float = option(10.0, "a node silent this long is taken as down", type=float)
    connect_timeout_s: float = option(
        120.0, "at start, how long to wait for every node to answer once, then exit with an error", type=float
    )
    api_key: str = option(
        "",
        "every route but /health needs 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)",
        env="PDSERVE_API_KEY",
        repr=False,
    )
    max_n: int = option(16, "the most choices (n) one request may ask for", type=int)
    ray_address: str = option("", "learn the nodes from this Ray cluster's deployment", flag="--ray", metavar="ADDRESS")
    ray_deployment: str = _deployment_name()
    membership_interval_s: float = 1.0  # how often the Ray deployment's node list is read
    max_request_bytes: int = option(4 * 2**20, "larger bodies get 413", type=int)
    max_queued_requests: int = option(
        1024, "requests waiting for a first token; beyond, 429 with Retry-After", type=int
    )
    queue_timeout_s: float = option(300.0, "a request without a first token after this long gets 503", type=float)
    drain_timeout_s: float = _drain_timeout_s()
    zmq_keys: str = _zmq_keys()
    access_log: bool = option(
        True,
        "log no line per request (without it: a line each, with method, path, status, tokens, duration)",
        flag="--no-access-log",
        action="store_false",
    )
    instance_id: str = option("", "an id /health reports, by which a launcher knows it reached the router it started")
    router_workers: int = option(
        1, "router processes sharing the HTTP port (SO_REUSEPORT), each connected to every node", type=int
    )
    cache_balance_margin: int = option(
        4,
        "route to the node holding the longest cached prefix of the prompt unless "
        "it holds more than this many requests above the least loaded node; -1: "
        "least loaded only",
        type=int,
    )
    local_prefill_max_tokens: int | None = option(
        None,
        "disaggregated: a decode node whose prefix cache holds all "
        "but at most this many tokens of a prompt (its first block at "
        "least) gets it directly and computes those itself, skipping the "
        "prefill node and the KV transfer; 0: never (default: one chunk, "
        "the decode node's --max-num-batched-tokens)",
        type=int,
        metavar="TOKENS",
    )
    max_prefill_queue: int = option(
        0,
        "disaggregated: when every prefill node holds at least this many of the "
        "router's requests (queued, being computed, or shipping their KV), the decode "
        "node chosen computes a prompt itself, as long as fewer of its own prompts "
        "wait for their first token; 0: never",
        type=int,
        metavar="REQUESTS",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in 0..65535")
        if self.ray_address and (self.colocated or self.prefill or self.decode):
            raise ValueError("with --ray the nodes come from the Ray deployment: give no node addresses")
        if self.membership_interval_s <= 0:
            raise ValueError("--membership-interval-s must be positive")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if self.router_workers < 1:
            raise ValueError("--router-workers must be at least 1")
        for name in ("queue_timeout_s", "drain_timeout_s", "node_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        check_key_dir(self.zmq_keys)
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("give either colocated nodes or prefill + decode nodes, not both")
        if not self.ray_address and not self.colocated and not (self.prefill and self.decode):
            raise ValueError("the router needs --colocated nodes, or both --prefill and --decode nodes")
        if len(self.decode) != len(self.decode_kv):
            raise ValueError("give one --decode-kv address per --decode node")
        if self.max_n < 1:
            raise ValueError("--max-n must be at least 1")
        if self.cache_balance_margin < -1:
            raise ValueError("--cache-balance-margin must be -1 (off) or a number of requests >= 0")
        if self.local_prefill_max_tokens is not None and self.local_prefill_max_tokens < 0:
            raise ValueError("--local-prefill-max-tokens must be 0 (off) or a number of tokens >= 1")
        if self.max_prefill_queue < 0:
            raise ValueError("--max-prefill-queue must be 0 (off) or a number of requests >= 1")

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disagg"


@dataclass(frozen=True)
class LaunchConfig:
    """`pdserve up`'s own flags: which nodes it starts, where, and (with --ray) on which cluster."""

    mode: str = option(
        "disagg", "disagg: prefill and decode nodes; colocated: one node doing both", choices=LAUNCH_MODES
    )
    num_prefill: int = option(1, "prefill nodes to start", type=int)
    num_decode: int = option(1, "decode nodes to start", type=int)
    prefill_device: str | None = option(None, "the prefill nodes' device (default: --device)")
    decode_device: str | None = option(None, "the decode nodes' device (default: --device)")
    cpu_cores: str | None = option(None, "the colocated node's cores (default: all)", metavar="CORES")
    prefill_cores: str | None = option(None, "cores of each prefill node (default: one core each)", metavar="CORES")
    decode_cores: str | None = option(None, "cores of each decode node (default: one core each)", metavar="CORES")
    no_pin: bool = option(False, "do not pin nodes to cores", action="store_true")
    ray: str | None = option(
        None,
        "place the nodes on a Ray cluster: 'auto', HOST:PORT, or none to start a local one",
        nargs="?",
        const="local",
        metavar="ADDRESS",
    )
    name: str = _deployment_name()
    placement: str = option(
        "spread", "spread: nodes on as many hosts as can take them; pack: on as few", choices=PLACEMENTS
    )
    ray_node_cpus: int = option(1, "CPUs each node holds on a CPU device", type=int)
    ray_bind_host: str = option("", "address nodes bind (default: their host's cluster IP)")
    max_restarts: int = option(3, "how often Ray restarts a node that died", type=int)


@dataclass(frozen=True)
class ScaleConfig:
    """`pdserve scale`: new node counts for a deployment on a Ray cluster."""

    ray: str = option("auto", "the Ray cluster: 'auto' or HOST:PORT", metavar="ADDRESS")
    name: str = _deployment_name()
    prefill: int = option(0, "prefill nodes wanted (default: as now)", type=int)
    decode: int = option(0, "decode nodes wanted (default: as now)", type=int)


@dataclass(frozen=True)
class PlanConfig:
    """`pdserve plan`: should these GPUs serve disaggregated, and how many prefill and decode nodes?"""

    costs: str | None = option(None, "a cost file written by python -m bench.costs (required)", metavar="FILE")
    workload: str = option(
        "chat", "chat, long-prompt (short answers) or long-answer (short prompts)", choices=PLAN_WORKLOADS
    )
    slo_ttft: float | None = option(None, "time-to-first-token SLO in seconds (required)", type=float, metavar="S")
    slo_tpot: float | None = option(None, "time-per-output-token SLO in seconds (required)", type=float, metavar="S")
    gpus: int | None = option(None, "GPUs to plan for, at least 2 (default: a table for 2, 4 and 8)", type=int)
    link_gbps: float | None = option(
        None, "GPU-to-GPU KV link in GB/s (default: the cost file's link)", type=float, metavar="B"
    )
    max_num_seqs: int = option(EngineConfig.max_num_seqs, "the most requests one node's step runs", type=int)
    max_num_batched_tokens: int = option(EngineConfig.max_num_batched_tokens, "tokens one node's step runs", type=int)
    num_requests: int = option(200, "requests simulated a GPU at each rate tried", type=int)
    seed: int = option(0, "the simulated workload's seed", type=int)
    out: str | None = option(None, "also write the answer (Markdown) to this file", metavar="FILE")

    def __post_init__(self) -> None:
        if self.gpus is not None and self.gpus < 2:
            raise ValueError(f"--gpus must be at least 2 (one prefill and one decode node), not {self.gpus}")
        for name in ("slo_ttft", "slo_tpot", "link_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value}")
        if min(self.max_num_seqs, self.max_num_batched_tokens) < 1 or self.num_requests < 10:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be at least 1, --num-requests 10")

    def check_given(self) -> None:
        """What the plan cannot do without (not checked at construction, so that the flags' defaults build)."""
        missing = [
            f
            for f, v in (("--costs", self.costs), ("--slo-ttft", self.slo_ttft), ("--slo-tpot", self.slo_tpot))
            if v is None
        ]
        if missing:
            raise ValueError(f"pdserve plan needs {', '.join(missing)}")


@dataclass(frozen=True)
class LogConfig:
    """Flags every verb takes, before the verb."""

    log_level: str = option("INFO", "how much to log", type=str.upper, choices=LOG_LEVELS)
