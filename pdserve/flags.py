"""The command-line flags shared by more than one command, and the router's command line, defined once.

Each group of flags is a table: `add_flags` puts it on a parser, `to_argv` turns parsed (or given) values
back into argv for a child process (`pdserve up` starting its nodes and router, the Ray launcher, bench,
the tests' stacks). cli.py and launcher.py both import this module; it imports neither.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.config import (
    ATTENTION_BACKENDS,
    CPU_KERNELS,
    DTYPE_CHOICES,
    KV_FAILURE_POLICIES,
    KV_FAULT_KINDS,
    KV_TRANSPORTS,
    EngineConfig,
    parse_cores,
)
from pdserve.wire.protocol import NODE_ROLES, KvTransport, Role


@dataclass(frozen=True)
class Flag:
    """One flag: its name, and the keywords of argparse's add_argument."""

    name: str
    options: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.options.get("action") == "store_true"


ENGINE_FLAGS = (
    Flag("--model", dict(default="tiny", help="checkpoint folder, or a built-in: tiny, small")),
    Flag("--dtype", dict(default="float32", choices=DTYPE_CHOICES)),
    Flag("--max-num-seqs", dict(type=int, default=16)),
    Flag("--max-num-batched-tokens", dict(type=int, default=512)),
    Flag("--block-size", dict(type=int, default=16)),
    Flag("--num-kv-blocks", dict(type=int, default=None)),
    Flag("--kv-cache-gb", dict(type=float, default=0.25)),
    Flag("--kv-transport", dict(default=KvTransport.ZMQ, type=KvTransport, choices=KV_TRANSPORTS)),
    Flag("--kv-lease-s", dict(type=float, default=30.0)),
    Flag("--cpu-kernels", dict(default="auto", choices=CPU_KERNELS)),
    Flag("--attention-backend", dict(default="auto", choices=ATTENTION_BACKENDS,
                                     help="auto: Triton kernels on CUDA, pdserve's C kernels on the CPU; torch: "
                                          "SDPA per request")),  # fmt: skip
    Flag("--enforce-eager", dict(action="store_true", help="no CUDA graphs for decode steps")),
    Flag("--kv-failure", dict(default="recompute", choices=KV_FAILURE_POLICIES,
                              help="decode node, a prompt's KV lost or damaged on the way: recompute it there, or "
                                   "fail it")),
    Flag("--kv-fault-rate", dict(type=float, default=0.0,
                                 help="prefill node, for tests and drills: damage this share of KV transfers on "
                                      "purpose")),
    Flag("--kv-fault-kinds", dict(default=",".join(KV_FAULT_KINDS),
                                  help="comma-separated: drop, delay, truncate, corrupt (with --kv-fault-rate)")),
)
SHARED_FLAGS = (  # every process of a stack takes these, router included
    Flag("--drain-timeout-s", dict(type=float, default=30.0,
                                   help="on SIGTERM: how long requests in flight may take to finish before they fail")),
    Flag("--zmq-keys", dict(default="", help="CurveZMQ key folder (make it with `pdserve keys DIR`)")),
)  # fmt: skip
ROUTER_LIMIT_FLAGS = (
    Flag("--max-request-bytes", dict(type=int, default=4 * 2**20, help="larger bodies get 413")),
    Flag("--max-queued-requests", dict(type=int, default=1024,
                                       help="requests waiting for a first token; beyond, 429 with Retry-After")),
    Flag("--queue-timeout-s", dict(type=float, default=300.0,
                                   help="a request without a first token after this long gets 503")),
)  # fmt: skip


def add_flags(g, flags: Iterable[Flag]) -> None:
    for f in flags:
        g.add_argument(f.name, **f.options)


def to_argv(flags: Iterable[Flag], values: dict) -> list[str]:
    """The command line that gives `flags` these `values` (by dest): a switch alone when true, any other flag with
    its value unless that is None or "". Flags without a value in `values` are left out (the child's default)."""
    argv = []
    for f in flags:
        value = values.get(f.dest)
        if f.switch:
            argv += [f.name] if value else []
        elif value is not None and value != "":
            argv += [f.name, str(value)]
    return argv


def engine_flags(**values) -> list[str]:
    """Engine (and shared) flags with these values, e.g. engine_flags(model="small", max_num_seqs=8)."""
    flags = ENGINE_FLAGS + SHARED_FLAGS
    unknown = values.keys() - {f.dest for f in flags}
    if unknown:
        raise TypeError(f"not engine flags: {sorted(unknown)}")
    return to_argv(flags, values)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    add_flags(g, ENGINE_FLAGS + SHARED_FLAGS)


def add_shared_args(g) -> None:
    """Flags every process of a stack takes, router included."""
    add_flags(g, SHARED_FLAGS)


def add_router_limits(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("router limits"), ROUTER_LIMIT_FLAGS)


def router_limits_argv(a: argparse.Namespace) -> list[str]:
    return to_argv(ROUTER_LIMIT_FLAGS + SHARED_FLAGS, vars(a))


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags of `a` again, to pass on to a child node."""
    return to_argv(ENGINE_FLAGS + SHARED_FLAGS, vars(a))


def engine_config(a: argparse.Namespace, device: str, cores: str) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=device, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks, kv_cache_gb=a.kv_cache_gb, cpu_cores=parse_cores(cores),
        cpu_kernels=a.cpu_kernels, attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
    )  # fmt: skip


def router_command(model: str, nodes: Iterable[dict], options: Iterable[str] = (), log_level: str = "") -> list[str]:
    """`pdserve router` over the nodes whose ready files say `nodes` (role, listen, and a decode node's kv_listen),
    with `options` (more flags of the router verb)."""
    argv = [sys.executable, "-m", "pdserve", *(["--log-level", log_level] if log_level else []), Role.ROUTER,
            "--model", model, *options]  # fmt: skip
    nodes = list(nodes)
    for role in NODE_ROLES:
        addrs = [n["listen"] for n in nodes if n["role"] == role]
        argv += [f"--{role}", *addrs] if addrs else []
    kv = [n["kv_listen"] for n in nodes if n["role"] == Role.DECODE]
    return [str(x) for x in argv] + (["--decode-kv", *kv] if kv else [])
