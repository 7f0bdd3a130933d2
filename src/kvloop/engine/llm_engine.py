"""LLMEngine: requests in, outputs out, one scheduler step at a time.

    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Each step: the scheduler picks the batch, the runner runs the model and the sampler, and
the engine appends tokens, detokenizes, checks stop conditions and frees what finished.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from kvloop import kernels
from kvloop.batch import SchedulerOutput
from kvloop.config import EngineConfig, ModelConfig, resolve_kv_cache_dtype
from kvloop.distributed import ShardPlan, load_shard
from kvloop.distributed.launch import TensorParallelGroup
from kvloop.distributed.runner import TensorParallelRunner
from kvloop.engine.attribution import ModelCosts
from kvloop.engine.detokenizer import IncrementalDetokenizer
from kvloop.engine.output_state import SeqOutputState
from kvloop.engine.outputs import CompletionOutput, RequestOutput
from kvloop.engine.prompt_logprobs import PromptLogprobs
from kvloop.engine.steps import Phase, StepObserver, seq_phases, step_record
from kvloop.engine.structured import GrammarCompiler
from kvloop.errors import InvalidParamsError, ModelLoadError, PromptTooLongError
from kvloop.kv_cache import BlockMap, KVCacheManager, blocks_for_sequence
from kvloop.loading.chat_template import prestart_worker
from kvloop.loading.layout_cache import LayoutCache, cache_dir
from kvloop.loading.loader import Checkpoint, load_checkpoint
from kvloop.loading.tokenizer import Tokenizer
from kvloop.models import CausalLM, create_model
from kvloop.models.attention import kv_cache_groups
from kvloop.models.native import native_supported
from kvloop.models.quantize import (
    quantize_model,
    quantized_layers,
    use_cached_layers,
    use_stored_blocks,
    use_stored_embedding,
    use_stored_int4,
)
from kvloop.params import SamplingParams, check_prompt_logprobs
from kvloop.quant import QUANTIZATIONS
from kvloop.request import Request, RequestStatus
from kvloop.runner import ModelRunner, SampledToken, kv_cache_bytes_per_block
from kvloop.sampling.beam import BeamSearch
from kvloop.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from kvloop.spec import DraftRequest, NgramProposer, Proposer
from kvloop.spec.draft import DraftModelProposer

if TYPE_CHECKING:
    from kvloop.engine.structured import LLMatcher

logger = logging.getLogger("kvloop.engine")

MAX_SPEC_PAUSE = 64  # steps a sequence whose drafts keep failing goes without them, at most


@dataclass
class _Group:
    """A user request: one sequence, n sampled siblings, or the live beams of a beam search.

    Siblings and beams are forked from a parent sequence and share its KV blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqOutputState]
    num_pending_forks: int = 0  # n > 1 siblings not yet forked from seqs[0]
    beam: BeamSearch | None = None
    beam_scores: dict[str, float] = field(default_factory=dict)  # live beam -> cum logprob
    beam_candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    beam_results: list[CompletionOutput] | None = None
    num_beam_seqs: int = 0
    error: str | None = None  # set when the request failed
    # With prompt_logprobs: filled as the prompt's chunks run; handed out when complete.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if self.beam is not None:
            return self.beam_results is not None
        return self.num_pending_forks == 0 and all(s.request.is_finished for s in self.seqs)


@dataclass
class _SpecState:
    """One sequence's speculation: how many drafts to ask for next step, and a pause after
    guesses keep failing (rejected drafts still cost the forward their rows)."""

    k: int
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting

    def update(self, drafted: int, accepted: int, k_max: int) -> None:
        if accepted:
            self.misses = 0
            # One more than were accepted (all of them: two more), up to the maximum.
            self.k = min(k_max, accepted + 2) if accepted == drafted else accepted + 1
            return
        self.misses += 1
        self.k = 1
        if self.misses >= 2:  # back off 4, 8, 16, ... 64 steps
            self.pause = min(MAX_SPEC_PAUSE, 2**self.misses)

    def next_k(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.k


def resolve_quantization(quantization: str, checkpoint: Checkpoint) -> str:
    """"auto": the checkpoint's blocks as stored ("gguf") for a GGUF file with quantized
    linear tensors, fp32 ("none") otherwise; any other mode as it is."""
    if quantization != "auto":
        return quantization
    return "gguf" if checkpoint.quantized_linears else "none"


def layout_cache(checkpoint: Checkpoint, quantization: str) -> LayoutCache | None:
    """The layout cache of a checkpoint's re-quantized layers (int8, int4: the layouts
    that take work to build), for a model file; None for other modes, for a directory of
    safetensors, or with the cache turned off (KVLOOP_LAYOUT_CACHE=0)."""
    if quantization not in ("int8", "int4") or not checkpoint.path.is_file() \
            or cache_dir() is None:
        return None
    try:
        isa = kernels.build.kernel_isa()
    except RuntimeError:  # a KVLOOP_ISA this CPU cannot run (the kernels say so)
        isa = "none"
    return LayoutCache(checkpoint.path, {"quantization": quantization, "isa": isa})


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). Loading frees its
    transient buffers (blocks decoded into layouts, the tokenizer's construction) to the
    heap, which glibc keeps resident: ~64 MiB of the default model's load
    (benchmarks/memory_breakdown.py). A no-op where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def load_model(checkpoint: Checkpoint, pack: bool = True, quantization: str = "none",
               native: bool = False) -> CausalLM:
    """The checkpoint's model with its linear layers in `quantization`'s layout. Each layer
    holds one layout: with the native decoder (`native`, for an architecture it runs) the
    fp32 layers keep their dense weight, which its kernels and GEMMs read; otherwise
    (`pack`) oneDNN's prepacked one, which the modules' forward reads."""
    release_free_heap()  # what building the tokenizer freed, before the weights arrive
    model = create_model(checkpoint.config)  # uninitialised: no memory is touched yet
    quantization = resolve_quantization(quantization, checkpoint)
    # Layers that are ready-made are installed first and the loader skips their tensors,
    # so nothing of them is dequantized to fp32: re-quantized layouts from the layout
    # cache, else layers whose stored codes are their layout, built a layer at a time.
    cache = layout_cache(checkpoint, quantization)
    cached = cache.load() if cache is not None else None
    taken: set[str] = set()
    # One lazy view of the stored blocks (each tensor decoded when looked up).
    blocks = checkpoint.block_weights() if quantization != "none" else {}
    if cached is not None:
        try:
            taken = use_cached_layers(model, cached, checkpoint.tensor_names)
        except ValueError as e:  # another model's shapes: never used, rebuilt
            logger.warning("layout cache %s does not fit this model (%s): rebuilding it",
                           cache.path if cache else "", e)
            cached = None
    if cached is None and quantization == "gguf":
        taken = use_stored_blocks(model, blocks)
    elif cached is None and quantization == "int4":
        taken = use_stored_int4(model, checkpoint.int4_weights())
    if quantization != "none":
        taken |= use_stored_embedding(model, blocks)
    model.load_weights(checkpoint.weights(taken), preloaded=taken)
    if quantization in ("int8", "int4"):  # the rest, from fp32 (none left when cached)
        quantize_model(model, quantization)
        if cached is None and cache is not None:
            cache.save(quantized_layers(model))
    if pack and not (native and native_supported(model)):
        model.pack_weights()  # whatever stayed fp32
    checkpoint.release()  # every tensor is copied or decoded: the file's pages can go
    model.eval()
    return model


_F = TypeVar("_F", bound=Callable[..., Any])


def _gc_paused(init: _F) -> _F:
    """Run `init` with the cyclic garbage collector paused (and resumed after, as it was):
    a load builds ~10^5 container objects (vocabulary, merges, modules), and collections
    triggered every 700 of them walk torch's whole object graph each time: ~a tenth of a
    one-shot's load. The load makes no reference cycles worth collecting midway."""

    @functools.wraps(init)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return init(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return cast(_F, paused)


class LLMEngine:
    @_gc_paused
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None,
                 checkpoint: Checkpoint | None = None) -> None:
        self.config = config or EngineConfig()
        tp = self.config.tensor_parallel_size
        threads = self.config.num_threads
        if tp > 1:  # the CPUs shared among the ranks of this machine
            threads = max(1, (threads or torch.get_num_threads()) // tp)
        # Only when asked: re-setting the count after torch has run an op (even to the same
        # value) was measured to slow SDPA calls from ~15 us to ~8 ms for a while.
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        if checkpoint is None:
            prestart_worker()  # the template check below finds it booted
        self.checkpoint = checkpoint or load_checkpoint(model)
        self.model_config: ModelConfig = self.checkpoint.config
        self.tokenizer: Tokenizer = self.checkpoint.tokenizer
        if self.config.chat_template is not None:
            # A copy: a checkpoint passed in may serve other engines with its own template.
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.set_chat_template(self.config.chat_template)
        if self.config.quantization not in QUANTIZATIONS:
            raise InvalidParamsError(f"quantization must be one of {QUANTIZATIONS}, got "
                                     f"{self.config.quantization!r}")
        # "auto" becomes what this checkpoint runs with, so that stats and drafts see it.
        # Tensor parallelism shards fp32 weights: "auto" is "none" there.
        quantization = ("none" if tp > 1 else
                        resolve_quantization(self.config.quantization, self.checkpoint))
        self.config = replace(self.config, quantization=quantization,
                              kv_cache_dtype=resolve_kv_cache_dtype(
                                  self.config.kv_cache_dtype, quantization))
        # The native decode step reads fp32 weights densely (and runs prefill GEMMs on them).
        native = self.config.use_kernels and self.config.use_cache and kernels.available()
        self.tensor_parallel: TensorParallelGroup | None = None
        if tp > 1:
            plan = ShardPlan.of(self.checkpoint.config, 0, tp)  # refused before any spawn
            self.tensor_parallel = TensorParallelGroup.start(
                tp, str(self.checkpoint.path), self.config)
            self._closer = weakref.finalize(self, self.tensor_parallel.close)
            self.model = load_shard(self.checkpoint.config, self.checkpoint.weights(set()),
                                    plan, self.config.pack_weights)
        else:
            self.model = load_model(self.checkpoint, self.config.pack_weights,
                                    self.config.quantization, native=native)
        c, ec = self.model_config, self.config
        self.max_model_len = min(ec.max_model_len or c.max_position_embeddings,
                                 c.max_position_embeddings)
        # KV cache groups (kv_cache.py): a block holds one group's layers, and every group
        # needs its blocks, so capacity is counted in group-sized blocks.
        self.kv_groups = kv_cache_groups(c)
        num_groups = len(self.kv_groups)
        # In the bytes the KV dtype stores (int8: codes and scales), so the same
        # kv_cache_memory holds 2x (16-bit) or ~4x (int8) the blocks of fp32.
        # Under tensor parallelism, of rank 0's KV heads (the most any rank holds):
        # kv_cache_memory is each rank's.
        self.kv_bytes_per_block = kv_cache_bytes_per_block(
            len(self.kv_groups[0].layers), self.model.config.num_kv_heads, c.head_dim,
            ec.block_size, ec.kv_cache_dtype)
        # K and V of one position over every layer (each group holds its own layers').
        self.kv_bytes_per_token = self.kv_bytes_per_block * num_groups // ec.block_size
        windows = [g.window for g in self.kv_groups]
        # Never more blocks than max_num_seqs full-length sequences could use; never so few
        # that the context would silently shrink to a handful of tokens (refused: checked
        # as if each group needed the whole context).
        blocks_cap = ec.max_num_seqs * blocks_for_sequence(
            self.max_model_len, ec.block_size, windows, ec.max_num_batched_tokens)
        num_blocks = (min(ec.check_kv_capacity(self.kv_bytes_per_block * num_groups,
                                               self.max_model_len) * num_groups, blocks_cap)
                      if ec.use_cache else 1)
        self.num_blocks = num_blocks
        self._new_scheduler()
        if ec.use_cache:  # a sequence may never outgrow the cache (it would stall)
            self.max_model_len = self.kv.max_tokens(num_blocks - self.kv.watermark_blocks,
                                                    ec.max_num_batched_tokens,
                                                    self.max_model_len)
        if self.tensor_parallel is not None:
            self.runner: ModelRunner = TensorParallelRunner(
                self.tensor_parallel, self.model, ec.block_size, num_blocks, ec.use_cache,
                ec.use_kernels, self.kv_groups, ec.kv_cache_dtype)
        else:
            self.runner = ModelRunner(self.model, ec.block_size, num_blocks, ec.use_cache,
                                      ec.use_kernels, self.kv_groups, ec.kv_cache_dtype)
        # Speculative decoding: drafts of up to num_speculative_tokens per sequence, adapted
        # to each one's recent acceptance; none while more than spec_max_batch sequences
        # decode (the step is compute-bound: draft rows would cost more than they save).
        self.proposer = self._make_proposer()
        self.grammars = GrammarCompiler(self.tokenizer, c.vocab_size, self.eos_token_ids())
        self.jump_forward = ec.jump_forward
        self.num_speculative_tokens = ec.num_speculative_tokens
        self.spec_max_batch = ec.speculative_max_batch
        self._spec: dict[str, _SpecState] = {}  # per sequence that has drafted
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}
        self._ids = itertools.count()
        self.total_positions = 0
        self.num_steps = 0
        # What the steps cost, charged to the requests that ran in them (attribution.py);
        # the weights' bytes read by all steps, which the requests' shares add up to.
        self.costs = ModelCosts.of(c, self.model.decode_read_bytes(), self.kv_bytes_per_token)
        self.weight_bytes_read = 0
        # Who watches the loop (a TraceRecorder): told of each step and each request's
        # arrival and abort. None costs one check per step.
        self.observer: StepObserver | None = None
        release_free_heap()

    def close(self) -> None:
        """Stop the tensor parallel ranks this engine started (a no-op without them)."""
        if self.tensor_parallel is not None:
            self._closer()

    def _make_proposer(self) -> Proposer | None:
        ec = self.config
        method = ec.speculative
        if method is None:
            return None
        if method == "ngram":
            return NgramProposer(ec.ngram_min, ec.ngram_max)
        # A draft model: this model with smaller weights ("self:int4"), or another file
        # that shares its tokenizer ("draft:PATH"). Same block size, its own KV pool.
        if method.startswith("self:"):
            checkpoint, quantization = self.checkpoint, method.removeprefix("self:")
        else:
            checkpoint, quantization = load_checkpoint(method.removeprefix("draft:")), "none"
            self._check_draft(checkpoint)
        native = ec.use_kernels and kernels.available()
        draft = load_model(checkpoint, ec.pack_weights, quantization, native=native)
        # The draft's pool has the target's block count: in the target's KV dtype, so that
        # its bytes shrink with the target's and not grow 4x with an int8 target's blocks.
        return DraftModelProposer(draft, ec.block_size, self.num_blocks, ec.use_kernels,
                                  ec.kv_cache_dtype)

    def _check_draft(self, draft: Checkpoint) -> None:
        """A draft's token ids must mean what the target's mean."""
        mine, theirs = self.tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
        if mine != theirs or draft.config.vocab_size != self.model_config.vocab_size:
            raise ModelLoadError(f"the draft model {draft.name} does not share the target's "
                                 f"tokenizer ({len(theirs)} vs {len(mine)} tokens)")

    def _new_scheduler(self) -> None:
        ec = self.config
        self.kv = KVCacheManager(self.num_blocks, ec.block_size, ec.enable_prefix_caching,
                                 group_windows=[g.window for g in self.kv_groups],
                                 bytes_per_block=self.kv_bytes_per_block,
                                 kv_dtype=ec.kv_cache_dtype,
                                 cache_reserve=int(ec.prefix_cache_memory)
                                 // self.kv_bytes_per_block)
        self.scheduler = Scheduler(
            SchedulerConfig(ec.max_num_seqs, ec.max_num_batched_tokens, ec.use_cache,
                            self.model_config.head_cost_ratio(),
                            ec.max_prefill_tokens_while_decoding,
                            self.model_config.attention_cost_ratio()), self.kv)

    def reset(self) -> None:
        """Forget every request and the prefix cache, keeping the model and the KV memory.

        For recovery after a failure that left the bookkeeping in an unknown state (the
        async engine's supervisor): callers must already have failed the requests."""
        if self.observer is not None:  # its sequences end here: a watcher must not keep them
            now = time.perf_counter()
            for seq_id in list(self._seq_to_group):
                self._observe(self.observer.on_aborted, seq_id, now)
        self._new_scheduler()
        self.runner.reset()
        if self.proposer is not None:
            for rid in self._seq_to_group:
                self.proposer.release(rid)
        self._groups.clear()
        self._seq_to_group.clear()
        self._spec.clear()

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
        if not ids and text is not None:
            # An empty text prompt (valid in the OpenAI API) starts from the beginning of a
            # document: the BOS token, or the end token where the model has none (GPT-2's
            # convention).
            start = self.model_config.bos_token_id
            if start is None:
                start = self.tokenizer.bos_token_id
            ids = [start] if start is not None else list(self.eos_token_ids()[:1])
        if not ids:
            raise InvalidParamsError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        # Ids the sampler indexes logits with: out of range, they would fail the whole step.
        for name, ids_in in (("logit_bias", params.logit_bias or {}),
                             ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids_in if not 0 <= t < vocab]
            if bad:
                raise InvalidParamsError(f"{name} token ids must be in [0, {vocab}), got "
                                         f"{bad[:5]}", param=name)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                f"(room is needed for at least one generated token)"
            )
        # Compiled before anything is queued: a bad schema or grammar is the caller's error.
        matcher = self.grammars.matcher(params.structured) if params.structured else None
        if params.prompt_logprobs is not None and not self.config.use_cache:
            raise InvalidParamsError("prompt_logprobs needs the KV cache (use_cache=True)",
                                     param="prompt_logprobs")
        check_prompt_logprobs(len(ids), params.prompt_logprobs, self.config.max_prompt_logprobs)
        eos = self.eos_token_ids()
        first_id = request_id if params.n == 1 and params.num_beams == 1 else f"{request_id}#0"
        group = _Group(request_id, text, ids, params, [])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = PromptLogprobs(len(ids), params.prompt_logprobs)
        if params.num_beams > 1:
            group.beam = BeamSearch(
                params.num_beams, min(params.max_tokens, self.max_model_len - len(ids)),
                params.length_penalty, params.early_stopping, () if params.ignore_eos else eos)
            first = Request(first_id, ids, self._beam_row_params(params, len(eos)), eos,
                            priority, self.max_model_len)
            group.beam_scores[first_id] = 0.0
            group.num_beam_seqs = 1
        else:
            first = Request(first_id, ids, self._sibling_params(params, 0), eos, priority,
                            self.max_model_len)
            # n > 1: the siblings draw their first token from the same logits, then fork.
            first.fork_samples = [(f"{request_id}#{i}", self._sibling_params(params, i))
                                  for i in range(1, params.n)]
            group.num_pending_forks = params.n - 1
        group.seqs.append(SeqOutputState(first, IncrementalDetokenizer(self.tokenizer, ids), 0,
                                         matcher=matcher))
        # Admission control first (may raise), so nothing half-queued is left behind.
        self.scheduler.add_request(first)
        self._seq_to_group[first_id] = group
        self._groups[request_id] = group
        if self.observer is not None:
            self._observe(self.observer.on_added, first_id, first.metrics.arrival_time)
        return request_id

    @staticmethod
    def _sibling_params(params: SamplingParams, i: int) -> SamplingParams:
        """Sibling i of an n > 1 request: seeded, it gets its own stream (seed + i)."""
        if params.n == 1 or (params.seed is None and i == 0):
            return params
        return replace(params, n=1, seed=params.sibling_seed(i))

    @staticmethod
    def _beam_row_params(params: SamplingParams, num_eos: int) -> SamplingParams:
        """A beam's row asks the sampler for the top 2B (more with several end tokens)
        raw log-probs; the beam step, not the sampler, picks the tokens."""
        row = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)
        row.logprobs = max(2, 1 + num_eos) * params.num_beams  # may exceed the user cap of 20
        return row

    def abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        ids = self._seq_ids(group)
        if self.observer is not None:
            now = time.perf_counter()
            for sid in ids:
                if sid in self.scheduler.requests:  # not ended already
                    self._observe(self.observer.on_aborted, sid, now)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def stats(self) -> SchedulerStats:
        return replace(self.scheduler.stats(), num_steps=self.num_steps)

    def kv_block_map(self) -> BlockMap:
        """Every KV block's state and owner now: for a step observer, on this thread."""
        return self.kv.block_map()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One transaction: the scheduler proposes, the runner executes, then the scheduler
        commits progress and the engine appends each sequence's token.

        Failures stay where they happen: a forward that raises fails the requests of this
        step (nothing of theirs is committed, their blocks are freed); an error in one
        request's own work (detokenizing, stop checks, the beam step) fails that request.
        Either way the engine goes on serving the rest.
        """
        start, index = time.perf_counter(), self.num_steps
        sched = self.scheduler.schedule()
        watch = self._watch(sched) if self.observer is not None else None
        if sched.is_empty:
            if watch is not None and sched.preempted_ids:
                self._record_step(sched, index, start, watch, {})
            return []
        now = time.perf_counter()
        for scheduled in sched.seqs:
            m = self.scheduler.requests[scheduled.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        try:
            result = self.runner.execute(sched, self._grammar_masks(sched))
        except Exception as e:
            logger.exception("the forward of step %d failed; failing its %d sequences",
                             self.num_steps, len(sched.seqs))
            failed = self._fail_step(sched, e)
            if watch is not None:
                self._record_step(sched, index, start, watch, {}, repr(e))
            return failed
        accepted = result.num_accepted()
        cost = self._charge(sched)
        self.scheduler.commit(sched, accepted)
        self.total_positions += result.num_tokens
        self.num_steps += 1
        now = time.perf_counter()

        # The step's sampled tokens, per user request (siblings and beams together).
        per_group: dict[str, tuple[_Group, dict[str, list[SampledToken]]]] = {}
        for rid, tok in result.sampled.items():
            # An n > 1 sibling not yet forked is known only by its id: "<request id>#<i>".
            group = self._seq_to_group.get(rid) or self._groups.get(rid.rpartition("#")[0])
            if group is not None:
                per_group.setdefault(group.request_id, (group, {}))[1][rid] = tok
        for rid, chunk in result.prompt_logprobs.items():
            group = self._seq_to_group.get(rid)
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs.write(chunk)
                per_group.setdefault(group.request_id, (group, {}))
        for s in sched.seqs:
            # Only scoring the prompt: a last chunk of only the final position scores and
            # samples nothing, and the request must still finish in this step.
            if s.params.max_tokens == 0 and (group := self._seq_to_group.get(s.request_id)):
                per_group.setdefault(group.request_id, (group, {}))
        outputs = []
        for group, sampled in per_group.values():
            try:
                self._advance(group, sampled, now)
                outputs.append(self._make_output(group))
            except Exception as e:
                logger.exception("request %s failed", group.request_id)
                outputs.append(self._fail_group(group, f"the request failed: {e!r}"))
            if group.finished:
                self._forget(group)
        if self.proposer is not None:
            self._adapt_draft_lengths(sched, accepted)
        if self.proposer is not None or self.jump_forward:
            self._propose_drafts()
        if watch is not None:
            self._record_step(sched, index, start, watch,
                              {rid: len(toks) for rid, toks in result.sampled.items()},
                              cost=cost)
        return outputs

    def _charge(self, sched: SchedulerOutput) -> tuple[float, float, float]:
        """Each sequence of a step whose forward ran gets its FLOPs and bytes (before the
        step's tokens are appended: a request with no first token yet is still in its
        prefill, which decode_bytes leaves out). Returns the step's (FLOPs, weight bytes,
        KV bytes), for the step observer's roofline."""
        self.weight_bytes_read += self.costs.weight_bytes
        flops = kv_bytes = 0.0
        for s, cost in zip(sched.seqs, self.costs.step(sched.seqs), strict=True):
            flops += cost.flops
            kv_bytes += cost.kv_bytes
            req = self.scheduler.requests.get(s.request_id)
            if req is None:
                continue
            m = req.metrics
            m.flops += cost.flops
            m.weight_bytes += cost.weight_bytes
            m.kv_bytes += cost.kv_bytes
            if m.first_token_time is not None:
                m.decode_bytes += cost.weight_bytes + cost.kv_bytes
        return flops, float(self.costs.weight_bytes), kv_bytes

    # -- the observer (only while one is attached) -----------------------------------------
    def _watch(self, sched: SchedulerOutput) -> tuple[list[Phase], list[Request]]:
        """Before the forward: each scheduled sequence's phase, and its Request (the
        scheduler forgets the ones that finish; the record reads how they ended)."""
        return (seq_phases(sched, self.config.use_cache),
                [self.scheduler.requests[s.request_id] for s in sched.seqs])

    def _record_step(self, sched: SchedulerOutput, index: int, start: float,
                     watch: tuple[list[Phase], list[Request]], new_tokens: dict[str, int],
                     error: str | None = None,
                     cost: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        if self.observer is None:  # detached by a failure earlier in this step
            return
        pool = self.kv.pool
        self._observe(self.observer.on_step, step_record(
            index, start, time.perf_counter(), sched, *watch, new_tokens, pool.num_free,
            pool.num_blocks, error, cost))

    def _observe(self, method: Callable[..., None], *args: object) -> None:
        """Call one of the observer's methods; a bug in it is logged and detaches it, and
        never fails a request (what it recorded so far stays with it)."""
        try:
            method(*args)
        except Exception:
            logger.exception("the step observer failed; it is detached")
            self.observer = None

    def _matcher(self, seq_id: str) -> LLMatcher | None:
        group = self._seq_to_group.get(seq_id)
        if group is None or group.params.structured is None:
            return None
        return next((q.matcher for q in group.seqs if q.request_id == seq_id), None)

    def _grammar_masks(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """The allowed-token bitmasks of every sequence under a grammar that samples now:
        [1 + num_draft, ceil(V / 32)], one row per token it may gain this step."""
        masks = {}
        plain: list[tuple[str, LLMatcher]] = []  # one row each: computed together
        for s in sched.seqs:
            matcher = self._matcher(s.request_id) if s.sample else None
            if matcher is None:
                continue
            if s.num_draft:
                masks[s.request_id] = self.grammars.fill_masks(matcher, s.draft_token_ids)
            else:
                plain.append((s.request_id, matcher))
        if plain:
            batch = self.grammars.fill_batch([m for _, m in plain])  # [N, W]
            for i, (rid, _) in enumerate(plain):
                masks[rid] = batch[i:i + 1]
        return masks

    def _adapt_draft_lengths(self, sched: SchedulerOutput, accepted: dict[str, int]) -> None:
        """Each sequence's next draft length follows its acceptance (see _SpecState)."""
        for s in sched.seqs:
            if s.num_draft and not s.forced:
                state = self._spec.setdefault(s.request_id,
                                              _SpecState(self.num_speculative_tokens))
                state.update(s.num_draft, accepted.get(s.request_id, 0),
                             self.num_speculative_tokens)

    def _propose_drafts(self) -> None:
        """Drafts for the next step, for every sequence that will decode in it.

        A sequence under a grammar first takes the grammar's forced tokens (jump-forward):
        where the schema allows one continuation (a key, its quotes and colon) they run
        as drafts, so the model writes them in one step instead of one step each. They are
        verified like any draft: the output is the same tokens as one-at-a-time constrained
        decoding, and the forward had to run them anyway to write their keys and values.
        Otherwise the proposer guesses (speculative decoding), cut where the grammar would
        refuse a guess.
        """
        running = self.scheduler.running
        speculate = self.proposer is not None and len(running) <= self.spec_max_batch
        asks: list[tuple[Request, DraftRequest]] = []
        for req in running:
            req.spec_token_ids, req.spec_forced = [], False
            group = self._seq_to_group.get(req.request_id)
            if group is None or group.beam is not None:
                continue  # beam search ranks whole beams
            if req.num_computed_tokens != req.num_tokens - 1:
                # Still prefilling. (Forced tokens could ride on the prompt's last chunk,
                # but with quantized weights a prompt-sized step runs other kernels than
                # a decode step (bf16 activations from 16 rows, int8 below), so their keys
                # and values would differ slightly from one-token-a-step decoding's.)
                continue
            p = req.params
            room = self._draft_room(req)
            if room > 0 and self._force(req, room):
                continue
            if not speculate or not p.speculative:
                continue  # compute-bound batch, or the request opted out
            state = self._spec.get(req.request_id)
            k = min(state.next_k() if state else self.num_speculative_tokens, room)
            if p.num_speculative_tokens is not None:
                k = min(k, p.num_speculative_tokens)
            if k > 0:
                asks.append((req, DraftRequest(req.request_id, req.all_token_ids, k)))
        if not asks:
            return
        assert self.proposer is not None
        try:
            drafts = self.proposer.propose([a for _, a in asks])
        except Exception:  # a proposer's failure costs speed, never a request
            logger.exception("the proposer failed; this step runs without drafts")
            for req, _ in asks:
                self.proposer.release(req.request_id)
            return
        for (req, ask), d in zip(asks, drafts, strict=True):
            d = list(d[:ask.k])
            matcher = self._matcher(req.request_id)
            if matcher is not None:  # a guess the grammar refuses is a wasted row
                d = d[:self.grammars.valid_prefix(matcher, d)]
            req.spec_token_ids = d

    def _draft_room(self, req: Request) -> int:
        """Drafts `req` may run: never past max_tokens (the step's own token counts too)
        or the context."""
        return min(req.params.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens)

    def _force(self, req: Request, room: int) -> bool:
        """Jump-forward: give `req` its grammar's forced tokens (at most `room`) as drafts;
        False when it has none."""
        if not self.jump_forward or req.fork_samples:
            return False  # n > 1 siblings still sample from this sequence's row
        matcher = self._matcher(req.request_id)
        forced = self.grammars.forced_tokens(matcher)[:room] if matcher is not None else []
        if not forced:
            return False
        req.spec_token_ids, req.spec_forced = forced, True
        return True

    def _advance(self, group: _Group, sampled: dict[str, list[SampledToken]],
                 now: float) -> None:
        """Append this step's tokens to the group's sequences and finish the ones done."""
        finished: dict[RequestStatus, list[str]] = {}
        if group.num_pending_forks and group.seqs[0].request_id in sampled:
            # n > 1: siblings fork from their parent before anyone appends a token.
            self._fork_siblings(group, sampled)
        if group.beam is not None:
            for rid, cand in sampled.items():
                group.beam_candidates[rid] = cand[0].top_logprobs or []
            if len(group.beam_candidates) == len(group.beam_scores):
                self._beam_step(group, now)
            return
        for seq in group.seqs:
            for tok in sampled.get(seq.request_id, ()):
                # A stop inside an accepted run ends the sequence: the rest is dropped.
                if self._append(seq, tok, now, finished):
                    break
            req = seq.request
            if req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
                # Only scoring the prompt: it ran, so the request is done.
                req.metrics.finished_time = now
                finished.setdefault(RequestStatus.FINISHED_LENGTH, []).append(req.request_id)
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        groups = {g.request_id: g for s in sched.seqs
                  if (g := self._seq_to_group.get(s.request_id)) is not None}
        outputs = []
        for group in groups.values():
            outputs.append(self._fail_group(
                group, f"the model's forward pass failed in this request's step: {error!r}"))
            self._forget(group)
        return outputs

    def _fail_group(self, group: _Group, message: str) -> RequestOutput:
        """End every sequence of `group` with status error, free its blocks, and report."""
        group.error = message
        self.scheduler.finish_requests(self._seq_ids(group), RequestStatus.FINISHED_ERROR)
        first = group.seqs[0].request
        first.metrics.finished_time = time.perf_counter()
        comps = [CompletionOutput(index=s.index, text=s.text, token_ids=list(
                     s.request.output_token_ids), finish_reason=RequestStatus.FINISHED_ERROR.value)
                 for s in group.seqs] if group.beam is None else []
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps,
                             True, first.metrics, error=message)

    def _seq_ids(self, group: _Group) -> list[str]:
        """Every sequence id of `group` the engine knows, including beams forked by a beam
        step that raised before it could list them in group.seqs."""
        ids = dict.fromkeys(s.request.request_id for s in group.seqs)
        if group.beam is not None:
            ids.update(dict.fromkeys(r for r, g in self._seq_to_group.items() if g is group))
        return list(ids)

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for rid in self._seq_ids(group):
            self._seq_to_group.pop(rid, None)
            self._spec.pop(rid, None)
            if self.proposer is not None:
                self.proposer.release(rid)

    def _append(self, seq: SeqOutputState, tok: SampledToken, now: float,
                finished: dict[RequestStatus, list[str]]) -> bool:
        """Add one token; True when it finished the sequence."""
        req = seq.request
        status = seq.append(tok.token_id, tok.logprob, tok.top_logprobs)
        if seq.matcher is not None:
            if not seq.matcher.consume_token(tok.token_id):
                raise RuntimeError(f"token {tok.token_id} broke the request's grammar: "
                                   f"{seq.matcher.get_error()}")
            if status is None and seq.matcher.is_stopped():  # the grammar is complete
                status = RequestStatus.FINISHED_STOPPED
        m = req.metrics
        # Per sequence (the longest, for n > 1), so time per output token stays per step.
        m.num_output_tokens = max(m.num_output_tokens, len(req.output_token_ids))
        m.last_token_time = now
        if m.first_token_time is None:
            m.first_token_time = now
        if status is None:
            return False
        seq.finish(status)
        m.finished_time = now
        finished.setdefault(status, []).append(req.request_id)
        return True

    def _new_seq(self, group: _Group, seq_id: str, params: SamplingParams,
                 parent: Request, index: int) -> SeqOutputState:
        """A sequence forked from `parent`: same prompt and progress, shared KV blocks."""
        req = Request(seq_id, group.prompt_token_ids, params, parent.eos_token_ids,
                      parent.priority, parent.max_model_len)
        req.output_token_ids = list(parent.output_token_ids)
        # One metrics record per user request: siblings' and beams' work adds up in it.
        req.metrics = parent.metrics
        self.scheduler.fork(parent, req)
        self._seq_to_group[seq_id] = group
        # A sibling continues from the parent's grammar state, on a copy of its own.
        matcher = group.seqs[0].matcher
        return SeqOutputState(req, IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids),
                              index, matcher=matcher.deep_copy() if matcher is not None else None)

    def _fork_siblings(self, group: _Group, sampled: dict[str, list[SampledToken]]) -> None:
        parent = group.seqs[0].request
        for i, (sid, params) in enumerate(parent.fork_samples, start=1):
            if sid in sampled:
                group.seqs.append(self._new_seq(group, sid, params, parent, i))
        parent.fork_samples = []
        group.num_pending_forks = 0

    def _beam_step(self, group: _Group, now: float) -> None:
        """All live beams have their continuations: advance the search by one token."""
        assert group.beam is not None
        live = [s for s in group.seqs if s.request.request_id in group.beam_scores]
        inputs = [(s.request.output_token_ids, group.beam_scores[s.request.request_id],
                   group.beam_candidates[s.request.request_id]) for s in live]
        step = group.beam.step(inputs)
        group.beam_candidates.clear()
        claimed: set[int] = set()
        moves: list[tuple[SeqOutputState, int, float]] = []
        if not step.done:
            # Forks first: a child copies its parent's tokens before the parent grows.
            for parent_i, token, score in step.next_beams:
                if parent_i in claimed:
                    parent = live[parent_i].request
                    sid = f"{group.request_id}#{group.num_beam_seqs}"
                    group.num_beam_seqs += 1
                    moves.append((self._new_seq(group, sid, parent.params, parent, 0),
                                  token, score))
                else:
                    claimed.add(parent_i)
                    moves.append((live[parent_i], token, score))
        dropped = [s.request.request_id for i, s in enumerate(live) if i not in claimed]
        group.beam_scores = {}
        for seq, token, score in moves:
            seq.request.output_token_ids.append(token)
            group.beam_scores[seq.request.request_id] = score
        m = live[0].request.metrics
        m.last_token_time = now
        m.num_output_tokens = group.beam.num_generated
        if m.first_token_time is None:
            m.first_token_time = now
        self.scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
        for sid in dropped:
            self._seq_to_group.pop(sid, None)
        group.seqs = [m[0] for m in moves]
        if step.done:
            n_ret = group.params.num_return_sequences or group.params.num_beams
            group.beam_results = []
            for i, h in enumerate(group.beam.results(n_ret)):
                text = self.tokenizer.decode(h.token_ids)
                group.beam_results.append(CompletionOutput(
                    index=i, text=text, token_ids=h.token_ids,
                    finish_reason=("stop" if h.token_ids and h.token_ids[-1] in
                                   group.beam.eos_token_ids else "length"),
                    cumulative_logprob=h.cumulative_logprob, score=h.score,
                    delta=text, delta_token_ids=list(h.token_ids)))  # arrives whole
            group.seqs = live[:1]  # keeps the metrics holder

    def _make_output(self, group: _Group) -> RequestOutput:
        first = group.seqs[0].request
        if group.beam is not None:  # beams are not streamed: outputs come at the end
            first.metrics.finished_time = time.perf_counter() if group.finished else None
            return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                                 group.beam_results or [], group.finished, first.metrics)
        # The whole history only once, in the final output; a running output carries what
        # is new this step (copying every list every step made a request O(n^2)).
        final = group.finished
        comps = []
        for s in group.seqs:
            req = s.request
            delta, delta_ids = s.take_delta(req.is_finished)
            n_new = len(s.logprobs) - len(delta_ids)
            want_lp, want_top = req.params.logprobs is not None, bool(req.params.logprobs)
            comps.append(CompletionOutput(
                index=s.index,
                text=s.text if final else "",
                token_ids=list(req.output_token_ids) if final else [],
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                logprobs=(list(s.logprobs) if final else []) if want_lp else None,
                top_logprobs=(list(s.top_logprobs) if final else []) if want_top else None,
                cumulative_logprob=s.cumulative_logprob,
                delta=delta,
                delta_token_ids=delta_ids,
                delta_logprobs=s.logprobs[n_new:] if want_lp else None,
                delta_top_logprobs=s.top_logprobs[n_new:] if want_top else None,
            ))
        out = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, comps,
                            group.finished, first.metrics)
        prompt_done = first.num_computed_tokens >= len(group.prompt_token_ids)
        if group.prompt_logprobs is not None and (
                final or (prompt_done and not group.prompt_logprobs_sent)):
            out.prompt_logprobs = group.prompt_logprobs.to_list()
            group.prompt_logprobs_sent = True
        return out
