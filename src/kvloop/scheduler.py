"""The scheduler decides, each step, which requests run and how many tokens each.

A token budget per step (`max_num_batched_tokens`) is spent first on running requests
(one decode token each, or the next chunk of a prompt being prefilled), then on admitting
waiting requests, whose prompts may be prefilled in chunks across several steps (shorter
ones while other requests are decoding: `max_prefill_tokens_while_decoding`, each position
charged for the context it attends to, so a deep prompt's chunk is no longer a pause than
a shallow one's). When the
KV cache runs out of blocks, the lowest-priority, newest running request is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later (its
generated tokens are kept, so nothing is lost).

Scheduling only proposes: the engine runs the forward, then calls `commit`, which is the
one place progress (computed tokens, positions processed, prefix-cache hashes) advances.

Why preemption cannot livelock: the victim is always the newest (by priority, then
arrival) running request, so the oldest one always progresses; a preempted request resumes
before any later arrival; and no new request is admitted in a step that had to preempt.

No tensors here (see batch.py for what the runner receives).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvloop.batch import ScheduledSeq, SchedulerOutput
from kvloop.errors import PromptTooLongError
from kvloop.kv_cache import Block, KVCacheManager, KVCacheStats
from kvloop.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    use_cache: bool = True
    # What a prompt position scored for prompt log-probs costs beyond its forward, in
    # tokens of the budget (the head over the vocabulary: ModelConfig.head_cost_ratio), so
    # a scored chunk takes a step no longer than a plain one and other streams keep pace.
    scored_token_cost: float = 0.0
    # In a step that also decodes running streams, prompt positions (prefill chunks, a
    # preempted request's recompute) spend at most this much of the budget: such a step
    # is a pause between those streams' tokens, and a whole budget of prefill (2,048
    # positions: ~4 s on 2 cores) would be one. None: no cap beyond the budget.
    max_prefill_tokens_while_decoding: int | None = None
    # In such a step, what a prompt position costs beyond its forward for each earlier
    # position it attends to, in tokens of the budget (ModelConfig.attention_cost_ratio):
    # at 4k tokens of context a position's attention outweighs its matrices, and a chunk
    # charged by positions alone would stretch the pause with the prompt's depth.
    context_token_cost: float = 0.0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv: KVCacheStats
    num_preemptions: int
    # Speculative decoding: draft tokens run, accepted, and per verifying step how many
    # drafts it accepted (accepted_per_step[j] = steps that accepted j).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_step: tuple[int, ...] = ()
    num_forced_tokens: int = 0  # jump-forward: grammar-forced tokens the model accepted
    # Steps the engine has run (the engine counts them and fills this in): the step the
    # other figures are as of, so a reader can match them to that step's record.
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_step: list[int] = []
        self.num_forced_tokens = 0

    # -- queue management -------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Refuse, at admission, a request that could never run to completion in the cache.

        It must fit with the admission watermark kept spare, or it would wait forever. And
        it must never outgrow the cache, or it would preempt itself forever: its length is
        capped by `max_model_len`, which the engine keeps within the cache, and a longest
        sequence (prompt + max_tokens, capped so) that cannot fit is refused here.
        """
        if not self.config.use_cache:
            return
        longest = request.num_tokens + 1
        if request.max_model_len is not None:
            longest = max(longest, min(request.num_prompt_tokens + request.params.max_tokens,
                                       request.max_model_len))
        need = self.kv.blocks_needed(longest, self.config.max_num_batched_tokens)
        usable = self.kv.pool.num_blocks - self.kv.watermark_blocks
        if need > usable:
            raise PromptTooLongError(
                f"a prompt of {request.num_prompt_tokens} tokens with max_tokens "
                f"{request.params.max_tokens} needs up to {need} KV blocks but the cache has "
                f"{usable} usable ({self.kv.pool.num_blocks} in all); raise kv_cache_memory"
            )

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Waiting queue ordered by (priority, arrival); a preempted request goes first."""
        if front:
            self.waiting.appendleft(request)
            return
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > request.priority:
            i -= 1
        self.waiting.insert(i, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Mark requests finished (stop, length or abort) and free their blocks."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(rid)
            self._finished_ids.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.stats(),
                              self.num_preemptions, self.num_draft_tokens,
                              self.num_accepted_tokens, tuple(self.accepted_per_step),
                              self.num_forced_tokens)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(use_cache=self.config.use_cache)
        out.finished_ids, self._finished_ids = self._finished_ids, []
        budget = self.config.max_num_batched_tokens
        if not self.config.use_cache:
            return self._schedule_recompute(out, budget)

        # Admission order can differ from priority order: keep running sorted so a victim
        # chosen among the not-yet-scheduled tail is always the lowest priority, newest.
        self.running.sort(key=lambda r: (r.priority, r.metrics.arrival_time))

        # Prefill's share of a step that also carries decodes (see SchedulerConfig).
        cap = self.config.max_prefill_tokens_while_decoding
        beside_decodes = any(map(self._is_decode, self.running))
        prefill_room = budget if cap is None or not beside_decodes else min(budget, cap)

        # 1. Running requests: a decode token, or the next chunk of an unfinished prefill.
        scheduled: list[Request] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decode = self._is_decode(req)
            n = (self._chunk(req, budget) if decode
                 else self._chunk(req, max(0, min(budget, prefill_room)), beside_decodes))
            if n == 0:  # a beam waiting for its siblings' step: nothing to run
                i += 1
                continue
            # Draft tokens ride behind a decode's token, as far as the budget allows.
            k = self._num_drafts(req, n, budget)
            while not self.kv.allocate(req, n + k):
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                preempted = True
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted itself: the list shrank, i already points past it
            scheduled.append(req)
            cost = self._cost(req, n, beside_decodes and not decode)
            budget -= cost + k
            if not decode:
                prefill_room -= cost
            self._add_to_output(out, req, n, k)
            i += 1

        # 2. Waiting requests, in queue order, while budget, seats and blocks allow.
        while (self.waiting and min(budget, prefill_room) > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            prefix: list[Block] = []
            # Prompt log-probs come from the prompt's own forward: no prefix-cache hits.
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                prefix = self.kv.find_cached_prefix(req)
                req.num_computed_tokens = len(prefix) * self.kv.block_size
            n = self._chunk(req, min(budget, prefill_room), beside_decodes)
            if not self.kv.allocate(req, n, prefix, admitting=True):
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission (not a resume)
                self.kv.record_prefix_lookup(req.num_prompt_tokens, req.num_computed_tokens)
                req.metrics.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            cost = self._cost(req, n, beside_decodes)
            budget -= cost
            prefill_room -= cost
            self._add_to_output(out, req, n)
        out.blocks_to_copy = self.kv.take_copies()
        return out

    def commit(self, out: SchedulerOutput,
               num_accepted: Mapping[str, int] | None = None) -> None:
        """The step's forward returned: advance each scheduled sequence by the tokens it ran
        and hash the blocks that became full of computed tokens.

        Only here, after the forward, does progress count. A forward that raises leaves
        every scheduled request as it was (the engine then fails them), and a block half
        written by it is never registered as a prefix-cache hit for a later request.

        `num_accepted`: per sequence that ran draft tokens, how many of them the model
        accepted (a leading run). The keys and values of the rejected ones are dropped:
        progress stops before them and blocks holding nothing else go back to the pool.
        """
        for seq in out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            req.metrics.positions_processed += seq.num_tokens
            if not seq.num_draft:
                req.num_computed_tokens = seq.context_len
                self.kv.cache_full_blocks(req)
                continue
            accepted = (num_accepted or {}).get(seq.request_id, 0)
            if not 0 <= accepted <= seq.num_draft:
                raise ValueError(f"{seq.request_id}: {accepted} of {seq.num_draft} drafts "
                                 f"accepted")
            req.num_computed_tokens = seq.context_len - (seq.num_draft - accepted)
            m = req.metrics
            if seq.forced:
                m.num_forced_tokens += accepted
                self.num_forced_tokens += accepted
            else:
                m.num_draft_tokens += seq.num_draft
                m.num_accepted_tokens += accepted
                m.num_spec_steps += 1
                self.num_draft_tokens += seq.num_draft
                self.num_accepted_tokens += accepted
                if len(self.accepted_per_step) <= accepted:
                    self.accepted_per_step.extend(
                        [0] * (accepted + 1 - len(self.accepted_per_step)))
                self.accepted_per_step[accepted] += 1
            self.kv.truncate(req.request_id, req.num_computed_tokens)
            # The accepted drafts are committed tokens, though the engine appends them to
            # the request's output only after this.
            self.kv.cache_full_blocks(req, req.all_token_ids + seq.draft_token_ids[:accepted])

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child` as a copy of `parent`'s progress, sharing its KV blocks."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        child.metrics.num_cached_tokens = parent.metrics.num_cached_tokens
        self.requests[child.request_id] = child
        self.running.append(child)

    @staticmethod
    def _is_decode(req: Request) -> bool:
        """Past its prompt: a stream whose next tokens (its last sampled one, drafts,
        grammar-forced text) someone is waiting on one by one."""
        return req.num_computed_tokens >= req.num_prompt_tokens

    def _scored(self, req: Request, n: int) -> int:
        """Of the next `n` positions, those whose logits score a prompt token."""
        if req.params.prompt_logprobs is None:
            return 0
        start = req.num_computed_tokens
        return max(0, min(start + n, req.num_prompt_tokens - 1) - start)

    def _cost(self, req: Request, n: int, beside_decodes: bool = False) -> int:
        """Budget the next `n` positions of `req` spend: one each, the head's share more
        for each prompt position scored, and beside decoding streams, their attention's
        share for each earlier position they see (positions start+1 .. start+n)."""
        cost = n + self._scored(req, n) * self.config.scored_token_cost
        if beside_decodes:
            start = req.num_computed_tokens
            cost += self.config.context_token_cost * (n * start + n * (n + 1) / 2)
        return math.ceil(cost)

    def _chunk(self, req: Request, budget: int, beside_decodes: bool = False) -> int:
        """Positions of `req` to run within `budget`: as many as remain and fit (at least
        one, so a budget smaller than one position's cost still progresses)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if n <= 1 or self._cost(req, n, beside_decodes) <= budget:
            return n
        # The cost rises with the count: the counts 1..n whose cost fits are a prefix.
        fits = bisect.bisect_right(range(1, n + 1), budget,
                                   key=lambda m: self._cost(req, m, beside_decodes))
        return max(1, fits)

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens to run after the `n` scheduled tokens: only behind a decode's last
        token, within the step's budget and the model's context."""
        if not req.spec_token_ids or req.num_computed_tokens + n != req.num_tokens:
            return 0
        room = budget - n
        if req.max_model_len is not None:
            room = min(room, req.max_model_len - req.num_tokens)
        return max(0, min(len(req.spec_token_ids), room))

    def _add_to_output(self, out: SchedulerOutput, req: Request, n: int,
                       num_draft: int = 0) -> None:
        start = req.num_computed_tokens
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_slice(start, start + n) + req.spec_token_ids[:num_draft],
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            group_block_ids=self.kv.group_block_ids(req.request_id),
            # max_tokens 0 (scoring a prompt): the prompt runs, nothing is sampled.
            sample=start + n == req.num_tokens and req.params.max_tokens > 0,
            params=req.params,
            prompt_ids=req.prompt_token_ids,
            output_ids=req.output_token_ids,
            suppress_ids=req.suppressed_token_ids(),
            num_draft=num_draft,
            forced=num_draft > 0 and req.spec_forced,
        )
        if seq.sample and req.fork_samples:
            seq.fork_samples = list(req.fork_samples)
        (out.decodes if seq.num_tokens == 1 and start > 0 else out.prefills).append(seq)

    @staticmethod
    def _pick_victim(candidates: list[Request]) -> Request:
        # Only requests not yet scheduled this step; lowest priority (largest number)
        # first, newest arrival among equals.
        return max(reversed(candidates), key=lambda r: (r.priority, r.metrics.arrival_time))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_forced = False
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _schedule_recompute(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        """No KV cache: every step re-runs each sequence's whole history (the textbook
        illustration of what the cache saves). One sequence at a time."""
        if not self.running and self.waiting:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for req in self.running:
            req.num_computed_tokens = 0
            self._add_to_output(out, req, req.num_tokens)
        return out
