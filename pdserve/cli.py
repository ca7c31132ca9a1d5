"""The `pdserve` command: `up` starts a whole local stack; the other verbs run one role each."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable

from pdserve.config import ROLES, EngineConfig, NodeConfig, PlanConfig, RouterConfig
from pdserve.flags import GLOBAL_FLAGS, add_flags, add_verb_flags, from_args
from pdserve.startup import check_checkpoint, check_device, check_port_free
from pdserve.wire.params import Role

log = logging.getLogger("pdserve")

VERB_HELP = {
    "up": "start router + nodes as child processes",
    **{role: f"run one {role} node" for role in ROLES},
    Role.ROUTER: "run the HTTP router",
    "scale": "change the node counts of a deployment on a Ray cluster while it serves",
    "plan": "should I disaggregate, and how many of each? goodput a GPU of P:D splits against colocated replicas",
}


class HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=HelpFormatter)
    add_flags(p, GLOBAL_FLAGS)
    sub = p.add_subparsers(dest="verb", required=True)
    for verb, help in VERB_HELP.items():
        add_verb_flags(sub.add_parser(verb, help=help, description=help, formatter_class=HelpFormatter), verb)
    keys = sub.add_parser("keys", help="write CurveZMQ keys for --zmq-keys into a new folder")
    keys.add_argument("dir", help="a new (or empty) folder")
    return p


def node_config(a: argparse.Namespace) -> NodeConfig:
    """The config of the node that `pdserve colocated|prefill|decode ...` runs."""
    return from_args(NodeConfig, a, role=Role(a.verb), engine=from_args(EngineConfig, a))


def start_node(a: argparse.Namespace) -> Callable[[], None]:
    """The node of `pdserve colocated|prefill|decode ...`, built and bound: its run, the serving that follows."""
    cfg = node_config(a)
    check_device(cfg.engine.device)
    check_checkpoint(cfg.engine.model, tokenizer=False)
    e = cfg.engine
    cores = f", cores {','.join(map(str, e.cpu_cores))}" if e.cpu_cores else ""
    log.info("starting: %s (%s on %s%s)", e.model, e.dtype, e.device, cores)
    started = time.monotonic()
    mock = e.engine == "mock"  # no model: no torch
    if not mock:
        import torch  # noqa: F401  (here, so that this stage's time is what the line below says)
    if a.verb == Role.COLOCATED:
        from pdserve.nodes.colocated import ColocatedNode as Node
    elif a.verb == Role.PREFILL:
        from pdserve.nodes.prefill import PrefillNode as Node
    else:
        from pdserve.nodes.decode import DecodeNode as Node
    what = "the mock engine" if mock else "torch and the engine"
    log.info("imported %s in %.1f s", what, time.monotonic() - started)
    return Node(cfg).run


def start_router(a: argparse.Namespace) -> Callable[[], object]:
    """`pdserve router`'s config, checked: the serving that follows."""
    started = time.monotonic()
    from pdserve.router.server import serve

    cfg = from_args(RouterConfig, a)
    check_port_free(cfg.host, cfg.port)
    check_checkpoint(cfg.model, tokenizer=not cfg.skip_tokenizer)
    log.info("imported the router in %.1f s", time.monotonic() - started)  # once its checks passed: no error follows
    if cfg.router_workers > 1:
        from pdserve.router.workers import Workers

        return lambda: sys.exit(Workers(cfg).run())
    return lambda: serve(cfg)


def make_keys(a: argparse.Namespace) -> None:
    from pdserve.wire.transport import make_keys

    if os.path.exists(a.dir) and os.listdir(a.dir):
        raise ValueError(f"{a.dir} exists and is not empty; give a new folder")
    make_keys(a.dir)
    print(
        f"CurveZMQ keys written to {a.dir}; give every process of the stack --zmq-keys {a.dir} "
        "(copy the folder to each host, and keep it private)"
    )


def log_format(verb: str) -> str:
    """Each line says which process of the stack wrote it: a node by its role and pid, else the verb."""
    who = f"{verb} {os.getpid()}" if verb in ROLES else verb
    return f"%(asctime)s %(levelname)s {who}: %(message)s"


def start(a: argparse.Namespace) -> Callable[[], object]:
    """The verb's start: its config built and checked, a node built and bound (ValueError: a mistake, said in one
    line). A node or router returns its serving, which runs outside that net: an error there is no config error.
    `up`, `scale`, `plan` and `keys` run whole here (their children and actors report their own failures)."""
    if a.verb == Role.ROUTER:
        return start_router(a)
    if a.verb in ROLES:
        return start_node(a)
    if a.verb == "up" and a.ray is not None:
        from pdserve.ray_cluster import launch_on_ray

        sys.exit(launch_on_ray(a))
    elif a.verb == "up":
        from pdserve.launcher import launch

        sys.exit(launch(a))
    elif a.verb == "plan":
        from pdserve.plan.plan import answer

        print(answer(from_args(PlanConfig, a)))
        sys.exit(0)
    elif a.verb == "scale":
        from pdserve.ray_cluster import scale

        sys.exit(scale(a))
    make_keys(a)
    return lambda: None


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level, format=log_format(a.verb), datefmt="%Y-%m-%d %H:%M:%S")
    try:
        serve = start(a)
    except ValueError as e:  # a config or start-up error: say it plainly, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    serve()


if __name__ == "__main__":
    main()
