"""The persistent batch (engine/rows.py): the row interface by itself, and the scheduler's use of it (a steady
decode step writes no row; a step writes only the rows of the requests that joined, left or grew a block), and the
runner's gathered inputs against its list-built ones."""

from __future__ import annotations

import numpy as np

from pdserve.engine.request import Request, Status
from pdserve.engine.rows import BatchRows
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.block_allocator import BlockAllocator
from pdserve.wire.params import SamplingParams
from tests.helpers import take_tokens

BS = 4


def request(rid: str, prompt: int, max_tokens: int = 64) -> Request:
    return Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_rows_add_grow_remove_and_tokens():
    rows = BatchRows(2, width=2)
    a, b = request("a", 5), request("b", 3)
    a.block_ids, b.block_ids = [7, 8], [3]
    ra, rb = rows.add(a), rows.add(b)
    assert (ra, rb) == (0, 1) and len(rows) == 2 and rows.writes == 2
    assert rows.table[ra, :2].tolist() == [7, 8] and rows.last[ra] == 14 and rows.last[rb] == 12
    a.block_ids.append(9)  # wider than the table: it doubles
    rows.grow(a)
    assert rows.table.shape[1] == 4 and rows.table[ra, :3].tolist() == [7, 8, 9] and rows.table[rb, 0] == 3
    rows.grow(a)  # nothing new: no write
    assert rows.writes == 3
    owners = rows.owner[[ra, rb]].copy()
    rows.remove(a)  # its row is cleared: no stale block id left in reach
    assert rows.table[ra].tolist() == [0, 0, 0, 0] and a not in rows and rows.writes == 4
    c = request("c", 2)
    c.block_ids = [5]
    assert rows.add(c) == ra  # the freed row, to a new owner
    rows.take_tokens(np.array([ra, rb]), owners, np.array([99, 42]))  # a step launched before a left
    assert rows.last[ra] == 11 and rows.last[rb] == 42  # c keeps its own last token; b learns its token


def test_a_row_owns_its_requests_counters_while_it_runs():
    """`num_computed_tokens` and `num_pending` move into the row at add (the row's arrays are then the ones counted,
    and the request reads and writes them there) and back to the request at remove."""
    rows, req = BatchRows(2), request("a", 5)
    req.num_computed_tokens, req.num_pending = 3, 0
    row = rows.add(req)
    assert req.row == (rows, row) and (rows.num_computed_tokens[row], rows.num_pending[row]) == (3, 0)
    rows.num_computed_tokens[row] += 2  # a step counted over the rows
    rows.num_pending[row] += 1
    assert (req.num_computed_tokens, req.num_pending) == (5, 1)
    req.num_pending -= 1  # a write through the request lands in the row
    assert rows.num_pending[row] == 0
    rows.remove(req)
    rows.num_computed_tokens[row] = 99  # the row's next owner, say
    assert req.row is None and (req.num_computed_tokens, req.num_pending) == (5, 0)
    assert type(req.num_computed_tokens) is int


def test_a_steady_step_writes_no_row():
    """Requests decoding within their blocks: the scheduler writes no row; one crossing into a new block writes its
    row once; one that ends frees its row; a new one takes a row at admission."""
    s = Scheduler(BlockAllocator(64, BS), max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [request(f"r{i}", 5) for i in range(3)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()  # the prompts: every request joins, one row each
    assert s.rows.writes == 3 and sorted(batch.rows) == [0, 1, 2]
    s.advance(batch)
    take_tokens(s, reqs, [1] * 3)
    writes = s.rows.writes
    batch = s.schedule()  # positions 5 of blocks [0, 8): no block grows
    assert s.rows.writes == writes and all(x.num_new_tokens == 1 for x in batch.scheduled)
    s.advance(batch)
    for _ in range(2):  # positions 6, 7: still in their second block
        take_tokens(s, reqs, [1] * 3)
        s.advance(s.schedule())
    assert s.rows.writes == writes
    take_tokens(s, reqs, [1] * 3)
    s.advance(s.schedule())  # position 8: each request grows a block, each row is written once
    assert s.rows.writes == writes + 3
    s.finish(reqs[0], Status.FINISHED)
    late = request("late", 2)
    s.add(late)
    batch = s.schedule()
    assert s.rows.writes == writes + 5 and reqs[0] not in s.rows and s.rows.row_of[late] in batch.rows


def test_gathered_inputs_equal_the_flattened_ones():
    """A mixed step (decodes, a prompt chunk after a past, a new prompt): the rows' vectorised gathers give the
    values the per-request lists give."""
    from pdserve.runner.backends import StepInputs
    from pdserve.runner.model import ModelRunner

    s = Scheduler(BlockAllocator(64, BS), max_num_seqs=4, max_num_batched_tokens=12)
    first = [request("a", 3), request("b", 14)]
    for r in first:
        s.add(r)
    batch = s.schedule()  # a's prompt, b's first 9 tokens
    s.advance(batch)
    first[0].output_token_ids.append(77)  # a's token, taken in as the engine does: by its row
    row = np.array([s.rows.row_of[first[0]]])
    s.rows.take_tokens(row, s.rows.owner[row], np.array([77]))
    s.add(request("c", 6))
    batch = s.schedule()  # a decodes, b's last 5, c's first 6
    assert [x.num_new_tokens for x in batch.scheduled] == [1, 5, 6]
    got = ModelRunner.gather(batch, BS)
    want = StepInputs.of_chunks(*ModelRunner.flatten(batch, BS), BS)
    for name in ("ids", "positions", "slots", "sample", "q_start", "q_len", "past"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    width = want.tables.shape[1]
    assert got.tables[:, :width].tolist() == want.tables.tolist()


def test_a_steady_step_takes_its_tokens_in_bulk(monkeypatch):
    """Decoding requests that go on: the scheduler schedules them from the rows (`_steady`: no ScheduledRequest is
    made for any), and the engine takes a step's tokens in from the rows, looking at no request one by one
    (`Engine.take_token`); only a request's first token, and the request whose stop token or max_tokens comes, are
    looked at, and those end as they would one by one."""
    import pdserve.engine.scheduler as scheduler_mod
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.mock import mock_parts, mock_tokens
    from pdserve.wire.params import FinishReason

    made: list[int] = []  # the step of each ScheduledRequest made

    class Counted(scheduler_mod.ScheduledRequest):
        def __new__(cls, *args):
            made.append(n)
            return super().__new__(cls, *args)

    monkeypatch.setattr(scheduler_mod, "ScheduledRequest", Counted)

    cfg = EngineConfig(model="tiny", max_num_seqs=8, mock_step_s=(0.0, 0.0, 0.0), block_size=BS)
    engine = Engine(cfg, mock_parts(cfg, False))
    looked: list[tuple[int, str]] = []
    take_token = Engine.take_token
    monkeypatch.setattr(
        Engine, "take_token", lambda e, req, *a: looked.append((n, req.request_id)) or take_token(e, req, *a)
    )
    prompts = {f"r{i}": list(range(10 + i, 15 + i)) for i in range(4)}
    stop = mock_tokens(prompts["r1"], 12)[6]  # r1 stops at this token's first coming
    stop_at = mock_tokens(prompts["r1"], 12).index(stop) + 1
    params = {
        "r0": SamplingParams(max_tokens=12, temperature=0),
        "r1": SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,)),
        "r2": SamplingParams(max_tokens=4, temperature=0),
        "r3": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, eos_token_ids=(stop,)),
    }
    for rid, prompt in prompts.items():
        engine.add(Request(rid, prompt, params[rid]))
    outs: dict[str, list] = {rid: [] for rid in prompts}
    n = 1
    while engine.has_work():
        for o in engine.step():
            outs[o.request.request_id].append((o.token_id, o.finish_reason))
        n += 1
    for rid, prompt in prompts.items():
        want = mock_tokens(prompt, {"r1": stop_at, "r2": 4}.get(rid, 12))
        assert [t for t, _ in outs[rid]] == want, rid
        assert [r for _, r in outs[rid]] == [None] * (len(want) - 1) + [
            FinishReason.STOP if rid == "r1" else FinishReason.LENGTH
        ]
    firsts = [(1, rid) for rid in prompts]  # the first tokens (the prompt's scores would come with them)
    assert looked == firsts + sorted([(4, "r2"), (stop_at, "r1")]) + [(12, "r0"), (12, "r3")]
    assert made == [1] * 4 and engine.scheduler.steady_steps == 11  # the prompts' step alone, one by one
