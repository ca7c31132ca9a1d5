"""Start-up mistakes: each ends `pdserve` at once with one line on stderr, a non-zero exit, no traceback, and no
"serving" line; `pdserve up` knows its own router from another server on the same port; and a start and a stop
read well."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from pdserve.checkpoint import resolve_model
from pdserve.launcher import _wait_http
from tests.helpers import hf_greedy, wait_until
from tests.stack import free_port

START_TIMEOUT_S = 60  # a refusal comes before any node starts: seconds, not a model load


def _pdserve(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pdserve", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy(), timeout=START_TIMEOUT_S)


def _refused(out: subprocess.CompletedProcess, says: str) -> str:
    """The single line `pdserve` ended with."""
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "serving" not in out.stdout, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pdserve: error: ") and says in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port():
    """A port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_up_refuses_a_port_in_use(taken_port):
    line = _refused(_pdserve("up", "--model", "tiny", "--port", str(taken_port)), "already in use")
    assert str(taken_port) in line


def test_router_refuses_a_port_in_use(taken_port):
    out = _pdserve("router", "--port", str(taken_port), "--colocated", "tcp://127.0.0.1:1")
    _refused(out, f"port {taken_port} on 127.0.0.1 is already in use")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "args", [["up", "--device", "cuda"], ["up", "--decode-device", "cuda:1"], ["prefill", "--device", "cuda:0"]]
)
def test_cuda_device_without_cuda_is_refused(args):
    _refused(_pdserve(*args), "use --device cpu")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kv-cache-gb", "-1"], "--kv-cache-gb must be positive"),  # a node's config
        (["--max-n", "0"], "--max-n must be at least 1"),  # the router's
        (["--kv-transport", "cuda_ipc"], "cuda_ipc needs every node on a GPU"),  # the stack's
    ],
)
def test_up_refuses_a_config_its_children_would_refuse(args, says):
    """Once, in the launcher, before any child starts: not once per child, then "a node exited"."""
    _refused(_pdserve("up", *args, "--port", str(free_port())), says)


@pytest.mark.parametrize(
    ("verb", "flag"),
    [("colocated", "--listen"), ("prefill", "--listen"), ("decode", "--listen"), ("decode", "--kv-listen")],
)
def test_a_node_refuses_a_taken_address(taken_port, verb, flag):
    taken = f"tcp://127.0.0.1:{taken_port}"
    argv = ["--listen", taken if flag == "--listen" else "tcp://127.0.0.1:0"]
    if verb == "decode":
        argv += ["--kv-listen", taken if flag == "--kv-listen" else "tcp://127.0.0.1:0"]
    _refused(_pdserve("--log-level", "WARNING", verb, "--engine", "mock", *argv), f"{flag} {taken}: cannot listen")


def test_a_node_refuses_an_address_zmq_cannot_bind(tmp_path):
    where = f"ipc://{tmp_path}/no-such-folder/node.sock"
    _refused(_pdserve("--log-level", "WARNING", "colocated", "--engine", "mock", "--listen", where), where)


def test_an_error_while_serving_is_not_reported_as_a_config_error(monkeypatch):
    """A node that started and then fails (here a ProtocolError, a ValueError) raises with its traceback, not the
    one-line exit of a start-up mistake."""
    from pdserve import cli
    from pdserve.nodes.colocated import ColocatedNode
    from pdserve.wire.codec import ProtocolError

    def run(node: ColocatedNode) -> None:
        node.close()
        raise ProtocolError("a frame went bad while serving")

    monkeypatch.setattr(ColocatedNode, "run", run)
    with pytest.raises(ProtocolError, match="while serving"):
        cli.main(["--log-level", "WARNING", "colocated", "--engine", "mock", "--listen", "tcp://127.0.0.1:0"])


def _checkpoint_copy(folder: Path, files: list[str], **config_changes) -> Path:
    """A checkpoint folder with some of tiny's files, its config changed by `config_changes`."""
    tiny = resolve_model("tiny")
    folder.mkdir()
    for name in files:
        shutil.copy(tiny / name, folder / name)
    config = {**json.loads((tiny / "config.json").read_text()), **config_changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_checkpoint_without_tokenizer_files_is_refused(tmp_path):
    folder = _checkpoint_copy(tmp_path / "no-tokenizer", ["model.safetensors"])
    _refused(_pdserve("up", "--model", str(folder), "--port", str(free_port())), "has no tokenizer files")


def test_skip_tokenizer_serves_token_id_prompts_exactly_and_refuses_text(tmp_path):
    """With --skip-tokenizer the same folder serves: token ids in, token ids out (those of HF greedy); text gets 400."""
    folder = _checkpoint_copy(tmp_path / "no-tokenizer", ["model.safetensors"])
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        str(folder),
        "--skip-tokenizer",
        "--mode",
        "colocated",
        "--port",
        str(port),
        "--no-pin",
        "--num-kv-blocks",
        "64",
    ]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    url, model = f"http://127.0.0.1:{port}/v1", str(folder)
    try:
        assert "is serving" in up.stdout.readline()
        body = {
            "model": model,
            "prompt": [5, 6, 7],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == hf_greedy(folder, [[5, 6, 7]], [6])[0]
        r = httpx.post(f"{url}/completions", json={**body, "prompt": "hello"}, timeout=60)
        assert r.status_code == 400 and "--skip-tokenizer" in r.json()["error"]["message"], r.text
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{url}/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and "--skip-tokenizer" in r.json()["error"]["message"], r.text
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


@pytest.mark.parametrize("verb", ["up", "decode"])
def test_an_unsupported_architecture_is_refused(tmp_path, verb):
    tiny = resolve_model("tiny")
    files = [p.name for p in tiny.iterdir() if p.name != "config.json"]
    folder = _checkpoint_copy(tmp_path / "gpt2", files, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    _refused(_pdserve(verb, "--model", str(folder)), "model type 'gpt2' (GPT2LMHeadModel) is not supported")


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    _refused(_pdserve("up", "--model", str(tmp_path), "--port", str(free_port())), "nor a folder with a config.json")


class _OtherServer(BaseHTTPRequestHandler):
    """A server of another launch on the port: /health answers 200, with another instance id."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"status": "ok", "instance": "another"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.answered.set()

    def log_message(self, *_):
        pass


def test_the_readiness_poll_does_not_take_another_server_for_its_router():
    """The other server answers the poll, yet the launcher waits for its own router, and fails when that exits."""
    server = HTTPServer(("127.0.0.1", 0), _OtherServer)
    server.answered = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        waiter = threading.Thread(target=_expect_router_exit, args=(server, router))
        waiter.start()
        assert server.answered.wait(30), "the launcher never polled /health"
        router.stdin.close()  # the router exits: the poll, which took no answer for ours, must say so
        waiter.join(30)
        assert not waiter.is_alive() and waiter.outcome == "router exited"
    finally:
        server.shutdown()
        router.kill()
        router.wait()


def _expect_router_exit(server: HTTPServer, router: subprocess.Popen) -> None:
    try:
        _wait_http(f"http://127.0.0.1:{server.server_port}", router, "ours")
        threading.current_thread().outcome = "took another server for its router"
    except RuntimeError as e:
        threading.current_thread().outcome = "router exited" if "exited during start-up" in str(e) else str(e)


def test_up_says_each_stage_serves_logs_requests_and_stops_cleanly_on_ctrl_c(tmp_path):
    """A line per stage per node with seconds, the ready line in words, an access line per request, and on
    Ctrl-C "stopping" and nothing that reads like a failure."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--model",
        "tiny",
        "--mode",
        "colocated",
        "--port",
        str(port),
        "--no-pin",
        "--num-kv-blocks",
        "64",
    ]
    with open(tmp_path / "stderr", "w") as err:
        up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ.copy())
    try:
        assert "is serving" in up.stdout.readline()
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=START_TIMEOUT_S) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    log = (tmp_path / "stderr").read_text()
    for stage in (
        r"colocated \d+: starting: tiny",
        r"colocated \d+: loaded the weights of tiny .* in [\d.]+ s",
        r"colocated \d+: built the kernels and warmed up in [\d.]+ s",
        r"colocated \d+: colocated node ready in [\d.]+ s: takes requests from the router at tcp://",
        r"router: POST /v1/completions 200 3\+4 tokens [\d.]+ s",
        r"pdserve: stopping",
        r"router: imported the router in [\d.]+ s",
        r"up: the colocated node is ready, [\d.]+ s after launch",
    ):
        assert len(re.findall(stage, log)) == 1, (stage, log)
    # the router starts beside the node, not after it, and has it joined before the launcher says ready
    order = [
        r"up: started 1 node\(s\) and the router beside them",
        r"colocated \d+: colocated node ready in",
        r"router: colocated@tcp://127.0.0.1:\d+ is up \(joined [\d.]+ s after the router started\)",
        r"up: ready [\d.]+ s after launch: every node loaded and warmed up, the router joined them",
    ]
    at = [re.search(line, log) for line in order]
    assert all(at) and [m.start() for m in at] == sorted(m.start() for m in at), log
    for failure in ("Traceback", "is down", "exited with code", "{'role'", "Loading weights"):
        assert failure not in log, log


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_children_of_a_killed_launcher_stop(tmp_path):
    """SIGKILL leaves the launcher no chance to stop its children (in sessions of their own): they stop anyway."""
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "--log-level",
        "WARNING",
        "up",
        "--model",
        "tiny",
        "--mode",
        "colocated",
        "--port",
        str(free_port()),
        "--no-pin",
        "--num-kv-blocks",
        "64",
    ]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert "is serving" in up.stdout.readline()
        children = _children(up.pid)
        assert len(children) == 2, children
    finally:
        up.kill()
        up.wait()
    assert wait_until(lambda: all(_gone(c) for c in children), START_TIMEOUT_S), "children outlived the launcher"


def test_a_router_started_on_its_own_says_where_it_serves_and_its_nodes(tmp_path):
    ready = tmp_path / "node.json"
    pdserve = [sys.executable, "-m", "pdserve"]
    node = subprocess.Popen(
        [
            *pdserve,
            "--log-level",
            "WARNING",
            "colocated",
            "--engine",
            "mock",
            "--listen",
            "tcp://127.0.0.1:0",
            "--ready-file",
            str(ready),
        ]
    )
    router = None
    try:
        assert wait_until(ready.exists, timeout=START_TIMEOUT_S), "the node wrote no ready file"
        listen, port = json.loads(ready.read_text())["listen"], free_port()
        with open(tmp_path / "router.log", "w") as log:
            router = subprocess.Popen([*pdserve, "router", "--port", str(port), "--colocated", listen], stderr=log)

        def said() -> str:
            return (tmp_path / "router.log").read_text()

        wait_until(lambda: " ready" in said() or router.poll() is not None, timeout=START_TIMEOUT_S)
        says = f"router: ready: serving tiny at http://127.0.0.1:{port}/v1, over the nodes colocated {listen}"
        assert says in said(), said()
    finally:
        for proc in (router, node):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=START_TIMEOUT_S)


def test_a_router_whose_nodes_never_answer_says_so_in_one_line():
    nowhere = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    out = _pdserve(
        "--log-level",
        "WARNING",
        "router",
        "--port",
        str(free_port()),
        "--colocated",
        nowhere,
        "--connect-timeout-s",
        "1",
    )
    _refused(out, f"nodes did not answer within 1 s: colocated@{nowhere}")


def test_a_router_stopped_while_it_waits_for_its_nodes_exits_at_once_and_cleanly(tmp_path):
    nowhere, log = f"tcp://127.0.0.1:{free_port()}", tmp_path / "router.log"
    with open(log, "w") as err:
        router = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--port", str(free_port()), "--colocated", nowhere], stderr=err
        )
    try:
        waiting = wait_until(lambda: "for the nodes to answer" in log.read_text(), timeout=START_TIMEOUT_S)
        assert waiting, log.read_text()
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=START_TIMEOUT_S)  # it would wait 120 s for the nodes: an exit before that is the stop
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
    said = log.read_text()
    assert router.returncode == 0 and "Traceback" not in said, said
    assert "stopping: the router was stopped before its nodes answered" in said, said
