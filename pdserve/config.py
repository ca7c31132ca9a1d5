"""One frozen config per process. Validation raises ValueError with a message a user can act on."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.wire.protocol import NODE_ROLES, KvTransport, Role

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
CPU_KERNELS = ("auto", "on", "off")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
KV_TRANSPORTS = tuple(KvTransport)
ROLES = NODE_ROLES
KV_ROLES = (Role.PREFILL, Role.DECODE)  # the roles that move KV between nodes
KV_FAILURE_POLICIES = ("recompute", "fail")
KV_FAULT_KINDS = ("drop", "delay", "truncate", "corrupt")


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


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from kv_cache_gb
    kv_cache_gb: float = 0.25
    cpu_cores: tuple[int, ...] = ()  # pin the process to these cores ((): no pinning)
    # pdserve's C kernels (paged decode attention, fused norms, silu*mul; CPU, float32): "on",
    # "off" (torch's ops, SDPA per request), "auto" (on where they apply and build)
    cpu_kernels: str = "auto"
    # attention: "triton" (paged kernels; auto's choice on CUDA), "torch" (SDPA per request), "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps

    def __post_init__(self) -> None:
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
        if not (self.device == "cpu" or self.device.startswith("cuda")):
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

    def num_blocks_for(self, bytes_per_token: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return max(1, int(self.kv_cache_gb * 2**30) // (bytes_per_token * self.block_size))


@dataclass(frozen=True)
class NodeConfig:
    """A colocated, prefill or decode node: where it listens and how it moves KV."""

    role: Role
    engine: EngineConfig
    listen: str = "tcp://127.0.0.1:0"  # router-facing socket
    kv_listen: str = "tcp://127.0.0.1:0"  # decode node: where prefill nodes connect to ship KV
    kv_transport: KvTransport = KvTransport.ZMQ
    kv_lease_s: float = 30.0
    ready_file: str = ""  # if set, the node writes its bound addresses here once it serves
    host_id: str = ""  # nodes with the same host id may share memory ("": hostname and boot id)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long the requests it holds may take to finish
    zmq_keys: str = ""  # CurveZMQ key folder (`pdserve keys DIR`); "" for plain sockets
    kv_failure: str = "recompute"  # decode node, a prompt's KV lost or damaged on the way: recompute it here, or fail
    kv_fault_rate: float = 0.0  # prefill node, tests and drills: the share of KV transfers damaged on purpose
    kv_fault_kinds: tuple[str, ...] = KV_FAULT_KINDS  # how they are damaged (one picked at random each time)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}")
        on_gpu = self.engine.device.startswith("cuda")
        if self.role in KV_ROLES and self.kv_transport == KvTransport.CUDA_IPC and not on_gpu:
            raise ValueError(f"--kv-transport cuda_ipc moves KV between GPUs: this {self.role} node needs "
                             f"--device cuda:N, not {self.engine.device!r}")  # fmt: skip
        if self.kv_lease_s <= 0:
            raise ValueError("--kv-lease-s must be positive")
        if self.drain_timeout_s <= 0:
            raise ValueError("--drain-timeout-s must be positive")
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
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    colocated: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()  # router-facing addresses of decode nodes
    decode_kv: tuple[str, ...] = ()  # their KV addresses, in the same order
    served_model_name: str = ""
    node_timeout_s: float = 10.0
    connect_timeout_s: float = 120.0
    api_key: str = field(default="", repr=False)  # every route but /health then needs it as a Bearer token
    max_n: int = 16  # the most choices (n) one request may ask for
    ray_address: str = ""  # set: learn prefill and decode nodes from a Ray deployment, not from fixed lists
    ray_deployment: str = "pdserve"  # the `pdserve up --ray --name` of that deployment
    membership_interval_s: float = 1.0  # how often the Ray deployment's node list is read
    max_request_bytes: int = 4 * 2**20  # bodies above this are answered 413 before they are parsed
    max_queued_requests: int = 1024  # requests without a first token; beyond, 429 with Retry-After
    queue_timeout_s: float = 300.0  # a request without a first token after this long fails (503)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may take to finish
    zmq_keys: str = ""  # CurveZMQ key folder (`pdserve keys DIR`); "" for plain sockets

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

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disagg"
