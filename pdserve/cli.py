"""The `pdserve` command: `up` starts a whole local stack; the other verbs run one role each."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.config import ROLES, NodeConfig, RouterConfig
from pdserve.flags import add_engine_args, add_router_limits, add_shared_args, engine_config
from pdserve.wire.protocol import Role


def add_api_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP API")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                   help="every route but /health needs 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)")
    g.add_argument("--max-n", type=int, default=16, help="the most choices (n) one request may ask for")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="verb", required=True)

    up = sub.add_parser("up", help="start router + nodes as child processes")
    add_engine_args(up)
    up.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--device", default="cpu")
    up.add_argument("--prefill-device", default=None)
    up.add_argument("--decode-device", default=None)
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--cpu-cores", default=None, help="colocated node's cores (default: all)")
    up.add_argument("--prefill-cores", default=None, help="cores of each prefill node (default: one core each)")
    up.add_argument("--decode-cores", default=None, help="cores of each decode node (default: one core each)")
    up.add_argument("--no-pin", action="store_true", help="do not pin nodes to cores")
    add_api_args(up)
    add_ray_args(up)
    add_router_limits(up)

    for role in ROLES:
        r = sub.add_parser(role, help=f"run one {role} node")
        add_engine_args(r)
        r.add_argument("--device", default="cpu")
        r.add_argument("--cpu-cores", default="", help="pin to these cores, e.g. 0 or 0-1")
        r.add_argument("--listen", default="tcp://127.0.0.1:0", help="router-facing address")
        r.add_argument("--ready-file", default="")
        r.add_argument("--host-id", default="", help="nodes with the same host id may share memory (default: "
                       "hostname and boot id)")  # fmt: skip
        if role == Role.DECODE:
            r.add_argument("--kv-listen", default="tcp://127.0.0.1:0", help="where prefill nodes ship KV")

    rt = sub.add_parser("router", help="run the HTTP router")
    rt.add_argument("--model", default="tiny")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=8000)
    rt.add_argument("--colocated", nargs="*", default=[])
    rt.add_argument("--prefill", nargs="*", default=[])
    rt.add_argument("--decode", nargs="*", default=[])
    rt.add_argument("--decode-kv", nargs="*", default=[])
    rt.add_argument("--served-model-name", default="")
    rt.add_argument("--node-timeout-s", type=float, default=10.0)
    rt.add_argument("--ray", default="", metavar="ADDRESS", help="learn the nodes from this Ray cluster's deployment")
    rt.add_argument("--ray-deployment", default="pdserve", help="the deployment's --name")
    add_api_args(rt)
    add_router_limits(rt)
    add_shared_args(rt)

    sc = sub.add_parser("scale", help="change the node counts of a deployment on a Ray cluster while it serves")
    sc.add_argument("--ray", default="auto", metavar="ADDRESS", help="the Ray cluster (default: auto)")
    sc.add_argument("--name", default="pdserve", help="the deployment's --name")
    sc.add_argument("--prefill", type=int, default=0, help="prefill nodes wanted (default: as now)")
    sc.add_argument("--decode", type=int, default=0, help="decode nodes wanted (default: as now)")

    keys = sub.add_parser("keys", help="write CurveZMQ keys for --zmq-keys into a new folder")
    keys.add_argument("dir")
    return p


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray cluster (pip install pdserve[ray])")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="place the nodes on a Ray cluster: 'auto', HOST:PORT, or none to start a local one")
    g.add_argument("--name", default="pdserve", help="this deployment's name on the cluster (for pdserve scale)")
    g.add_argument("--placement", default="spread", choices=["pack", "spread"],
                   help="spread: nodes on as many hosts as can take them; pack: on as few")
    g.add_argument("--ray-node-cpus", type=int, default=1, help="CPUs each node holds on a CPU device")
    g.add_argument("--ray-bind-host", default="", help="address nodes bind (default: their host's cluster IP)")
    g.add_argument("--max-restarts", type=int, default=3, help="how often Ray restarts a node that died")


def node_config(a: argparse.Namespace) -> NodeConfig:
    """The config of the node that `pdserve colocated|prefill|decode ...` runs."""
    return NodeConfig(
        role=Role(a.verb), engine=engine_config(a, a.device, a.cpu_cores), listen=a.listen,
        kv_listen=getattr(a, "kv_listen", "tcp://127.0.0.1:0"), kv_transport=a.kv_transport,
        kv_lease_s=a.kv_lease_s, ready_file=a.ready_file, host_id=a.host_id, drain_timeout_s=a.drain_timeout_s,
        zmq_keys=a.zmq_keys, kv_failure=a.kv_failure, kv_fault_rate=a.kv_fault_rate,
        kv_fault_kinds=tuple(k for k in a.kv_fault_kinds.split(",") if k),
    )  # fmt: skip


def run_node(a: argparse.Namespace) -> None:
    cfg = node_config(a)
    if a.verb == Role.COLOCATED:
        from pdserve.colocated_node import ColocatedNode as Node
    elif a.verb == Role.PREFILL:
        from pdserve.prefill_node import PrefillNode as Node
    else:
        from pdserve.decode_node import DecodeNode as Node
    Node(cfg).run()


def run_router(a: argparse.Namespace) -> None:
    from pdserve.router.server import serve

    cfg = RouterConfig(
        model=a.model, host=a.host, port=a.port, colocated=tuple(a.colocated), prefill=tuple(a.prefill),
        decode=tuple(a.decode), decode_kv=tuple(a.decode_kv), served_model_name=a.served_model_name,
        node_timeout_s=a.node_timeout_s, api_key=a.api_key, max_n=a.max_n, ray_address=a.ray,
        ray_deployment=a.ray_deployment, max_request_bytes=a.max_request_bytes,
        max_queued_requests=a.max_queued_requests, queue_timeout_s=a.queue_timeout_s,
        drain_timeout_s=a.drain_timeout_s, zmq_keys=a.zmq_keys,
    )  # fmt: skip
    serve(cfg)


def make_keys(a: argparse.Namespace) -> None:
    from pdserve.wire.transport import make_keys

    if os.path.exists(a.dir) and os.listdir(a.dir):
        raise ValueError(f"{a.dir} exists and is not empty; give a new folder")
    make_keys(a.dir)
    print(f"CurveZMQ keys written to {a.dir}; give every process of the stack --zmq-keys {a.dir} "
          "(copy the folder to each host, and keep it private)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if a.verb == "up" and a.ray is not None:
            from pdserve.ray_cluster import launch_on_ray

            sys.exit(launch_on_ray(a))
        elif a.verb == "up":
            from pdserve.launcher import launch

            sys.exit(launch(a))
        elif a.verb == "scale":
            from pdserve.ray_cluster import scale

            sys.exit(scale(a))
        elif a.verb == Role.ROUTER:
            run_router(a)
        elif a.verb == "keys":
            make_keys(a)
        else:
            run_node(a)
    except ValueError as e:  # a config error: say it plainly, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
