"""The decode node's background copier (kv/copier.py): bursts of copies out of a shared pool run on its thread, in
order, one batched copy a request, and wake whoever polls its socket; on a GPU (marked `gpu`) a copy started once the
writer's step is known done reads every block that step wrote, though its writer stream was busy until then."""

from __future__ import annotations

import pytest
import torch
import zmq

from pdserve.kv.copier import BlockCopier, Copy
from pdserve.kv.pool import FEW_RUNS, KVLayout, KVPool, kv_checksums
from pdserve.kv.transfer import ShmBackend
from tests.helpers import export_tokens

LAYOUT = KVLayout(3, 2, 8, 4, "float32", "fp")
WAIT_MS = 10_000


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _copy(key: str, dst: KVPool, src: KVPool, src_blocks: list[int], dst_blocks: list[int]) -> Copy:
    return Copy(key, lambda: dst.copy_blocks_from(src.data, src_blocks, dst_blocks), lambda: [len(dst_blocks)])


def test_copies_out_of_a_shared_pool_land_in_order_and_wake_the_poller(ctx):
    owner = ShmBackend()
    copier = BlockCopier(ctx)
    try:
        src = KVPool(LAYOUT, 16, data=owner.storage(LAYOUT, 16, "cpu"))
        src.data.copy_(torch.randn(src.data.shape))
        dst = KVPool(LAYOUT, 16)
        moves = {"run": ([4, 5, 6], [9, 10, 11]), "scattered": ([13, 2, 7], [0, 15, 3])}
        copier.submit([_copy(key, dst, src, s, d) for key, (s, d) in moves.items()])  # one burst
        two_runs = ([8, 9, 0, 1], [4, 5, 12, 13])  # consecutive in two runs on both sides: two slice copies
        copier.submit([_copy("two runs", dst, src, *two_runs)])
        copier.submit(
            [Copy("bad", lambda: dst.copy_blocks_from(src.data, [99], [1]), list), _copy("after", dst, src, [14], [14])]
        )
        assert copier.wake.poll(WAIT_MS), "a finished copy did not wake the poller"
        done = copier.wait_all()
        assert [c.key for c in done] == ["run", "scattered", "two runs", "bad", "after"] and copier.in_flight == 0
        for c, (s, d) in zip(done, [*moves.values(), two_runs], strict=False):
            assert c.error is None and c.started <= c.copied <= c.done and c.checksums == [len(d)]
            assert torch.equal(export_tokens(dst, d, 4 * len(d)), export_tokens(src, s, 4 * len(s)))
        assert done[0].done <= done[1].started, "a burst's copies run one after another, each checked once in"
        assert isinstance(done[3].error, IndexError | RuntimeError), "a failed copy is reported, not raised"
        assert done[4].error is None, "a failed copy fails its request alone"
    finally:
        copier.close()
        owner.close()


def test_a_copy_is_a_slice_per_run_up_to_a_few_runs_else_one_gather(monkeypatch):
    """Blocks consecutive on both sides in a few runs are copied slice by slice, in place; more runs than FEW_RUNS
    are gathered and scattered at once: both land the source's KV, and both are checked (`holds_copy`, the CRC-32s)
    the same way."""
    src, dst = KVPool(LAYOUT, 64), KVPool(LAYOUT, 64)
    src.data.copy_(torch.randn(src.data.shape))
    calls: list[str] = []
    for name in ("copy_", "index_copy_"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _m=method, _n=name, **k: calls.append(_n) or _m(t, *a, **k)
        )
    scattered = list(range(0, 2 * (FEW_RUNS + 1), 2))  # FEW_RUNS + 1 runs of one block
    for s, d, want in [
        ([8, 9, 0, 1], [4, 5, 12, 13], ["copy_", "copy_"]),  # two runs: two slice copies
        (scattered, list(range(40, 40 + len(scattered))), ["index_copy_"]),
    ]:
        calls.clear()
        dst.copy_blocks_from(src.data, s, d)
        assert calls == want
        assert torch.equal(export_tokens(dst, d, 4 * len(d)), export_tokens(src, s, 4 * len(s)))
        n = 4 * len(d)  # the copy is checked the same way, in place or gathered: it holds, with the sender's CRCs
        assert dst.holds_copy(src.data, s, d) and kv_checksums([(dst.data, d)], 4, n) == src.checksums(s, n)
        dst.data[..., d[-1] * 4, :] += 1  # one landed token wrong
        assert not dst.holds_copy(src.data, s, d) and kv_checksums([(dst.data, d)], 4, n) != src.checksums(s, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_copy_after_the_writers_step_reads_all_it_wrote(ctx):
    """The prefill node's order: its step writes the KV on its stream, then samples; the host waits for the sampled
    token (queued behind the writes) before it offers the blocks; the copy runs on the copier's stream."""
    src, dst = KVPool(LAYOUT, 64, device="cuda:0"), KVPool(LAYOUT, 64, device="cuda:0")
    copier = BlockCopier(ctx, "cuda:0")
    try:
        for round_ in range(5):
            writer = torch.cuda.Stream()
            with torch.cuda.stream(writer):
                busy = torch.randn(2048, 2048, device="cuda:0")
                for _ in range(30):  # keeps the writer's stream busy well past the host's next lines
                    busy = busy @ busy / 2048
                src.data.fill_(float(round_ + 1))
                token = src.data[0, 0, 0, :1, 0].to("cpu", non_blocking=True)  # the "sampled token", after the writes
                event = torch.cuda.Event()
                event.record(writer)
            event.synchronize()  # Engine.finish: the host has the token
            assert token.item() == round_ + 1
            blocks = list(range(0, 64, 3))
            copier.submit([_copy(f"r{round_}", dst, src, blocks, blocks[::-1])])
            [done] = copier.wait_all()
            assert done.error is None
            landed = export_tokens(dst, blocks[::-1], len(blocks) * LAYOUT.block_size)
            assert torch.all(landed == round_ + 1), "the copy read a block before the writer's step was done"
    finally:
        copier.close()
