"""LLMEngine: requests in, outputs out, one scheduler step at a time.

    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Each step: the scheduler picks the batch, the runner runs the model and the sampler, and
the engine appends tokens, detokenizes, checks stop conditions and frees what finished.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvloop.config import EngineConfig, ModelConfig, parse_size
from kvloop.engine.detokenizer import IncrementalDetokenizer
from kvloop.engine.output_state import SeqOutputState
from kvloop.engine.outputs import CompletionOutput, RequestOutput
from kvloop.errors import InvalidParamsError, PromptTooLongError
from kvloop.kv_cache import KVCacheManager
from kvloop.loading.loader import Checkpoint, load_checkpoint
from kvloop.loading.tokenizer import Tokenizer
from kvloop.models import LlamaForCausalLM, build_model
from kvloop.params import SamplingParams
from kvloop.request import Request, RequestStatus
from kvloop.runner import ModelRunner, kv_cache_bytes_per_block
from kvloop.scheduler import Scheduler, SchedulerConfig, SchedulerStats

logger = logging.getLogger("kvloop")


@dataclass
class _Group:
    """A user request: one or more sequences (n > 1) sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqOutputState]

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


def load_model(checkpoint: Checkpoint, pack: bool = True) -> LlamaForCausalLM:
    model = build_model(checkpoint.config)
    model.load_weights(checkpoint.weights())
    if pack:
        model.pack_weights()
    return model.eval()


class LLMEngine:
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None,
                 checkpoint: Checkpoint | None = None) -> None:
        self.config = config or EngineConfig()
        threads = self.config.num_threads
        # Only when asked: re-setting the count after torch has run an op (even to the same
        # value) was measured to slow SDPA calls from ~15 us to ~8 ms for a while.
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.checkpoint = checkpoint or load_checkpoint(model)
        self.model_config: ModelConfig = self.checkpoint.config
        self.tokenizer: Tokenizer = self.checkpoint.tokenizer
        self.model = load_model(self.checkpoint, self.config.pack_weights)
        c, ec = self.model_config, self.config
        self.max_model_len = min(ec.max_model_len or c.max_position_embeddings,
                                 c.max_position_embeddings)
        per_block = kv_cache_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim,
                                             ec.block_size)
        # Never more blocks than max_num_seqs full-length sequences could use.
        blocks_cap = ec.max_num_seqs * (-(-self.max_model_len // ec.block_size))
        num_blocks = max(1, min(parse_size(ec.kv_cache_memory) // per_block, blocks_cap))
        if not ec.use_cache:
            num_blocks = 1
        self.kv = KVCacheManager(num_blocks, ec.block_size, ec.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_num_seqs, ec.max_num_batched_tokens, ec.use_cache), self.kv)
        self.runner = ModelRunner(self.model, ec.block_size, num_blocks, ec.use_cache)
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}
        self._ids = itertools.count()
        self.total_positions = 0
        self.num_steps = 0

    # -- requests -----------------------------------------------------------------------------
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.model_config.eos_token_ids + self.tokenizer.eos_token_ids))

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> str:
        """Validate and queue a request; raises a KvloopError before queueing anything."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or self.new_request_id()
        if request_id in self._groups:
            raise InvalidParamsError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidParamsError(f"prompt token ids out of range: {bad[:5]}")
        if not ids:
            raise InvalidParamsError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                f"(room is needed for at least one generated token)"
            )
        if params.num_beams > 1:
            raise InvalidParamsError("beam search is not supported yet")
        seqs = []
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else replace(
                params, seed=params.seed + i)
            sid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(sid, ids, p, self.eos_token_ids(), priority, self.max_model_len)
            seqs.append(SeqOutputState(req, IncrementalDetokenizer(self.tokenizer, ids), i))
        # Admission control first (may raise), so nothing half-queued is left behind.
        for s in seqs:
            self.scheduler.check_fits(s.request)
        group = _Group(request_id, text, ids, params, seqs)
        for s in seqs:
            self.scheduler.add_request(s.request)
            self._seq_to_group[s.request.request_id] = group
        self._groups[request_id] = group
        return request_id

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        ids = [s.request.request_id for s in group.seqs if not s.request.is_finished]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for s in group.seqs:
            self._seq_to_group.pop(s.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.perf_counter()
        for scheduled in sched.seqs:
            m = self.scheduler.requests[scheduled.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.runner.execute(sched)
        self.total_positions += result.num_tokens
        self.num_steps += 1
        now = time.perf_counter()

        touched: dict[str, _Group] = {}
        finished: dict[RequestStatus, list[str]] = {}
        for rid, tok in result.sampled.items():
            group = self._seq_to_group[rid]
            seq = group.seqs[0] if len(group.seqs) == 1 else next(
                s for s in group.seqs if s.request.request_id == rid)
            req = seq.request
            status = seq.append(tok.token_id, tok.logprob, tok.top_logprobs)
            m = req.metrics
            m.num_output_tokens = len(req.output_token_ids)
            m.last_token_time = now
            if m.first_token_time is None:
                m.first_token_time = now
            if status is not None:
                seq.finish(status)
                m.finished_time = now
                finished.setdefault(status, []).append(rid)
            touched[group.request_id] = group
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)
        outputs = []
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                del self._groups[group.request_id]
                for s in group.seqs:
                    self._seq_to_group.pop(s.request.request_id, None)
        return outputs

    def _make_output(self, group: _Group) -> RequestOutput:
        comps = []
        for s in group.seqs:
            req = s.request
            done = req.is_finished
            delta, delta_ids = s.take_delta(done)
            want_lp = req.params.logprobs is not None
            comps.append(CompletionOutput(
                index=s.index,
                text=s.text if done else s.text[: s.emitted],
                token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                logprobs=list(s.logprobs) if want_lp else None,
                top_logprobs=list(s.top_logprobs) if req.params.logprobs else None,
                cumulative_logprob=sum(s.logprobs),
                delta=delta,
                delta_token_ids=delta_ids,
            ))
        first = group.seqs[0].request
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps,
                             group.finished, first.metrics)
