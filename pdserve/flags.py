"""The command-line flags shared by more than one command, defined once: functions that add them to a parser,
and functions that turn parsed values back into argv for a child process (`pdserve up` starting its nodes and
router, the Ray launcher). cli.py and launcher.py both import this module; it imports neither."""

from __future__ import annotations

import argparse

from pdserve.config import ATTENTION_BACKENDS, CPU_KERNELS, DTYPE_CHOICES, KV_TRANSPORTS, EngineConfig, parse_cores
from pdserve.wire.protocol import KvTransport


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="checkpoint folder, or a built-in: tiny, small")
    g.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-gb", type=float, default=0.25)
    g.add_argument("--kv-transport", default=KvTransport.ZMQ, type=KvTransport, choices=KV_TRANSPORTS)
    g.add_argument("--kv-lease-s", type=float, default=30.0)
    g.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNELS)
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: Triton kernels on CUDA, pdserve's C kernels on the CPU; torch: SDPA per request")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    add_shared_args(g)


def add_shared_args(g) -> None:
    """Flags every process of a stack takes, router included."""
    g.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: how long requests in flight may take to finish before they fail")  # fmt: skip
    g.add_argument("--zmq-keys", default="", help="CurveZMQ key folder (make it with `pdserve keys DIR`)")


def add_router_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router limits")
    g.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="larger bodies get 413")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for a first token; beyond, 429 with Retry-After")  # fmt: skip
    g.add_argument("--queue-timeout-s", type=float, default=300.0,
                   help="a request without a first token after this long gets 503")  # fmt: skip


def shared_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--drain-timeout-s", str(a.drain_timeout_s)]
    return argv + (["--zmq-keys", a.zmq_keys] if a.zmq_keys else [])


def router_limits_argv(a: argparse.Namespace) -> list[str]:
    return ["--max-request-bytes", str(a.max_request_bytes), "--max-queued-requests", str(a.max_queued_requests),
            "--queue-timeout-s", str(a.queue_timeout_s), *shared_argv(a)]  # fmt: skip


def engine_config(a: argparse.Namespace, device: str, cores: str) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=device, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks, kv_cache_gb=a.kv_cache_gb, cpu_cores=parse_cores(cores),
        cpu_kernels=a.cpu_kernels, attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
    )  # fmt: skip


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags of `a` again, to pass on to a child node."""
    argv = ["--model", a.model, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--block-size", str(a.block_size),
            "--kv-cache-gb", str(a.kv_cache_gb), "--kv-transport", str(a.kv_transport),
            "--kv-lease-s", str(a.kv_lease_s), "--cpu-kernels", a.cpu_kernels,
            "--attention-backend", a.attention_backend]  # fmt: skip
    if a.enforce_eager:
        argv.append("--enforce-eager")
    if a.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(a.num_kv_blocks)]
    return argv + shared_argv(a)
