"""`pdserve up`'s plan (which nodes start, on which devices, with which flags; no node is started) and preflight."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import build_parser, node_config
from pdserve.config import EngineConfig
from pdserve.flags import ENGINE_FLAGS, SHARED_FLAGS, router_command
from pdserve.launcher import plan, stop_all


def _plan(tmp_path, *flags: str) -> list[tuple[str, list[str]]]:
    nodes = plan(build_parser().parse_args(["up", *flags]), tmp_path)
    return [(role, argv) for role, argv, _ in nodes]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _child_config(argv: list[str]):
    """The NodeConfig the child process would build from its command line (after `python -m pdserve`)."""
    return node_config(build_parser().parse_args(argv[3:]))


def test_cuda_ipc_with_each_role_on_its_own_gpu(tmp_path):
    """--device stays at cpu: the devices the prefill and decode nodes get are what counts."""
    nodes = _plan(
        tmp_path,
        "--mode",
        "disagg",
        "--kv-transport",
        "cuda_ipc",
        "--dtype",
        "float16",
        "--prefill-device",
        "cuda:0",
        "--decode-device",
        "cuda:1",
    )
    assert [role for role, _ in nodes] == ["prefill", "decode"]
    for (role, argv), dev in zip(nodes, ["cuda:0", "cuda:1"], strict=True):
        assert argv[5] == role and _flag(argv, "--device") == dev and _flag(argv, "--kv-transport") == "cuda_ipc"
        assert _flag(argv, "--cpu-cores") == "", "a GPU node must not be pinned to one core"
        cfg = _child_config(argv)
        assert (cfg.role, cfg.engine.device, cfg.engine.dtype, cfg.kv_transport) == (role, dev, "float16", "cuda_ipc")


def test_cuda_ipc_with_device_for_both_roles(tmp_path):
    nodes = _plan(tmp_path, "--kv-transport", "cuda_ipc", "--device", "cuda:0", "--num-decode", "2")
    assert [(role, _flag(argv, "--device")) for role, argv in nodes] == [
        ("prefill", "cuda:0"),
        ("decode", "cuda:0"),
        ("decode", "cuda:0"),
    ]


@pytest.mark.parametrize(
    ("devices", "on_cpu"),
    [
        (("--prefill-device", "cuda:0"), "decode on cpu"),
        (("--decode-device", "cuda:1"), "prefill on cpu"),
        (("--device", "cuda:0", "--decode-device", "cpu"), "decode on cpu"),
        ((), "prefill on cpu, decode on cpu"),
    ],
)
def test_cuda_ipc_refused_when_a_role_is_on_the_cpu(tmp_path, devices, on_cpu):
    with pytest.raises(ValueError, match="cuda_ipc needs every node on a GPU") as e:
        _plan(tmp_path, "--kv-transport", "cuda_ipc", *devices)
    assert f"not {on_cpu}:" in str(e.value)


def test_shm_refused_when_a_role_is_on_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="decode on cuda:0"):
        _plan(tmp_path, "--kv-transport", "shm", "--decode-device", "cuda:0")


def test_cpu_nodes_are_pinned_gpu_nodes_are_not(tmp_path):
    nodes = _plan(tmp_path, "--kv-transport", "zmq", "--prefill-device", "cuda:0", "--decode-device", "cpu")
    prefill_cores, decode_cores = (_flag(argv, "--cpu-cores") for _, argv in nodes)
    assert prefill_cores == "" and decode_cores != ""


def test_colocated_ignores_the_kv_transport(tmp_path):
    """No KV moves between nodes in colocated mode, so no transport can be refused there."""
    [(role, argv)] = _plan(tmp_path, "--mode", "colocated", "--kv-transport", "cuda_ipc", "--no-pin")
    assert role == "colocated" and _child_config(argv).engine.device == "cpu"


def test_a_node_refuses_cuda_ipc_on_the_cpu():
    a = build_parser().parse_args(["decode", "--kv-transport", "cuda_ipc", "--device", "cpu"])
    with pytest.raises(ValueError, match="decode node needs --device cuda:N"):
        node_config(a)


def test_unknown_device_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'cpu' or 'cuda:N'"):
        _plan(tmp_path, "--decode-device", "gpu1")


def test_every_engine_flag_of_up_reaches_the_nodes(tmp_path):
    """The engine flags are defined once (pdserve/flags.py): what `up` parses, each node parses back unchanged."""
    given = [
        "--model",
        "small",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "64",
        "--block-size",
        "8",
        "--num-kv-blocks",
        "40",
        "--kv-cache-gb",
        "0.5",
        "--kv-transport",
        "shm",
        "--kv-lease-s",
        "7.5",
        "--cpu-kernels",
        "off",
        "--attention-backend",
        "torch",
        "--enforce-eager",
        "--drain-timeout-s",
        "4.0",
        "--no-pin",
    ]
    up = build_parser().parse_args(["up", *given])
    for role, argv in _plan(tmp_path, *given):
        node = build_parser().parse_args(argv[3:])
        for f in ENGINE_FLAGS + SHARED_FLAGS:
            assert getattr(node, f.dest) == getattr(up, f.dest), (role, f.name)


def test_router_command_lists_each_role_and_the_decode_kv_addresses():
    nodes = [{"role": "prefill", "listen": "tcp://p"}, {"role": "decode", "listen": "tcp://d", "kv_listen": "tcp://k"}]
    argv = router_command("tiny", nodes, ["--port", "9"])
    a = build_parser().parse_args(argv[3:])
    assert (a.verb, a.model, a.port, a.prefill, a.decode, a.decode_kv) == (
        "router",
        "tiny",
        9,
        ["tcp://p"],
        ["tcp://d"],
        ["tcp://k"],
    )


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cudafoo"])
def test_a_malformed_cuda_device_is_refused_in_one_line(tmp_path, device):
    with pytest.raises(ValueError, match="'cpu' or 'cuda:N'"):
        _plan(tmp_path, "--device", device)
    with pytest.raises(ValueError, match="'cpu' or 'cuda:N'"):
        EngineConfig(device=device)


def test_preflight_of_mock_nodes_on_cuda_imports_no_torch():
    """A mock node uses no device: `up --engine mock --device cuda` is checked without torch (none is needed)."""
    code = (
        "import sys; from pdserve.cli import build_parser; from pdserve.launcher import preflight; "
        "preflight(build_parser().parse_args(['up', '--engine', 'mock', '--device', 'cuda:0', '--port', '0'])); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_router_is_given_the_addresses_the_nodes_will_listen_on(tmp_path):
    """The router starts beside the nodes: each node's --listen (and a decode node's --kv-listen) is chosen before it
    starts, distinct and free, and the router's command names exactly those."""
    from pdserve.launcher import planned_infos, router_argv

    a = build_parser().parse_args(["up", "--mode", "disagg", "--num-decode", "2"])
    nodes = plan(a, tmp_path)
    addrs = [_flag(argv, "--listen") for _, argv, _ in nodes]
    kv = [_flag(argv, "--kv-listen") for role, argv, _ in nodes if role == "decode"]
    assert len(set(addrs + kv)) == 5 and all(x.startswith("tcp://127.0.0.1:") and not x.endswith(":0") for x in addrs)
    assert [_child_config(argv).listen for _, argv, _ in nodes] == addrs
    router = router_argv(a, planned_infos(nodes), "id")
    assert router[router.index("--prefill") + 1] == addrs[0]
    assert router[router.index("--decode") + 1 : router.index("--decode") + 3] == addrs[1:]
    assert router[router.index("--decode-kv") + 1 :] == kv


def test_the_router_stops_first_and_the_pool_owners_last(tmp_path):
    """stop_all's order: the router (started last), waited for; then the other nodes, each waited for; only then the
    prefill nodes, whose KV pools the others may map (an owner that exits first leaves those mappings dangling). Each
    child notes when SIGTERM reached it and when it exited."""
    log = tmp_path / "order"
    child = (
        "import signal, sys, time\n"
        "name, log = sys.argv[1], sys.argv[2]\n"
        "def note(what):\n"
        "    with open(log, 'a') as f: f.write(f'{what} {name}\\n')\n"
        "def stop(*_):\n"
        "    note('term'); time.sleep(0.3); note('exit'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print(flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    names = ["prefill0", "prefill1", "decode0", "router"]  # in the launcher's start order
    procs = [subprocess.Popen([sys.executable, "-c", child, n, str(log)], stdout=subprocess.PIPE) for n in names]
    for p in procs:
        p.stdout.readline()  # its handler is in place
    try:
        stop_all(procs, 0.0, owners=procs[:2])
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    order = log.read_text().split("\n")[:-1]
    assert order[:4] == ["term router", "exit router", "term decode0", "exit decode0"], order
    assert sorted(order[4:]) == ["exit prefill0", "exit prefill1", "term prefill0", "term prefill1"]
    assert all(p.returncode == 0 for p in procs)
