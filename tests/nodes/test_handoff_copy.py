"""A shared pool's hand-off in-process: a prefill node and a decode node over shm, their loops driven by hand, the
decode node's steps slowed. The offer names the prompt's blocks; the decode node copies them on its copier thread
while a step runs (its recorded copy and step times overlap), the request then joins the batch through the engine's
usual admission, and the prefill node frees its blocks only once the decode node's KvAck says the copy is done."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.config import EngineConfig, NodeConfig
from pdserve.engine.request import Status
from pdserve.kv.layout import KVLayout
from pdserve.kv.pool import KVPool, kv_checksums
from pdserve.kv.transfer import ShmBackend
from pdserve.nodes.decode import JOIN_PARTS, DecodeNode
from pdserve.nodes.prefill import PrefillNode
from pdserve.router.metrics import NodeCollector
from pdserve.wire.messages import Generate, KvAck, KvOffer
from pdserve.wire.params import SamplingParams
from tests.helpers import export_tokens
from tests.nodes.test_node_states import PROMPT, FakeRouter

SLOW_STEP_S = 0.2  # a decode step's extra time
SLOW_COPY_S = 0.1  # a copy's (as a large prompt's would take): it outlasts the prefill node's turn in the loop below
MAX_LOOPS = 400


@pytest.fixture
def nodes(tiny_models):
    engine = EngineConfig(model=str(tiny_models["qwen3"]), num_kv_blocks=32)
    prefill = PrefillNode(NodeConfig("prefill", engine, kv_transport="shm", kv_lease_s=60.0))
    decode = DecodeNode(NodeConfig("decode", engine, kv_transport="shm"))
    yield prefill, decode
    decode.close()
    prefill.close()


def _offer_until_copied(p_router, prefill, decode) -> None:
    """Send "r1" through the prefill node and run both nodes until the decode node has copied its KV."""
    p_router.send(Generate("r1", PROMPT, SamplingParams(max_tokens=4, temperature=0), decode_addr=decode.kv_addr))
    for _ in range(MAX_LOOPS):
        prefill.loop_once()
        decode.loop_once()
        if decode.counters["kv_copies"]:
            break


def _slowed(obj, name: str, delay_s: float, monkeypatch) -> None:
    real = getattr(obj, name)

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, slow)


def test_the_copy_runs_beside_a_step_and_the_prefill_blocks_wait_for_its_ack(nodes, monkeypatch):
    prefill, decode = nodes
    decode.copy_beside_steps = True  # as on a GPU, whose launch returns before the step is computed
    p_router, d_router = FakeRouter(prefill), FakeRouter(decode)
    d_router.send(Generate("busy", [3, 4, 5], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
    _slowed(decode.engine.runner, "run", SLOW_STEP_S, monkeypatch)  # it has a request running, so it steps
    _slowed(decode.engine, "receive_kv", SLOW_COPY_S, monkeypatch)  # run by the copier's thread
    seen: list[tuple[str, float]] = []  # what the prefill node did with r1, in order
    offers: list[KvOffer] = []
    handle_kv, release = prefill.handle_kv, prefill.engine.release

    def spy_handle(peer, msg, frames):
        if isinstance(msg, KvAck) and msg.request_id == "r1":
            seen.append(("ack", time.perf_counter()))
        handle_kv(peer, msg, frames)

    def spy_release(req, status):
        if req.request_id == "r1":
            kv = export_tokens(prefill.engine.pool, req.block_ids, len(PROMPT))
            seen.append(("freed", time.perf_counter()))
            held.append(kv.clone())
        release(req, status)

    decode_offer = decode._on_offer

    def spy_offer(peer, offer):
        offers.append(offer)
        decode_offer(peer, offer)

    held: list[torch.Tensor] = []
    monkeypatch.setattr(prefill, "handle_kv", spy_handle)
    monkeypatch.setattr(prefill.engine, "release", spy_release)
    monkeypatch.setattr(decode, "_on_offer", spy_offer)
    # the prefill node's socket to the decode node dispatches to handle_kv through a lambda made at connect time
    p_router.send(Generate("r1", PROMPT, SamplingParams(max_tokens=4, temperature=0), decode_addr=decode.kv_addr))
    for _ in range(MAX_LOOPS):
        prefill.loop_once()
        decode.loop_once()
        if decode.handoff["handoff_join"].count:
            break
    assert decode.handoff["handoff_join"].count == 1, decode.counters
    for _ in range(20):  # the ack reaches the prefill node
        prefill.loop_once()
        if "r1" not in prefill.transfers:
            break

    [offer] = offers
    assert offer.kv is not None and offer.kv.src_blocks, "the offer named no blocks"
    assert len(offer.kv.kv_checksums) == 1, "the offer carries the CRC-32 of the last layer only"
    [copy] = [c for c in decode.copies if c.key == "r1"]
    assert copy.error is None and decode.counters["kv_bad"] == 0  # the checksums of what landed matched
    assert decode.counters["kv_copies"] == decode.counters["kv_copies_overlapped"] == 1
    assert any(s < copy.done and e > copy.started for s, e in decode.launches), "no step ran while the copy did"
    assert [what for what, _ in seen] == ["ack", "freed"], seen
    assert seen[1][1] > copy.done, "the prefill node freed its blocks before the copy was done"
    landed = export_tokens(decode.engine.pool, decode.engine.requests["r1"].block_ids, len(PROMPT))
    assert torch.equal(landed, held[0]), "the decode node's KV is not the prefill node's"
    assert decode.engine.requests["r1"].status is Status.RUNNING  # it joined the batch as any request does
    assert prefill.engine.kv_stats()[0] == 0
    _the_router_shows_the_parts(decode, copy)


def _the_router_shows_the_parts(decode: DecodeNode, copy) -> None:
    """The hand-off's parts reach the router's /metrics as histograms through the node's Stats."""
    node = SimpleNamespace(role="decode", addr="d0", up=True, stats=decode.stats(), reports=1)
    registry = CollectorRegistry()
    registry.register(NodeCollector([node]))
    labels = {"role": "decode", "node": "d0"}
    value = registry.get_sample_value
    assert value("pdserve:node_handoff_copy_seconds_count", labels) == 1
    assert value("pdserve:node_handoff_copy_seconds_sum", labels) == pytest.approx(copy.copied - copy.started)
    assert value("pdserve:node_handoff_copy_seconds_bucket", {**labels, "le": "0.05"}) == 0  # slowed to SLOW_COPY_S
    assert value("pdserve:node_handoff_copy_seconds_bucket", {**labels, "le": "+Inf"}) == 1
    for part in ("wait", "check", "join"):
        assert value(f"pdserve:node_handoff_{part}_seconds_count", labels) == 1


def test_on_the_cpu_a_copy_lands_before_the_next_step_and_its_request_joins_it(nodes):
    """A CPU engine computes its step in launch(): the node waits for the copies it just started, so the request
    joins the very next step (not the one after the step its copy ran beside)."""
    prefill, decode = nodes
    assert not decode.copy_beside_steps
    p_router, d_router = FakeRouter(prefill), FakeRouter(decode)
    d_router.send(Generate("busy", [3, 4, 5], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
    _offer_until_copied(p_router, prefill, decode)
    assert decode.counters["kv_copies"] == 1 and decode.counters["kv_copies_overlapped"] == 0, decode.counters
    assert decode.engine.requests["r1"].status is Status.WAITING  # landed in the loop that reserved its blocks
    assert decode.handoff["handoff_join"].count == 0
    decode.loop_once()
    assert decode.handoff["handoff_join"].count == 1  # decoded in the next step
    # the join in parts, from the step that ran it: admitted, then that step's launch, then its token out
    assert all(decode.handoff[name].count == 1 for name in JOIN_PARTS), {n: decode.handoff[n].count for n in JOIN_PARTS}
    copy = decode.copies[-1]
    start, end = next((s, e) for s, e in decode.launches if s >= copy.landed)
    assert copy.done <= copy.landed <= start <= end
    assert decode.engine.requests["r1"].status is Status.RUNNING


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checksums_of_a_prompt_split_over_two_pools_are_those_of_one_pool(dtype):
    """A decode node checks a copy whose first blocks came from its prefix cache against the sender's checksums of
    the whole prompt: the cached blocks as the sender holds them, the rest as they landed here; in every KV dtype
    (numpy has no bfloat16: the bytes are read as integers)."""
    owner = ShmBackend()
    try:
        layout = KVLayout(2, 2, 8, 4, dtype, "t")
        src = KVPool(layout, 8, data=owner.storage(layout, 8, "cpu"))
        src.data.copy_(torch.randn(src.data.shape))
        dst = KVPool(layout, 8)
        src_blocks, num_tokens = [6, 1, 3, 4], 14
        dst.copy_blocks_from(src.data, src_blocks[2:], [0, 5])
        whole = src.checksums(src_blocks, num_tokens)
        assert kv_checksums([(src.data, src_blocks[:2]), (dst.data, [0, 5])], layout.block_size, num_tokens) == whole
        assert dst.checksums_after((src.data, src_blocks[:2]), [0, 5], num_tokens) == whole
        assert dst.checksums_after((src.data, src_blocks[:2]), [0, 5], num_tokens, [1]) == whole[1:]  # a layer
        assert dst.holds_copy(src.data, src_blocks[2:], [0, 5])
        many = list(range(0, 8, 2))  # four runs of one block
        dst.copy_blocks_from(src.data, many, [1, 2, 3, 4])
        assert dst.holds_copy(src.data, many, [1, 2, 3, 4])
        dst.data[..., 5 * 4, :] += 1  # one landed token wrong
        assert dst.checksums_after((src.data, src_blocks[:2]), [0, 5], num_tokens) != whole
        assert not dst.holds_copy(src.data, src_blocks[2:], [0, 5])
    finally:
        owner.close()


def test_a_burst_of_offers_is_one_job_and_each_request_is_checked_on_its_own(nodes, monkeypatch):
    """Offers taken together go to the copier as one burst; each request's landed KV is checked on its own: one whose
    offer names a wrong block (copied faithfully, but its last layer's CRC-32 is not the offer's) fails alone, the
    other decodes."""
    prefill, decode = nodes
    p_router = FakeRouter(prefill)
    bursts: list[list[str]] = []
    submit = decode.copier.submit

    def spy_submit(burst):
        bursts.append([c.key for c in burst])
        submit(burst)

    monkeypatch.setattr(decode.copier, "submit", spy_submit)
    taken: list[str] = []
    decode_offer = decode._on_offer

    def spy_offer(peer, offer):
        taken.append("offer")
        if offer.request_id == "bad":  # a damaged offer: its second block is another one of the pool
            src = list(offer.kv.src_blocks)
            offer = dataclasses.replace(offer, kv=dataclasses.replace(offer.kv, src_blocks=[src[0], src[1] + 5]))
        decode_offer(peer, offer)

    monkeypatch.setattr(decode, "_on_offer", spy_offer)
    failed: list[str] = []
    kv_failed = decode._kv_failed
    monkeypatch.setattr(decode, "_kv_failed", lambda inc, why: (failed.append(why), kv_failed(inc, why)))
    for rid, prompt in (("good", PROMPT), ("bad", [t + 1 for t in PROMPT])):
        p_router.send(Generate(rid, prompt, SamplingParams(max_tokens=4, temperature=0), decode_addr=decode.kv_addr))
    for _ in range(MAX_LOOPS):  # the decode node only reads its KV socket: both offers are in before it reserves
        prefill.loop_once()
        decode.drain(decode.kv_sock)
        if len(taken) == 2:
            break
    assert taken == ["offer", "offer"], taken
    assert not decode.copies
    decode.tick()  # reserves both, copies them (one burst), checks each
    assert bursts == [["good", "bad"]], bursts
    assert decode.counters["kv_copies"] == 2 and decode.counters["kv_bad"] == 1, decode.counters
    assert failed == [f"KV checksum mismatch in layer {decode.engine.layout.num_layers - 1}"], failed  # the last
    assert decode.engine.requests["good"].status is Status.WAITING  # landed, joins the next step
    assert decode.engine.requests["bad"].num_computed_tokens == 0  # recomputes its prompt here (--kv-failure)


def test_a_copy_that_landed_wrong_in_any_layer_is_never_decoded_from(nodes, monkeypatch):
    """Every layer copied is compared with the prefill pool's blocks: a copy whose first layer landed wrong (its last
    layer, which the offer's CRC-32 covers, right) fails its check and the request recomputes its prompt here."""
    prefill, decode = nodes
    p_router = FakeRouter(prefill)
    receive = decode.engine.receive_kv

    def damaged(req, backend, header, frames, source):
        layers = receive(req, backend, header, frames, source)
        decode.engine.pool.data[0, 0, 0, req.block_ids[0] * 16, 0] += 1  # layer 0, K, head 0, the first token
        return layers

    monkeypatch.setattr(decode.engine, "receive_kv", damaged)
    _offer_until_copied(p_router, prefill, decode)
    [copy] = [c for c in decode.copies if c.key == "r1"]
    assert copy.error is not None and "differs" in str(copy.error), copy.error
    assert decode.counters["kv_bad"] == 1 and decode.counters["kv_recomputed"] == 1, decode.counters
    assert decode.engine.requests["r1"].num_computed_tokens == 0  # recomputes its prompt, never decodes from the copy
