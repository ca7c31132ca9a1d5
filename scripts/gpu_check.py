"""GPU check: disaggregated serving on CUDA, bf16, over zmq and cuda_ipc, in a few minutes.

    python scripts/gpu_check.py [--model small] [--requests 16] [--out results.json]

For each KV transport (zmq, cuda_ipc) it starts `pdserve up --mode disagg` with the prefill node and
the decode node as two processes on the GPU(s) (cuda:0 and cuda:1 when there are two, both on
cuda:0 otherwise), sends concurrent greedy requests, and checks every served token against
transformers on the same bf16 weights: replaying the served sequence, each served token's logit must
be within `--logit-tol` of the best logit at that position (bf16 rounding may flip near-ties, so exact
token equality is not required). It also reports the KV transfer bandwidth the prefill node measured
beside a device-to-device copy of the same size. Exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(model: str, transport: str, port: int, log_path: str) -> subprocess.Popen:
    decode_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    argv = [sys.executable, "-m", "pdserve", "up", "--model", model, "--mode", "disagg", "--dtype", "bfloat16",
            "--kv-transport", transport, "--prefill-device", "cuda:0", "--decode-device", decode_dev,
            "--port", str(port), "--kv-cache-gb", "1"]  # fmt: skip
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({proc.returncode}); see {log_path}")
        if "is serving" in open(log_path).read():
            return proc
        time.sleep(0.5)
    raise RuntimeError(f"the stack did not start; see {log_path}")


def stop_stack(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def serve_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        name = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(p):
            body = {"model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def logit_gaps(model, prompts, outputs) -> list[float]:
    """For each served token: best logit minus the served token's logit, replaying the sequence in HF."""
    gaps = []
    with torch.inference_mode():
        for p, out in zip(prompts, outputs, strict=True):
            ids = torch.tensor([p + out], device="cuda:0")
            logits = model(ids).logits[0, len(p) - 1 : -1].float()  # [len(out), V]
            served = logits.gather(1, torch.tensor(out, device="cuda:0")[:, None])[:, 0]
            gaps += (logits.max(-1).values - served).tolist()
    return gaps


def metric(text: str, name: str, role: str = "prefill") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'role="{role}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def d2d_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return nbytes * 10 / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--logit-tol", type=float, default=0.5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 2
    import transformers

    from pdserve.common.checkpoint import resolve_model

    path = resolve_model(a.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8000 if a.model == "small" else 500, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 1024, (a.requests,), generator=g)]  # fmt: skip
    report: dict = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "model": a.model}
    ok = True
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    for transport in ("zmq", "cuda_ipc"):
        port = free_port()
        proc = start_stack(a.model, transport, port, f"/tmp/gpu_check_{transport}.log")
        try:
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            outs = asyncio.run(serve_all(url, prompts, a.max_tokens))
            wall = time.perf_counter() - t0
            text = httpx.get(url + "/metrics").text
        finally:
            stop_stack(proc)
        gaps = logit_gaps(hf, prompts, outs)
        nbytes = metric(text, "pdserve:node_kv_transfer_bytes_total")
        secs = metric(text, "pdserve:node_kv_transfer_time_s_total")
        r = {
            "requests": len(outs),
            "tokens": sum(len(o) for o in outs),
            "wall_s": round(wall, 3),
            "max_logit_gap": round(max(gaps), 4),
            "tokens_within_tol": sum(g <= a.logit_tol for g in gaps) / len(gaps),
            "kv_transfers": metric(text, "pdserve:node_kv_transfers_total"),
            "kv_transfer_GBps": round(nbytes / secs / 1e9, 3) if secs else None,
        }
        r["pass"] = r["tokens_within_tol"] == 1.0 and r["kv_transfers"] >= len(outs)
        ok &= r["pass"]
        report[transport] = r
        print(transport, json.dumps(r), flush=True)
    report["d2d_copy_GBps"] = round(d2d_bandwidth(64 * 2**20), 1)
    report["pass"] = ok
    print(json.dumps(report, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
