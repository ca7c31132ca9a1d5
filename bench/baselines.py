"""In-process peers on the same checkpoint folder: Hugging Face static and continuous batching.

Both load the checkpoint with `AutoModelForCausalLM` (sdpa attention), in float32 on the CPU by
default, on the thread budget the caller sets (`torch.set_num_threads`), the cores a colocated
pdserve node gets; the GPU benchmark (bench/gpu.py) loads them in bf16 on a CUDA device.

Static batching (tinyorca's baseline): requests are taken FCFS, up to `max_batch` of those that have
arrived, left-padded to the longest prompt, and run by `generate` greedily for the batch's longest
output (`min_new_tokens` = `max_new_tokens`, so every row runs the same number of steps, as HF static
batching does). It does not stream: every request of a batch is delivered when the batch ends, so
its TTFT is its E2E and it has no TPOT. Only each request's own `output_len` tokens count as output.

Continuous batching: transformers' `ContinuousBatchingManager` (`model.init_continuous_batching`),
fed one `add_request` per request at its arrival time with its own `max_new_tokens`, EOS disabled
(`eos_token_id=-1`), and `record_timestamps=True`, which stamps every generated token as the
background loop produces it: those stamps are the token times. Each iteration is capped at
`max_batch` requests (`max_requests_per_batch`: per iteration, whereas pdserve's `max_num_seqs` caps
the running set) and `max_batch_tokens` tokens (pdserve's token budget; longer prompts are split);
the paged cache holds `kv_cache_gb` of KV, like pdserve's pool. Prefix sharing and async batching are
off (random prompts share nothing), and CUDA graphs unless asked for. With `max_concurrency`, a
request is added only once fewer than that many are in the manager (its TTFT counts from then, as
over HTTP). `generate_batch` would take one `max_new_tokens` for all its inputs and no arrival times,
hence the manager (which `generate_batch` runs too). The manager's config is built from the fields
this transformers version has (the page size is `block_size` in 5.17, `page_size` in 5.24).

Both take an optional `run_timeout_s`: requests not finished that long after the run's start are
reported as failed (static batching starts no batch after it; the manager cancels them).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from pathlib import Path

import torch
from tqdm import tqdm

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest, Workload

RESULT_POLL_S = 1.0
STALL_TIMEOUT_S = 600.0  # no request finishing for this long: give up on the rest


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    return model.to(device).eval()


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.perf_counter()))


# ---- static batching -------------------------------------------------------------------------------


def _next_batch(pending: deque[BenchRequest], t0: float, max_batch: int) -> list[BenchRequest]:
    """FCFS: wait for the oldest request, then take every arrived one, up to `max_batch`."""
    _sleep_until(t0 + pending[0].arrival_s)
    now = time.perf_counter() - t0
    batch = []
    while pending and len(batch) < max_batch and pending[0].arrival_s <= now:
        batch.append(pending.popleft())
    return batch


def _left_pad(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def generate_static(model, batch: list[BenchRequest]) -> list[list[int]]:
    """One left-padded greedy `generate` over `batch`; each request's own output_len tokens."""
    from transformers import GenerationConfig

    pad_id = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    ids, mask = (t.to(model.device) for t in _left_pad([r.prompt_token_ids for r in batch], pad_id))
    steps = max(r.output_len for r in batch)
    cfg = GenerationConfig(
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=model.config.eos_token_id,
    )
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)  # [B, P + steps]
    new = out[:, ids.shape[1] :]  # [B, steps]
    return [new[i, : r.output_len].tolist() for i, r in enumerate(batch)]


def run_static(
    model,
    workload: Workload,
    max_batch: int,
    desc: str = "",
    progress: bool = True,
    run_timeout_s: float | None = None,
):
    """Static batching over `workload`; return (t0, records in workload order)."""
    pending = deque(workload.requests)
    records: dict[int, RequestRecord] = {}
    index = {id(r): i for i, r in enumerate(workload.requests)}
    with tqdm(total=len(pending), desc=desc or workload.label, unit="req", disable=not progress) as bar:
        t0 = time.perf_counter()
        while pending and (run_timeout_s is None or time.perf_counter() - t0 < run_timeout_s):
            batch = _next_batch(pending, t0, max_batch)
            outputs = generate_static(model, batch)
            end = time.perf_counter()
            for req, toks in zip(batch, outputs, strict=True):
                records[index[id(req)]] = RequestRecord(
                    t0 + req.arrival_s, req.output_len, len(req.prompt_token_ids), [end] * len(toks), toks, False
                )
            bar.update(len(batch))
    for req in pending:  # past the time limit
        records[index[id(req)]] = _missing(req, t0, "the run's time limit passed before its batch started")
    return t0, [records[i] for i in range(len(records))]


# ---- Hugging Face continuous batching --------------------------------------------------------------


def kv_bytes_per_token(config, itemsize: int = 4) -> int:
    """Bytes of K and V of one token over every layer, at `itemsize` bytes per element."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


def _kv_blocks(model, kv_cache_gb: float, page_size: int) -> int:
    """How many `page_size`-token blocks (every layer) fit in `kv_cache_gb`, pdserve's KV pool budget."""
    per_token = kv_bytes_per_token(model.config, model.dtype.itemsize)
    return max(1, int(kv_cache_gb * 2**30) // (per_token * page_size))


def cb_config(fields: dict):
    """transformers' ContinuousBatchingConfig from `fields`, each under the name this version knows."""
    import inspect

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    known = inspect.signature(ContinuousBatchingConfig).parameters
    if "page_size" in fields and "page_size" not in known:
        fields = {("block_size" if k == "page_size" else k): v for k, v in fields.items()}
    missing = sorted(set(fields) - set(known))
    if missing:
        raise ValueError(f"this transformers' ContinuousBatchingConfig lacks {', '.join(missing)}")
    return ContinuousBatchingConfig(**fields)


def cb_manager(model, max_batch: int, max_batch_tokens: int, kv_cache_gb: float, cuda_graphs: bool = False):
    from transformers import GenerationConfig

    page_size = 256  # transformers' default
    cb = cb_config(
        {
            "page_size": page_size,
            "num_blocks": _kv_blocks(model, kv_cache_gb, page_size),
            "max_batch_tokens": max_batch_tokens,
            "max_requests_per_batch": max_batch,
            "allow_block_sharing": False,
            "use_cuda_graph": cuda_graphs,
            "use_async_batching": False,
        }
    )
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


class _Slots:
    """At most `limit` requests in the manager (no limit: None); `stop` wakes a waiting submitter."""

    def __init__(self, limit: int | None) -> None:
        self.sem = threading.Semaphore(limit) if limit else None
        self.stop = threading.Event()
        self.added: list[str] = []  # request ids handed to the manager

    def acquire(self) -> bool:
        while self.sem is not None and not self.sem.acquire(timeout=RESULT_POLL_S):
            if self.stop.is_set():
                return False
        return not self.stop.is_set()

    def release(self) -> None:
        if self.sem is not None:
            self.sem.release()


def _submit(manager, workload: Workload, ids: list[str], t0: float, slots: _Slots) -> None:
    for rid, req in zip(ids, workload.requests, strict=True):
        _sleep_until(t0 + req.arrival_s)
        if not slots.acquire():
            return
        manager.add_request(
            list(req.prompt_token_ids),
            request_id=rid,
            max_new_tokens=req.output_len,
            eos_token_id=-1,
            record_timestamps=True,
        )
        slots.added.append(rid)


def _record(out, req: BenchRequest) -> RequestRecord:
    rec = RequestRecord(
        out.created_time,
        req.output_len,
        len(req.prompt_token_ids),
        list(out.timestamps or []),
        list(out.generated_tokens),
    )
    rec.error = str(out.error) if out.error else ""
    rec.check_length()
    return rec


def _collect(manager, by_id: dict[str, BenchRequest], bar: tqdm, slots: _Slots, end: float) -> dict[str, RequestRecord]:
    records: dict[str, RequestRecord] = {}
    last = time.monotonic()
    while len(records) < len(by_id) and time.monotonic() - last < STALL_TIMEOUT_S and time.perf_counter() < end:
        out = manager.get_result(timeout=RESULT_POLL_S)
        if out is None:
            if not manager.is_running():
                break  # the background loop died; the missing requests are reported as failed
            continue
        if out.is_finished() and out.request_id in by_id:
            records[out.request_id] = _record(out, by_id[out.request_id])
            last = time.monotonic()
            slots.release()
            bar.update(1)
    return records


CB_MISSING = "the continuous batching loop stopped, stalled or ran past the time limit before this request finished"


def _missing(req: BenchRequest, t0: float, why: str = CB_MISSING) -> RequestRecord:
    return RequestRecord(t0 + req.arrival_s, req.output_len, len(req.prompt_token_ids), error=why)


def run_hf_cb(
    manager,
    workload: Workload,
    desc: str = "",
    progress: bool = True,
    max_concurrency: int | None = None,
    run_timeout_s: float | None = None,
):
    """Drive a started manager with `workload`; return (t0, records in workload order)."""
    run = uuid.uuid4().hex[:8]  # fresh ids, so a manager can serve several runs
    ids = [f"{workload.label}-{run}-{i}" for i in range(len(workload.requests))]
    slots = _Slots(max_concurrency)
    with tqdm(total=len(ids), desc=desc or workload.label, unit="req", disable=not progress) as bar:
        t0 = time.perf_counter()
        end = t0 + run_timeout_s if run_timeout_s is not None else float("inf")
        submitter = threading.Thread(target=_submit, args=(manager, workload, ids, t0, slots), daemon=True)
        submitter.start()
        records = _collect(manager, dict(zip(ids, workload.requests, strict=True)), bar, slots, end)
        slots.stop.set()
        submitter.join()
    for rid in set(slots.added) - set(records):
        manager.cancel_request(rid)  # past the time limit: the manager drops what it still holds
    return t0, [records.get(rid) or _missing(r, t0) for rid, r in zip(ids, workload.requests, strict=True)]
