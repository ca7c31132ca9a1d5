"""In-process peers on the same checkpoint folder: Hugging Face static and continuous batching.

Both load the checkpoint with `AutoModelForCausalLM` in float32 (sdpa attention) and run on the
thread budget the caller sets (`torch.set_num_threads`), the cores a colocated pdserve node gets.

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
the paged cache holds `kv_cache_gb` of KV, like pdserve's pool. Prefix sharing, CUDA graphs and async
batching are off (random prompts share nothing; this is a CPU). `generate_batch` would take one
`max_new_tokens` for all its inputs and no arrival times, hence the manager.
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


def load_hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


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
    ids, mask = _left_pad([r.prompt_token_ids for r in batch], pad_id)
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


def run_static(model, workload: Workload, max_batch: int, desc: str = "", progress: bool = True):
    """Static batching over `workload`; return (t0, records in workload order)."""
    pending = deque(workload.requests)
    records: dict[int, RequestRecord] = {}
    index = {id(r): i for i, r in enumerate(workload.requests)}
    with tqdm(total=len(pending), desc=desc or workload.label, unit="req", disable=not progress) as bar:
        t0 = time.perf_counter()
        while pending:
            batch = _next_batch(pending, t0, max_batch)
            outputs = generate_static(model, batch)
            end = time.perf_counter()
            for req, toks in zip(batch, outputs, strict=True):
                records[index[id(req)]] = RequestRecord(
                    t0 + req.arrival_s, req.output_len, len(req.prompt_token_ids), [end] * len(toks), toks, False
                )
            bar.update(len(batch))
    return t0, [records[i] for i in range(len(records))]


# ---- Hugging Face continuous batching --------------------------------------------------------------


def kv_bytes_per_token(config) -> int:
    """Bytes of float32 K and V of one token over every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4


def _kv_blocks(model, kv_cache_gb: float, page_size: int) -> int:
    """How many `page_size`-token blocks (every layer) fit in `kv_cache_gb`, pdserve's KV pool budget."""
    return max(1, int(kv_cache_gb * 2**30) // (kv_bytes_per_token(model.config) * page_size))


def cb_manager(model, max_batch: int, max_batch_tokens: int, kv_cache_gb: float):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page_size = 256  # transformers' default
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=_kv_blocks(model, kv_cache_gb, page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_batch,
        allow_block_sharing=False,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def _submit(manager, workload: Workload, ids: list[str], t0: float) -> None:
    for rid, req in zip(ids, workload.requests, strict=True):
        _sleep_until(t0 + req.arrival_s)
        manager.add_request(
            list(req.prompt_token_ids),
            request_id=rid,
            max_new_tokens=req.output_len,
            eos_token_id=-1,
            record_timestamps=True,
        )


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


def _collect(manager, by_id: dict[str, BenchRequest], bar: tqdm) -> dict[str, RequestRecord]:
    records: dict[str, RequestRecord] = {}
    last = time.monotonic()
    while len(records) < len(by_id) and time.monotonic() - last < STALL_TIMEOUT_S:
        out = manager.get_result(timeout=RESULT_POLL_S)
        if out is None:
            if not manager.is_running():
                break  # the background loop died; the missing requests are reported as failed
            continue
        if out.is_finished() and out.request_id in by_id:
            records[out.request_id] = _record(out, by_id[out.request_id])
            last = time.monotonic()
            bar.update(1)
    return records


def _missing(req: BenchRequest, t0: float) -> RequestRecord:
    return RequestRecord(
        t0 + req.arrival_s,
        req.output_len,
        len(req.prompt_token_ids),
        error="the continuous batching loop stopped or stalled before this request finished",
    )


def run_hf_cb(manager, workload: Workload, desc: str = "", progress: bool = True):
    """Drive a started manager with `workload`; return (t0, records in workload order)."""
    run = uuid.uuid4().hex[:8]  # fresh ids, so a manager can serve several runs
    ids = [f"{workload.label}-{run}-{i}" for i in range(len(workload.requests))]
    with tqdm(total=len(ids), desc=desc or workload.label, unit="req", disable=not progress) as bar:
        t0 = time.perf_counter()
        submitter = threading.Thread(target=_submit, args=(manager, workload, ids, t0), daemon=True)
        submitter.start()
        records = _collect(manager, dict(zip(ids, workload.requests, strict=True)), bar)
        submitter.join()
    return t0, [records.get(rid) or _missing(r, t0) for rid, r in zip(ids, workload.requests, strict=True)]
