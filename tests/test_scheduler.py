"""Scheduler: token budget, admission, chunked prefill, preemption, priorities, abort, fork,
recompute mode. The engine is simulated: each sequence scheduled with sample=True gets one
token appended, and requests that reach max_tokens are finished. Pure Python, no model."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import pytest

from kvloop.batch import ScheduledSeq, SchedulerOutput
from kvloop.errors import PromptTooLongError
from kvloop.kv_cache import KVCacheManager
from kvloop.params import SamplingParams
from kvloop.request import Request, RequestStatus
from kvloop.scheduler import Scheduler, SchedulerConfig

BS = 4  # block size used throughout
_token_base = itertools.count(1000, 1000)  # distinct prompts: no accidental prefix hits
_arrival = itertools.count()


def make_scheduler(num_blocks: int = 64, *, budget: int = 64, max_num_seqs: int = 8,
                   use_cache: bool = True, prefix_caching: bool = True,
                   watermark: float = 0.0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching,
                        watermark=watermark)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, use_cache), kv)


def make_request(rid: str, prompt_len: int = 0, max_tokens: int = 4, priority: int = 0,
                 prompt: list[int] | None = None, arrival: float | None = None) -> Request:
    if prompt is None:
        base = next(_token_base)
        prompt = list(range(base, base + prompt_len))
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
    # Explicit, strictly increasing arrival times: ties in perf_counter cannot blur the order.
    req.metrics.arrival_time = float(next(_arrival)) if arrival is None else arrival
    return req


def sample_token(req: Request) -> int:
    return 5000 + len(req.output_token_ids)


def step(sched: Scheduler, skip: frozenset[str] = frozenset()) -> SchedulerOutput:
    """One engine step: schedule, commit (the forward returned), append a token to each
    sampled sequence, finish the done."""
    out = sched.schedule()
    sched.commit(out)
    done = []
    for seq in out.seqs:
        if seq.sample and seq.request_id not in skip:
            req = sched.requests[seq.request_id]
            req.output_token_ids.append(sample_token(req))
            at_limit = req.max_model_len is not None and req.num_tokens >= req.max_model_len
            if len(req.output_token_ids) >= req.params.max_tokens or at_limit:
                done.append(req.request_id)
    sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.seqs}


def ids(items: Iterable[Request | ScheduledSeq]) -> list[str]:
    return [r.request_id for r in items]


def assert_all_released(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free == pool.num_blocks
    assert [b.ref_count for b in pool.blocks] == [0] * pool.num_blocks
    assert not sched.has_unfinished_requests()
    assert sched.requests == {}
    assert not sched.waiting and not sched.running


# -- admission and the token budget ------------------------------------------------------------


def test_admission_under_token_budget_chunks_the_second_prompt() -> None:
    """Budget 64 with prompts of 50 and 30: 50 + a 14-token chunk, then 1 decode + 16."""
    sched = make_scheduler(budget=64)
    a, b = make_request("a", 50), make_request("b", 30)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert counts(out) == {"a": 50, "b": 14}
    assert out.num_tokens == 64
    assert ids(out.prefills) == ["a", "b"] and out.decodes == []
    sa, sb = out.prefills
    assert (sa.start_pos, sa.sample, sa.token_ids) == (0, True, a.prompt_token_ids)
    assert (sb.start_pos, sb.sample, sb.token_ids) == (0, False, b.prompt_token_ids[:14])
    assert sb.block_ids == sched.kv.block_ids("b") and len(sb.block_ids) == 4
    assert len(sched.kv.block_ids("a")) == 13
    assert ids(sched.running) == ["a", "b"] and not sched.waiting
    assert (a.num_computed_tokens, b.num_computed_tokens) == (50, 14)
    assert b.output_token_ids == []

    out = step(sched)
    assert counts(out) == {"a": 1, "b": 16}
    assert ids(out.decodes) == ["a"] and ids(out.prefills) == ["b"]
    assert out.decodes[0].start_pos == 50 and out.decodes[0].token_ids == [5000]
    assert (out.prefills[0].start_pos, out.prefills[0].sample) == (14, True)
    assert out.prefills[0].token_ids == b.prompt_token_ids[14:]
    assert len(b.output_token_ids) == 1


def test_chunked_prefill_spans_steps_without_stalling_decodes() -> None:
    """A long prompt is prefilled over several steps while a running request decodes each step."""
    sched = make_scheduler(budget=16)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    assert counts(step(sched)) == {"a": 4}
    b = make_request("b", 40)
    sched.add_request(b)
    starts, samples = [], []
    for expected_b in (15, 15, 10):
        out = step(sched)
        assert counts(out) == {"a": 1, "b": expected_b}
        assert ids(out.decodes) == ["a"]  # the decode comes first and is never dropped
        assert out.seqs[0].request_id == "a"
        starts.append(out.prefills[0].start_pos)
        samples.append(out.prefills[0].sample)
    assert starts == [0, 15, 30]
    assert samples == [False, False, True]
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 1
    assert counts(step(sched)) == {"a": 1, "b": 1}


def test_prefill_beside_decodes_is_capped_and_alone_takes_the_budget() -> None:
    """max_prefill_tokens_while_decoding: a step that decodes a stream runs at most that
    many prompt positions (one pause between the stream's tokens stays short), over the
    running and the admitted prompts together; with no stream decoding a prompt gets the
    whole budget."""
    sched = make_scheduler(budget=64)
    sched.config = dataclasses.replace(sched.config, max_prefill_tokens_while_decoding=10)
    b = make_request("b", 40, max_tokens=20)
    sched.add_request(b)
    assert counts(step(sched)) == {"b": 40}  # alone: the whole budget
    c, d = make_request("c", 16), make_request("d", 30)
    sched.add_request(c)
    sched.add_request(d)
    assert counts(step(sched)) == {"b": 1, "c": 10}
    assert counts(step(sched)) == {"b": 1, "c": 6, "d": 4}  # c's rest, then d admitted
    assert counts(step(sched)) == {"b": 1, "c": 1, "d": 10}
    # The stream's own tokens are never capped: jump-forward's forced text is a decode.
    b.output_token_ids += [7, 7, 7]
    assert counts(step(sched)) == {"b": 4, "c": 1, "d": 10}


def test_prompt_beside_decodes_pays_for_its_attention_depth() -> None:
    """context_token_cost: beside a decoding stream, each prompt position costs one plus
    that much per position it attends to (itself and every earlier one), so chunks shrink
    as the prompt gets deeper and the pause between the stream's tokens stays bounded;
    alone, a prompt takes the whole budget by positions."""
    sched = make_scheduler(num_blocks=128, budget=64)
    sched.config = dataclasses.replace(sched.config, max_prefill_tokens_while_decoding=20,
                                       context_token_cost=0.01)
    b, c = make_request("b", 4, max_tokens=6), make_request("c", 120, max_tokens=1)
    sched.add_request(b)
    assert counts(step(sched)) == {"b": 4}
    sched.add_request(c)
    # Positions 1..18 cost 18 + 0.01 * 171 = 19.71 -> 20 (19 would cost 20.9 -> 21).
    assert counts(step(sched)) == {"b": 1, "c": 18}
    # Positions 19..33 cost 15 + 0.01 * 390 = 18.9 -> 19 (16 more: 20.24 -> 21).
    assert counts(step(sched)) == {"b": 1, "c": 15}
    chunks = [counts(step(sched)) for _ in range(3)]  # b's last three tokens
    done = 33
    for chunk in chunks:
        n = chunk["c"]
        paid = [1 + 0.01 * p for p in range(done + 1, done + n + 2)]  # n + 1 positions
        assert sum(paid[:n]) <= 20 < sum(paid), (done, n)
        done += n
    assert [ch["c"] for ch in chunks] == sorted((ch["c"] for ch in chunks), reverse=True)
    assert counts(step(sched)) == {"c": 120 - done}  # b finished: no one waits on c


def test_budget_goes_to_running_requests_before_admission() -> None:
    """Decodes of running requests are paid for first; a waiting request gets what is left."""
    sched = make_scheduler(budget=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 1, max_tokens=3))
    assert counts(step(sched)) == {"a": 1, "b": 1}
    assert counts(step(sched)) == {"a": 1, "b": 1}
    assert ids(sched.waiting) == ["c"]
    assert counts(step(sched)) == {"a": 1, "b": 1}  # a and b finish here
    assert counts(step(sched)) == {"c": 1}


def test_max_num_seqs_caps_running() -> None:
    """No more than max_num_seqs requests run at once; the next is admitted when one finishes."""
    sched = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 3, max_tokens=2))
    assert counts(step(sched)) == {"a": 3, "b": 3}
    assert ids(sched.running) == ["a", "b"] and ids(sched.waiting) == ["c"]
    assert counts(step(sched)) == {"a": 1, "b": 1}  # both finish
    assert ids(sched.running) == []
    assert counts(step(sched)) == {"c": 3}


def test_fcfs_order() -> None:
    """Equal-priority requests are admitted in arrival order."""
    sched = make_scheduler(max_num_seqs=1)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 2, max_tokens=1))
    assert ids(sched.waiting) == ["a", "b", "c"]
    order = [ids(step(sched).seqs) for _ in range(3)]
    assert order == [["a"], ["b"], ["c"]]
    assert_all_released(sched)


def test_priority_orders_the_waiting_queue() -> None:
    """Lower priority value first; arrival order among equals."""
    sched = make_scheduler(max_num_seqs=1)
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2), ("high2", 0), ("mid2", 2)):
        sched.add_request(make_request(rid, 2, max_tokens=1, priority=prio))
    assert ids(sched.waiting) == ["high", "high2", "mid", "mid2", "low"]
    order = [ids(step(sched).seqs)[0] for _ in range(5)]
    assert order == ["high", "high2", "mid", "mid2", "low"]


def test_admission_reuses_cached_prefix() -> None:
    """A request sharing full blocks with an earlier one starts after them, sharing the blocks."""
    sched = make_scheduler()
    a = make_request("a", prompt=list(range(9)), max_tokens=8)
    sched.add_request(a)
    step(sched)
    b = make_request("b", prompt=[*range(8), 70, 71, 72], max_tokens=8)
    sched.add_request(b)
    out = step(sched)
    sb = out.prefills[0]
    assert (sb.request_id, sb.start_pos, sb.token_ids) == ("b", 8, [70, 71, 72])
    assert sb.block_ids[:2] == sched.kv.block_ids("a")[:2]
    assert [sched.kv.pool.blocks[i].ref_count for i in sb.block_ids] == [2, 2, 1]
    assert b.metrics.num_cached_tokens == 8
    assert b.metrics.positions_processed == 3
    st = sched.stats().kv
    assert (st.prefix_queries, st.prefix_hits) == (20, 8)


# -- preemption --------------------------------------------------------------------------------


def test_preempts_newest_when_blocks_run_out_and_recomputes_it() -> None:
    """Out of blocks, the newest running request is preempted (blocks freed, progress reset,
    output kept, front of the queue) and later recomputed over prompt + generated tokens."""
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", 4, max_tokens=2)
    b = make_request("b", 2, max_tokens=2)
    c = make_request("c", 2, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    assert counts(step(sched)) == {"a": 4, "b": 2, "c": 2}
    assert sched.kv.pool.num_free == 0
    c_block = sched.kv.block_ids("c")

    late = make_request("late", 1, max_tokens=1)
    sched.add_request(late)
    out = step(sched)  # a needs a second block: c is the victim
    assert counts(out) == {"a": 1, "b": 1}
    assert out.num_preempted == 1 and sched.num_preemptions == 1
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [5000]
    assert c.metrics.num_preemptions == 1
    assert sched.kv.block_ids("c") == []
    assert out.decodes[0].block_ids[1] == c_block[0]  # c's block went to a
    assert ids(sched.waiting) == ["c", "late"]  # resumes before a later arrival
    assert sched.stats().num_preemptions == 1

    out = step(sched)  # a and b finished last step: c resumes first, then late
    sc = out.prefills[0]
    assert sc.request_id == "c"
    assert (sc.start_pos, sc.token_ids, sc.sample) == (0, [*c.prompt_token_ids, 5000], True)
    assert counts(out) == {"c": 3, "late": 1}
    assert c.status == RequestStatus.RUNNING
    assert c.metrics.num_cached_tokens == 0  # recorded at first admission only
    assert counts(step(sched)) == {"c": 1}
    assert c.output_token_ids == [5000, 5001, 5002]
    assert c.metrics.positions_processed == 2 + 3 + 1
    assert_all_released(sched)


def test_preemption_victim_is_lowest_priority_first() -> None:
    """Among running requests a lower-priority one is preempted before a newer higher one."""
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", 4, max_tokens=8, priority=0)
    low = make_request("low", 2, max_tokens=8, priority=1)
    new = make_request("new", 2, max_tokens=8, priority=0)
    for r in (a, low, new):
        sched.add_request(r)
    assert ids(sched.waiting) == ["a", "new", "low"]
    step(sched)
    out = step(sched)
    assert counts(out) == {"a": 1, "new": 1}
    assert out.num_preempted == 1
    assert low.status == RequestStatus.PREEMPTED
    assert new.status == RequestStatus.RUNNING


def test_victim_tie_break_is_the_later_running_request() -> None:
    """With equal priority and arrival time, the request later in the running list yields."""
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", 4, max_tokens=8, arrival=0.0)
    b = make_request("b", 2, max_tokens=8, arrival=0.0)
    c = make_request("c", 2, max_tokens=8, arrival=0.0)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out = step(sched)
    assert counts(out) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED


def _self_preemption_setup() -> tuple[Scheduler, Request, Request]:
    """Older x runs ahead of newer y in the running list; y will need a block."""
    sched = make_scheduler(num_blocks=2, budget=5, prefix_caching=False)
    x = make_request("x", 1, max_tokens=3, arrival=0.0)  # 1 block for life
    y = make_request("y", 4, max_tokens=4, arrival=5.0)  # 2 blocks for life
    sched.add_request(x)
    sched.add_request(y)
    assert counts(step(sched)) == {"x": 1, "y": 4}
    assert ids(sched.running) == ["x", "y"]
    assert sched.kv.pool.num_free == 0
    return sched, x, y


def test_victim_is_chosen_only_among_requests_not_yet_scheduled() -> None:
    """A request already scheduled this step is never preempted: y preempts itself."""
    sched, x, y = _self_preemption_setup()
    out = step(sched)
    assert counts(out) == {"x": 1}
    assert out.num_preempted == 1
    assert x.status == RequestStatus.RUNNING
    assert y.status == RequestStatus.PREEMPTED
    assert ids(sched.waiting) == ["y"]


def test_no_admission_in_a_step_that_preempted() -> None:
    """The preempted request would fit right away but waits for the next step."""
    sched, x, y = _self_preemption_setup()
    out = step(sched)
    assert out.num_preempted == 1
    assert sched.kv.pool.num_free == 1  # y's 4-token chunk would fit in it
    assert ids(sched.waiting) == ["y"]
    out = step(sched)
    assert out.num_preempted == 0
    assert counts(out) == {"x": 1, "y": 4}
    sy = out.prefills[0]
    assert (sy.start_pos, sy.sample) == (0, False)
    assert sy.token_ids == y.prompt_token_ids  # first chunk of prompt + [generated]
    assert x.status == RequestStatus.FINISHED_LENGTH
    out = step(sched)  # the rest of y: its generated token, as a decode
    assert counts(out) == {"y": 1}
    assert (out.decodes[0].start_pos, out.decodes[0].token_ids) == (4, [5000])
    while sched.has_unfinished_requests():
        step(sched)
    assert (len(x.output_token_ids), len(y.output_token_ids)) == (3, 4)
    assert_all_released(sched)


def test_resumed_request_reuses_its_own_cached_head() -> None:
    """A preempted request's full blocks stay cached, so its recompute starts after them."""
    sched = make_scheduler(num_blocks=3)
    a = make_request("a", 4, max_tokens=2)
    v = make_request("v", 5, max_tokens=4)
    sched.add_request(a)
    sched.add_request(v)
    step(sched)
    v_head = sched.kv.block_ids("v")[0]
    out = step(sched)
    assert out.num_preempted == 1 and v.status == RequestStatus.PREEMPTED
    out = step(sched)
    sv = out.seqs[0]
    assert (sv.request_id, sv.start_pos) == ("v", 4)
    assert sv.token_ids == [v.prompt_token_ids[4], 5000]
    assert sv.block_ids[0] == v_head
    assert sched.stats().kv.prefix_hits == 0  # a resume is not a new prompt lookup


def test_oldest_request_always_progresses_under_pressure() -> None:
    """A tiny pool and many requests: every step runs the oldest unfinished request; all finish
    with their max tokens in a bounded number of steps, with preemptions along the way."""
    sched = make_scheduler(num_blocks=8, budget=32, max_num_seqs=6)
    reqs = [make_request(f"r{i}", 6 + i % 4, max_tokens=10) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests():
        oldest = min(sched.requests.values(), key=lambda r: r.metrics.arrival_time)
        out = step(sched)
        assert oldest.request_id in counts(out), f"step {steps}: {oldest} made no progress"
        steps += 1
        assert steps <= 200, "did not terminate"
    assert sched.num_preemptions > 0
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_all_released(sched)


# -- refusal, abort, release -------------------------------------------------------------------


def test_prompt_that_can_never_fit_is_refused_at_add_request() -> None:
    """A prompt needing more blocks (with its first generated token) than the cache has
    raises PromptTooLongError and queues nothing."""
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(PromptTooLongError):
        sched.add_request(make_request("big", 16))
    assert not sched.waiting and sched.requests == {}
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("ok", 15))  # 15 + 1 tokens fill the 4 blocks exactly
    assert ids(sched.waiting) == ["ok"]


def test_recompute_mode_skips_the_block_check() -> None:
    """Without a KV cache no prompt is refused for lack of blocks."""
    sched = make_scheduler(num_blocks=1, use_cache=False)
    sched.add_request(make_request("a", 100))
    assert ids(sched.waiting) == ["a"]


def test_abort_waiting_and_running_requests_frees_blocks() -> None:
    """finish_requests(ABORTED) removes waiting and running requests and frees their blocks."""
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (make_request(rid, 5, max_tokens=8) for rid in ("a", "b", "c"))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert sched.kv.pool.num_free == 64 - 4
    sched.finish_requests(["c", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert (a.status, c.status) == (RequestStatus.FINISHED_ABORTED,) * 2
    assert a.finish_reason == "abort"
    assert ids(sched.running) == ["b"] and not sched.waiting
    assert sched.kv.block_ids("a") == []
    assert sched.kv.pool.num_free == 64 - 2
    out = sched.schedule()
    assert out.finished_ids == ["c", "a"]
    assert counts(out) == {"b": 1}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_ids == ["b"]
    assert sched.schedule().finished_ids == []
    assert_all_released(sched)


def test_abort_a_preempted_request() -> None:
    """A preempted request waiting to resume can be aborted; it leaves the queue."""
    sched, _, y = _self_preemption_setup()
    step(sched)
    assert y.status == RequestStatus.PREEMPTED
    sched.finish_requests(["y", "x"], RequestStatus.FINISHED_ABORTED)
    assert y.status == RequestStatus.FINISHED_ABORTED
    assert_all_released(sched)


def test_everything_released_after_finish_and_abort_with_shared_prefixes() -> None:
    """Requests sharing prefix blocks, finished or aborted mid-way: every block ends free."""
    sched = make_scheduler(num_blocks=12, budget=24, max_num_seqs=4)
    shared = list(range(8))
    reqs = [make_request(f"r{i}", prompt=[*shared, 100 + i, 200 + i], max_tokens=6)
            for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    for n in range(100):
        if not sched.has_unfinished_requests():
            break
        step(sched)
        if n == 3:
            sched.finish_requests(["r1", "r5"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert [r.status for r in reqs].count(RequestStatus.FINISHED_ABORTED) == 2
    assert sum(r.metrics.num_cached_tokens for r in reqs) > 0
    assert_all_released(sched)


# -- special cases -----------------------------------------------------------------------------


def test_running_request_with_nothing_to_run_is_skipped() -> None:
    """A running request whose tokens are all computed (a beam waiting for siblings) is left
    out of the step, not scheduled with 0 tokens, and keeps its blocks."""
    sched = make_scheduler()
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 3, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, skip=frozenset({"a"}))  # a gets no token
    assert a.num_computed_tokens == a.num_tokens == 3
    out = step(sched)
    assert counts(out) == {"b": 1}
    assert all(s.num_tokens > 0 for s in out.seqs)
    assert a.status == RequestStatus.RUNNING and ids(sched.running) == ["a", "b"]
    assert sched.kv.block_ids("a") != []
    a.output_token_ids.append(42)
    out = step(sched)
    assert counts(out) == {"a": 1, "b": 1}
    assert out.decodes[0].start_pos == 3 and out.decodes[0].token_ids == [42]


def test_recompute_mode_schedules_the_whole_sequence_every_step() -> None:
    """use_cache=False: one sequence at a time, its whole history from position 0 each step."""
    sched = make_scheduler(use_cache=False, budget=4)
    a, b = make_request("a", 3, max_tokens=3), make_request("b", 2, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    seen = []
    for _ in range(3):
        out = step(sched)
        assert out.use_cache is False and out.decodes == []
        (s,) = out.prefills
        assert (s.start_pos, s.block_ids, s.sample) == (0, [], True)
        seen.append((s.request_id, s.token_ids))
    assert seen == [
        ("a", a.prompt_token_ids),
        ("a", [*a.prompt_token_ids, 5000]),
        ("a", [*a.prompt_token_ids, 5000, 5001]),
    ]
    assert a.metrics.positions_processed == 3 + 4 + 5
    assert counts(step(sched)) == {"b": 2}
    assert not sched.has_unfinished_requests()


def test_fork_shares_blocks_and_copies_partial_tail_on_write() -> None:
    """A forked child runs from the parent's progress; the shared partial tail is copied for
    the first writer and the copy is handed to the runner once, in blocks_to_copy."""
    sched = make_scheduler()
    p = make_request("p", 6, max_tokens=4)
    sched.add_request(p)
    step(sched, skip=frozenset({"p"}))
    child = make_request("c", prompt=p.prompt_token_ids, max_tokens=4)
    sched.fork(p, child)
    assert child.status == RequestStatus.RUNNING
    assert child.num_computed_tokens == 6
    assert sched.kv.block_ids("c") == sched.kv.block_ids("p") == [0, 1]
    assert ids(sched.running) == ["p", "c"]
    p.output_token_ids.append(7)
    child.output_token_ids.append(8)
    out = sched.schedule()
    assert counts(out) == {"p": 1, "c": 1}
    assert out.blocks_to_copy == [(1, 2)]  # p writes first: p gets the copy
    by_id = {s.request_id: s for s in out.seqs}
    assert by_id["p"].block_ids == [0, 2]
    assert by_id["c"].block_ids == [0, 1]
    assert by_id["c"].token_ids == [8] and by_id["c"].start_pos == 6
    assert sched.schedule().blocks_to_copy == []
    sched.finish_requests(["p", "c"], RequestStatus.FINISHED_STOPPED)
    assert_all_released(sched)


# -- known bugs --------------------------------------------------------------------------------


def test_prompt_accepted_by_check_fits_is_admitted_despite_watermark() -> None:
    """A prompt check_fits accepts must be admissible with the admission watermark in force."""
    sched = make_scheduler(num_blocks=100, budget=2048, watermark=0.01)
    assert sched.kv.watermark_blocks == 1
    try:
        sched.add_request(make_request("a", 397))  # 398 tokens need all 100 blocks
    except PromptTooLongError:
        return
    assert counts(sched.schedule()) == {"a": 397}


@pytest.mark.parametrize(("num_blocks", "budget", "prompt_len", "max_tokens"), [
    (4, 64, 10, 20),  # stalls: never readmitted
    (2, 5, 4, 8),  # livelocks: readmitted chunk by chunk, preempted before it samples
])
def test_request_outgrowing_the_cache_does_not_stall(num_blocks: int, budget: int,
                                                     prompt_len: int, max_tokens: int) -> None:
    """A lone request that outgrows the cache is refused up front or finished, never stuck."""
    sched = make_scheduler(num_blocks=num_blocks, budget=budget)
    req = make_request("a", prompt_len, max_tokens=max_tokens)
    # As the engine does: no sequence may grow past what the cache holds.
    req.max_model_len = (num_blocks - sched.kv.watermark_blocks) * sched.kv.block_size
    try:
        sched.add_request(req)
    except PromptTooLongError:
        return
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()


def test_high_priority_request_is_not_preempted_for_a_lower_priority_one() -> None:
    """When blocks run out, a lower-priority running request yields before a higher one."""
    sched = make_scheduler(num_blocks=2)
    low = make_request("low", 1, max_tokens=20, priority=5)
    sched.add_request(low)
    step(sched)
    high = make_request("high", 3, max_tokens=20, priority=0)
    sched.add_request(high)
    assert counts(step(sched)) == {"low": 1, "high": 3}
    assert counts(step(sched)) == {"low": 1, "high": 1}
    out = step(sched)  # high needs its second block; the pool is full
    assert out.num_preempted == 1
    assert high.status == RequestStatus.RUNNING
    assert low.status == RequestStatus.PREEMPTED


# -- draft tokens (speculative decoding) ---------------------------------------------------------


def spec_step(sched: Scheduler, drafts: dict[str, list[int]],
              accept: dict[str, int]) -> SchedulerOutput:
    """One engine step with drafts: propose, schedule, commit `accept[rid]` drafts, append
    the accepted drafts and one bonus token, finish the done."""
    for rid, d in drafts.items():
        sched.requests[rid].spec_token_ids = list(d)
    out = sched.schedule()
    accepted = {s.request_id: min(accept.get(s.request_id, 0), s.num_draft)
                for s in out.seqs if s.num_draft}
    sched.commit(out, accepted)
    done = []
    for seq in out.seqs:
        req = sched.requests[seq.request_id]
        req.spec_token_ids = []
        if not seq.sample:
            continue
        new = [*seq.draft_token_ids[:accepted.get(seq.request_id, 0)], sample_token(req)]
        room = req.params.max_tokens - len(req.output_token_ids)
        req.output_token_ids.extend(new[:room])
        if len(req.output_token_ids) >= req.params.max_tokens:
            done.append(req.request_id)
    sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def test_drafts_ride_behind_a_decode_and_rejected_ones_are_rolled_back() -> None:
    sched = make_scheduler(budget=64)
    a = make_request("a", 6, max_tokens=20)
    sched.add_request(a)
    step(sched)  # prefill; a has 7 tokens, 6 computed
    out = spec_step(sched, {"a": [71, 72, 73, 74]}, {"a": 2})
    (seq,) = out.prefills  # several query rows: it is not a one-token decode
    assert out.decodes == []
    assert (seq.start_pos, seq.num_draft) == (6, 4)
    assert seq.token_ids == [5000, 71, 72, 73, 74] and seq.draft_token_ids == [71, 72, 73, 74]
    # Positions 6..10 ran; 6, 7, 8 are committed (the token and two accepted drafts).
    assert a.num_computed_tokens == 9
    assert a.output_token_ids == [5000, 71, 72, 5001]
    assert len(sched.kv.block_ids("a")) == 3  # 9 tokens; the block of positions 12.. is gone
    assert (a.metrics.num_draft_tokens, a.metrics.num_accepted_tokens) == (4, 2)
    assert a.metrics.positions_processed == 6 + 5
    assert a.metrics.mean_accepted_length == 3.0
    # The next step runs from the bonus token, in its own slot.
    out = spec_step(sched, {"a": [81, 82]}, {"a": 0})
    assert out.seqs[0].start_pos == 9 and out.seqs[0].token_ids == [5001, 81, 82]
    assert a.num_computed_tokens == 10 and a.output_token_ids[-1] == 5004
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_released(sched)


def test_drafts_are_limited_by_budget_and_context_and_skip_prefills() -> None:
    sched = make_scheduler(budget=4)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    a.spec_token_ids = [1, 2, 3]  # a prefill never carries drafts
    out = sched.schedule()
    sched.commit(out)
    assert out.seqs[0].num_draft == 0 and out.seqs[0].num_tokens == 3
    a.output_token_ids.append(9)
    a.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()  # budget 4: the token and three drafts
    assert out.seqs[0].num_draft == 3
    sched.commit(out, {"a": 3})
    a.output_token_ids.extend([1, 2, 3, 9])
    a.max_model_len = a.num_tokens + 1  # room for the pending token and one more position
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.seqs[0].num_draft == 1


def test_prefix_hashes_cover_only_committed_tokens() -> None:
    """A rejected draft that filled a block never makes it a prefix-cache hit."""
    sched = make_scheduler(budget=64)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    step(sched)  # 3 prompt tokens computed, token 5000 pending
    prompt = a.prompt_token_ids
    out = spec_step(sched, {"a": [61, 62, 63, 64, 65]}, {"a": 0})
    assert out.seqs[0].num_draft == 5
    assert a.num_computed_tokens == 4  # the first block (prompt + 5000) is full
    same = make_request("b", prompt=[*prompt, 5000, 61, 62, 63, 64], max_tokens=1)
    hits = sched.kv.find_cached_prefix(same)
    assert len(hits) == 1  # the committed block only: the drafts' block was never hashed
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_all_released(sched)


@pytest.mark.parametrize("seed", range(5))
def test_random_mix_of_drafts_aborts_and_preemptions_releases_everything(seed: int) -> None:
    import random

    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=7, budget=24, max_num_seqs=6)
    live: list[str] = []
    preempted_before = sched.num_preemptions
    for i in range(120):
        if rng.random() < 0.3:
            rid = f"r{i}"
            sched.add_request(make_request(rid, rng.randint(1, 9), max_tokens=rng.randint(1, 12)))
            live.append(rid)
        live = [r for r in live if r in sched.requests]
        if live and rng.random() < 0.05:
            sched.finish_requests([rng.choice(live)], RequestStatus.FINISHED_ABORTED)
        running = [r.request_id for r in sched.running]
        drafts = {r: [rng.randint(0, 50) for _ in range(rng.randint(0, 5))] for r in running}
        accept = {r: rng.randint(0, 5) for r in running}
        spec_step(sched, drafts, accept)
    for _ in range(300):
        if not sched.has_unfinished_requests():
            break
        spec_step(sched, {}, {})
    assert sched.num_preemptions > preempted_before  # the pool is small enough
    assert_all_released(sched)
