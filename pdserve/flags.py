"""Every verb's command line, built from the config dataclasses: each flag's default and help live once, in the
field it sets (pdserve/config.py).

How to add a flag: add a field to the config it belongs to with `option(default, "help", type=..., ...)`
(a field of plain `= value` is config only, no flag). Some groups take their dataclass whole, so the flag
appears at once: an EngineConfig field on every node verb and on `up` (which passes it on to its nodes), a
RouterConfig field on `pdserve router`, a LaunchConfig field on `up`, a ScaleConfig field on `scale`, a
PlanConfig field on `plan`. Any other field is named in the tables below: a NodeConfig field in ENGINE_FLAGS
(every node, and `up` passes it on) or NODE_FLAGS (the node verbs only); a router flag that `up` should take and
pass on in UP_ROUTER_FLAGS. The verb's code reads it from the parsed args under the field's name, and
`from_args(SomeConfig, args)` carries it into the config without a hand-written copy. tests/test_flags.py checks
that every flag has help and that a verb given no flags builds each config as the dataclass's defaults.

`to_argv` turns parsed (or given) values back into argv for a child process (`pdserve up` starting its nodes
and router, the Ray launcher, bench, the tests' stacks). cli.py and launcher.py both import this module; it
imports neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import (
    EngineConfig,
    LaunchConfig,
    LogConfig,
    NodeConfig,
    PlanConfig,
    RouterConfig,
    ScaleConfig,
)
from pdserve.wire.params import NODE_ROLES, Role

SWITCHES = ("store_true", "store_false", argparse.BooleanOptionalAction)  # flags that take no value


@dataclass(frozen=True)
class Flag:
    """One flag: its name, the config field it sets, and the keywords of argparse's add_argument."""

    name: str
    config: type
    options: dict = field(default_factory=dict)
    env: str = ""  # an environment variable whose value, when set as the parser is built, is the default

    def argparse_options(self) -> dict:
        """add_argument's keywords, the environment looked up now (not when this module was imported)."""
        if self.env and self.env in os.environ:
            return {**self.options, "default": os.environ[self.env]}
        return self.options

    @property
    def dest(self) -> str:
        return self.options["dest"]

    @property
    def switch(self) -> bool:
        return self.options.get("action") in SWITCHES

    @property
    def either_way(self) -> bool:
        """A switch with a --no-... twin (argparse.BooleanOptionalAction): True, False, or None (not given)."""
        return self.options.get("action") is argparse.BooleanOptionalAction

    def given(self, value: Any) -> bool:
        """Whether a switch must appear on the command line for the field to get `value`."""
        return bool(value) if self.options.get("action") == "store_true" else value is False


def _flag(config: type, f: dataclasses.Field) -> Flag:
    meta = f.metadata
    name = meta["flag"] or "--" + f.name.replace("_", "-")
    switch = meta["argparse"].get("action") in SWITCHES
    help = meta["help"] if switch else _with_default(meta["help"], f.default)  # a switch is off unless given
    return Flag(name, config, dict(dest=f.name, default=f.default, help=help, **meta["argparse"]), meta["env"])


def _with_default(help: str, default: Any) -> str:
    """The help text, with the default said unless the text says it or there is none to say."""
    if "default" in help or default is None or default in ("", ()):
        return help
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return f"{help} (default: {shown})"


def flags_of(config: type, *names: str, skip: Iterable[str] = ()) -> tuple[Flag, ...]:
    """The flags of `config`'s option fields: those named (in that order), or all of them but `skip`."""
    options = {f.name: f for f in dataclasses.fields(config) if "help" in f.metadata}
    chosen = names or [n for n in options if n not in set(skip)]
    return tuple(_flag(config, options[n]) for n in chosen)


# ---- the groups of flags, and which verb takes which ---------------------------------------------------------
ENGINE_FLAGS = flags_of(EngineConfig, skip=("device", "cpu_cores")) + flags_of(
    NodeConfig, "kv_transport", "kv_lease_s", "kv_failure", "kv_fault_rate", "kv_fault_kinds", "stats_interval_s"
)  # every node and `up` (which passes them on to its nodes)
SHARED_FLAGS = flags_of(NodeConfig, "drain_timeout_s", "zmq_keys")  # every process of a stack, router included
ROUTER_LIMIT_FLAGS = flags_of(RouterConfig, "max_request_bytes", "max_queued_requests", "queue_timeout_s")
ROUTER_API_FLAGS = flags_of(RouterConfig, "host", "port", "served_model_name", "skip_tokenizer", "api_key", "max_n")
UP_ROUTER_FLAGS = (
    ROUTER_API_FLAGS
    + flags_of(
        RouterConfig,
        "node_timeout_s",
        "access_log",
        "cache_balance_margin",
        "local_prefill_max_tokens",
        "max_prefill_queue",
        "router_workers",
    )
    + ROUTER_LIMIT_FLAGS
)
RAY_UP_FLAGS = flags_of(LaunchConfig, "ray", "name", "placement", "ray_node_cpus", "ray_bind_host", "max_restarts")
NODE_FLAGS = flags_of(EngineConfig, "device", "cpu_cores") + flags_of(NodeConfig, "listen", "ready_file", "host_id")

Groups = tuple[tuple[str, tuple[Flag, ...]], ...]  # (title, flags) of each group of a verb's --help
VERB_FLAGS: dict[str, Groups] = {
    "up": (
        ("engine", ENGINE_FLAGS + SHARED_FLAGS + flags_of(EngineConfig, "device")),
        ("nodes", flags_of(LaunchConfig, skip=[f.dest for f in RAY_UP_FLAGS])),
        ("router", UP_ROUTER_FLAGS),
        ("Ray cluster (pip install pdserve[ray])", RAY_UP_FLAGS),
    ),
    **{
        role: (
            ("engine", ENGINE_FLAGS + SHARED_FLAGS),
            ("node", NODE_FLAGS + (flags_of(NodeConfig, "kv_listen") if role == Role.DECODE else ())),
        )
        for role in NODE_ROLES
    },
    Role.ROUTER: (("router", flags_of(RouterConfig)),),
    "scale": (("deployment", flags_of(ScaleConfig)),),
    "plan": (("plan", flags_of(PlanConfig)),),
}
GLOBAL_FLAGS = flags_of(LogConfig)  # before the verb


def add_flags(g, flags: Iterable[Flag]) -> None:
    for f in flags:
        g.add_argument(f.name, **f.argparse_options())


def add_verb_flags(p: argparse.ArgumentParser, verb: str) -> None:
    for title, flags in VERB_FLAGS[verb]:
        add_flags(p.add_argument_group(title), flags)


def from_args(config: type, a: argparse.Namespace, **given) -> Any:
    """`config` built from the parsed flags of its fields that `a` has (a list as a tuple), and `given`."""
    names = {f.name for f in dataclasses.fields(config)} - given.keys()
    values = {n: getattr(a, n) for n in names if hasattr(a, n)}
    return config(**{n: tuple(v) if isinstance(v, list) else v for n, v in values.items()}, **given)


def _argv_value(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def to_argv(flags: Iterable[Flag], values: dict) -> list[str]:
    """The command line that gives `flags` these `values` (by dest): a switch alone when it must be given (a
    --no-... switch when its value is false), any other flag with its value unless that is None or "". Flags
    without a value in `values` are left out (the child's default)."""
    argv = []
    for f in flags:
        value = values.get(f.dest)
        if f.either_way:
            argv += [] if value is None else [f.name if value else "--no-" + f.name[2:]]
        elif f.switch:
            argv += [f.name] if f.given(value) else []
        elif value is not None and value != "":
            argv += [f.name, _argv_value(value)]
    return argv


def engine_flags(**values) -> list[str]:
    """Engine (and shared) flags with these values, e.g. engine_flags(model="small", max_num_seqs=8)."""
    flags = ENGINE_FLAGS + SHARED_FLAGS
    unknown = values.keys() - {f.dest for f in flags}
    if unknown:
        raise TypeError(f"not engine flags: {sorted(unknown)}")
    return to_argv(flags, values)


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags of `a` again, to pass on to a child node."""
    return to_argv(ENGINE_FLAGS + SHARED_FLAGS, vars(a))


def router_options(a: argparse.Namespace) -> list[str]:
    """The router flags of `up` again, to pass on to its router; the API key travels in its environment instead."""
    return to_argv([f for f in UP_ROUTER_FLAGS + SHARED_FLAGS if f.dest != "api_key"], vars(a))


def router_command(model: str, nodes: Iterable[dict], options: Iterable[str] = (), log_level: str = "") -> list[str]:
    """`pdserve router` over the nodes whose ready files say `nodes` (role, listen, and a decode node's kv_listen),
    with `options` (more flags of the router verb)."""
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        *(["--log-level", log_level] if log_level else []),
        Role.ROUTER,
        "--model",
        model,
        *options,
    ]
    nodes = list(nodes)
    for role in NODE_ROLES:
        addrs = [n["listen"] for n in nodes if n["role"] == role]
        argv += [f"--{role}", *addrs] if addrs else []
    kv = [n["kv_listen"] for n in nodes if n["role"] == Role.DECODE]
    return [str(x) for x in argv] + (["--decode-kv", *kv] if kv else [])
