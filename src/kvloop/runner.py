"""The runner executes what the scheduler decided: SchedulerOutput -> tensors -> model ->
sampler. It owns the KV-cache tensors and the per-request random generators, and never
decides who runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvloop import kernels
from kvloop.batch import ScheduledSeq, SchedulerOutput
from kvloop.dispatch import NATIVE_MAX_PREFILL, NATIVE_MAX_ROWS
from kvloop.models import AttentionMetadata, CausalLM, PrefillSegment
from kvloop.models.attention import (
    KVCacheGroup,
    causal_prefix_mask,
    flat_kv_index,
)
from kvloop.models.native import build_native_decoder, native_prefill_ready
from kvloop.models.rope import RotaryEmbedding
from kvloop.params import SamplingParams
from kvloop.quant.kv import PagedKV, kv_bytes_per_row
from kvloop.sampling import Sampler, SamplingRow
from kvloop.sampling.rejection import verify_drafts


def padded_block_tables(seqs: list[ScheduledSeq], group: int = 0) -> torch.Tensor:
    """[num_seqs, max_blocks] int64: KV cache group `group`'s tables, each row padded with
    block 0: the kernels stop at the context length, the PyTorch path masks what lies
    beyond it."""
    rows = ([s.block_ids for s in seqs] if group == 0
            else [s.group_block_ids[group - 1] for s in seqs])
    max_blocks = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows], dtype=torch.long)


def native_kv_args(caches: list[PagedKV]) -> tuple[list[torch.Tensor],
                                                   list[torch.Tensor] | None]:
    """The native decoder's kv_caches and kv_scales arguments (None unless int8)."""
    data = [c.data for c in caches]
    if caches and caches[0].scales is not None:
        return data, [c.scales for c in caches if c.scales is not None]
    return data, None


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


# One prompt token's log-prob under the model, and its top alternatives (when asked for).
PromptLogprob = tuple[float, list[tuple[int, float]] | None]
# Rows of logits ([rows, vocab] fp32, 100 MB at 512 rows of a 49k vocabulary) alive at a
# time while a chunk's prompt tokens are scored; only the small results outlive a block.
PROMPT_LOGPROB_ROWS = 512


@dataclass
class PromptLogprobChunk:
    """Log-probs of prompt tokens [start, start + R) of one sequence, from one step's chunk:
    small tensors (R x k), never the [R, vocabulary] logits they were taken from."""

    start: int  # index in the prompt of the first token scored
    logprobs: torch.Tensor  # [R] fp32: each prompt token's own log-prob
    top_ids: torch.Tensor | None  # [R, k] int64: the k likeliest tokens (None when k = 0)
    top_logprobs: torch.Tensor | None  # [R, k] fp32: their log-probs, best first

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])


@dataclass
class RunnerOutput:
    # Only sequences whose step ends in a sample: the tokens each gained, in order (one,
    # or a sequence's accepted drafts and the token after them).
    sampled: dict[str, list[SampledToken]]
    num_tokens: int  # positions the model processed this step
    # Sequences that asked for prompt log-probs: those of the prompt tokens this step's
    # chunk predicts (each position scores the token after it).
    prompt_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)

    def num_accepted(self) -> dict[str, int]:
        """Accepted draft tokens per sequence that gained more than one token."""
        return {rid: len(toks) - 1 for rid, toks in self.sampled.items() if len(toks) > 1}


def kv_cache_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int,
                             block_size: int, kv_dtype: str = "fp32") -> int:
    """K and V of one block over `num_layers` layers, as a `kv_dtype` cache stores them
    (int8: the codes and each row's scale): what ModelRunner allocates per block."""
    return 2 * num_layers * block_size * num_kv_heads * kv_bytes_per_row(kv_dtype, head_dim)


class ModelRunner:
    """`kv_groups`: the KV cache groups the scheduler's tables follow (kv_cache.py);
    None: one group of every layer, each layer keeping every position. `kv_dtype`: how
    the cache stores K and V (kvloop.quant.kv.KV_CACHE_DTYPES). `native_step` False: the
    PyTorch modules run every step (a tensor parallel shard, whose row-parallel layers
    all-reduce inside the modules' forward, which the C++ step does not call)."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int,
                 use_cache: bool = True, use_kernels: bool = True,
                 kv_groups: list[KVCacheGroup] | None = None,
                 kv_dtype: str = "fp32", native_step: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.kv_dtype = kv_dtype
        c = model.config
        self.kv_groups = kv_groups or [KVCacheGroup(tuple(range(c.num_layers)))]
        # Layer i keeps its K/V in tensor j when it is the j-th layer of its group, and
        # reads its group's metadata.
        slot_of_layer = [0] * c.num_layers
        group_of_layer = [0] * c.num_layers
        for g, group in enumerate(self.kv_groups):
            for j, layer in enumerate(group.layers):
                slot_of_layer[layer], group_of_layer[layer] = j, g
        self.layer_group = tuple(group_of_layer)
        # One PagedKV ([2, kv_heads, slots, head_dim] in kv_dtype, int8 with its scales) per
        # layer of a group (per layer when there is one group); slot = block * block_size
        # + offset.
        # Left uninitialised: the OS maps pages only as blocks are first written, so the
        # pool costs resident memory in proportion to use, not to kv_cache_memory. Nothing
        # reads a slot before it is written, except the PyTorch decode path's padding,
        # which points at slot 0 (masked out): block 0 is zeroed so that it is finite.
        self.kv_caches: list[PagedKV] | None = None  # per layer, shared within a slot
        self._kv_by_slot: list[PagedKV] = []
        if use_cache:
            self._kv_by_slot = [
                PagedKV.allocate(kv_dtype, c.num_kv_heads, num_blocks * block_size, c.head_dim)
                for _ in self.kv_groups[0].layers]
            for cache in self._kv_by_slot:
                cache.zero_(block_size)
            self.kv_caches = [self._kv_by_slot[j] for j in slot_of_layer]
        self.sampler = Sampler(native=use_kernels and kernels.available())
        # The native paged-attention kernel (built once, cached); the PyTorch gather + SDPA
        # path is the fallback and the reference it is tested against.
        self.use_kernels = use_cache and use_kernels and kernels.available()
        # The native step (all layers in one C++ call). Where every layer has a oneDNN
        # path for large inputs (native_prefill_ready) it serves every step, prefill
        # included; otherwise decode-only steps of up to native_max_rows sequences, and
        # larger batches stay on the modules' GEMMs.
        # Each layer follows its KV cache group's block table.
        self.decoder = (build_native_decoder(model, self.layer_group)
                        if self.use_kernels and native_step else None)
        self.native_max_rows = NATIVE_MAX_ROWS
        self.native_prefill = self.decoder is not None and native_prefill_ready(model)
        self._generators: dict[str, torch.Generator] = {}
        # The rope tables grow with the positions steps reach (RotaryEmbedding.reserve).
        self._ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]

    def reset(self) -> None:
        """Drop all per-request state (the engine forgot its requests)."""
        self._generators.clear()

    # -- per-request state ------------------------------------------------------------------
    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return g

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        if not pairs or self.kv_caches is None:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        for cache in self._kv_by_slot:
            cache.copy_slots(dst, src)

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                allowed: dict[str, torch.Tensor] | None = None) -> RunnerOutput:
        """Run the step. `allowed`: per sequence under a grammar, the bitmasks of tokens it
        may sample this step ([1 + num_draft, ceil(V / 32)] int32: row i after its token
        and drafts[:i]; see SamplingRow.allowed)."""
        allowed = allowed or {}
        for rid in sched.finished_ids:
            self._generators.pop(rid, None)
        seqs = sched.decodes + sched.prefills
        hidden, num_tokens = self._run_model(sched)  # [T, hidden]
        prompt_lps = self._prompt_logprobs(seqs, hidden)

        # Logits only where a token is sampled: each sequence's last row, if it samples
        # (n > 1 siblings draw from the same row, each with its own generator), and for a
        # sequence with drafts, the row of its token and of each draft.
        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        ids_out: list[str] = []
        spec_hidden: list[int] = []
        spec_rows: list[SamplingRow] = []
        spec_drafts: list[list[int]] = []
        spec_ids: list[str] = []
        last = -1
        for s in seqs:
            last += s.num_tokens
            if not s.sample:
                continue
            if s.num_draft:
                spec_hidden.extend(range(last - s.num_draft, last + 1))
                spec_rows.extend(self._draft_rows(s, allowed.get(s.request_id)))
                spec_drafts.append(s.draft_token_ids)
                spec_ids.append(s.request_id)
                continue
            masks = allowed.get(s.request_id)
            # n > 1 siblings not yet forked share their parent's grammar state.
            for rid, params in [(s.request_id, s.params), *s.fork_samples]:
                hidden_rows.append(last)
                rows.append(SamplingRow(params, s.prompt_ids, s.output_ids,
                                        self._generator(rid, params), s.suppress_ids,
                                        masks[0] if masks is not None else None))
                ids_out.append(rid)
        if not rows and not spec_rows:
            return RunnerOutput({}, num_tokens, prompt_lps)
        all_rows = hidden_rows + spec_hidden
        logits = self._logits(hidden[all_rows])  # [N, V]
        sampled: dict[str, list[SampledToken]] = {}
        if rows:
            out = self.sampler(logits[: len(rows)], rows)
            ids, lps = out.token_ids.tolist(), out.logprobs.tolist()
            for i, rid in enumerate(ids_out):
                sampled[rid] = [SampledToken(ids[i], lps[i], out.top_logprobs[i])]
        if spec_rows:
            verified = verify_drafts(self.sampler, logits[len(rows):], spec_rows, spec_drafts)
            for rid, toks in zip(spec_ids, verified, strict=True):
                sampled[rid] = [SampledToken(t.token_id, t.logprob, t.top_logprobs)
                                for t in toks]
        return RunnerOutput(sampled, num_tokens, prompt_lps)

    @torch.inference_mode()
    def greedy_tokens(self, sched: SchedulerOutput) -> dict[str, int]:
        """The argmax after each sequence's last token: a draft model's step, which needs
        neither the sampler nor log-probs."""
        hidden, _ = self._run_model(sched)  # [T, hidden]
        seqs = sched.decodes + sched.prefills
        last = list(itertools.accumulate(s.num_tokens for s in seqs))
        tokens = self._logits(hidden[[i - 1 for i in last]]).argmax(dim=-1).tolist()
        return {s.request_id: t for s, t in zip(seqs, tokens, strict=True)}

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor
                         ) -> dict[str, PromptLogprobChunk]:
        """Log-probs of the prompt tokens that follow each position of a prompt chunk,
        for the sequences that asked for them (row p's logits score prompt token p + 1)."""
        out: dict[str, PromptLogprobChunk] = {}
        offset = 0
        for s in seqs:
            n_top = s.params.prompt_logprobs
            end = min(s.context_len, len(s.prompt_ids) - 1)  # last row scoring a prompt token
            if n_top is not None and s.start_pos < end:
                targets = torch.tensor(s.prompt_ids[s.start_pos + 1:end + 1])  # [R]
                rows = hidden[offset:offset + end - s.start_pos]  # [R, hidden]
                out[s.request_id] = self._score_rows(rows, targets, n_top, s.start_pos + 1)
            offset += s.num_tokens
        return out

    def _score_rows(self, rows: torch.Tensor, targets: torch.Tensor, n_top: int,
                    start: int) -> PromptLogprobChunk:
        """Each row's log-prob of its target and its top `n_top`, PROMPT_LOGPROB_ROWS rows
        of logits at a time. log p = logit - logsumexp(logits): the top-k of the logits is
        the top-k of the log-probs, so no second [rows, vocab] tensor is made."""
        chosen: list[torch.Tensor] = []
        top_ids: list[torch.Tensor] = []
        top_lps: list[torch.Tensor] = []
        for i in range(0, rows.shape[0], PROMPT_LOGPROB_ROWS):
            logits = self._logits(rows[i:i + PROMPT_LOGPROB_ROWS]).float()  # [r, V]
            lse = logits.logsumexp(dim=-1, keepdim=True)  # [r, 1]
            tgt = targets[i:i + PROMPT_LOGPROB_ROWS, None]  # [r, 1]
            chosen.append((logits.gather(1, tgt) - lse)[:, 0])  # [r]
            if n_top:
                values, ids = logits.topk(min(n_top, logits.shape[-1]), dim=-1)  # [r, k]
                top_ids.append(ids)
                top_lps.append(values - lse)
            del logits  # [r, V]: freed before the next block's is made
        return PromptLogprobChunk(start, torch.cat(chosen),
                                  torch.cat(top_ids) if n_top else None,
                                  torch.cat(top_lps) if n_top else None)

    @torch.inference_mode()
    def hidden_states(self, sched: SchedulerOutput) -> torch.Tensor:  # [T, hidden]
        """The step's forward alone, no sampling: what a tensor parallel rank > 0 runs."""
        return self._run_model(sched)[0]

    def _run_model(self, sched: SchedulerOutput) -> tuple[torch.Tensor, int]:
        """The forward over the step's tokens: [T, hidden] and T."""
        self.copy_blocks(sched.blocks_to_copy)
        reach = max((s.context_len for s in sched.decodes + sched.prefills), default=0)
        for rope in self._ropes:  # a comparison each, unless a table must grow
            rope.reserve(reach)
        if self._use_native(sched):
            return self._native_step(sched), sched.num_tokens
        return self._forward(sched)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        if self.decoder is not None and hidden.shape[0] <= self.native_max_rows:
            return self.decoder.logits(hidden)  # type: ignore[no-any-return]
        return self.model.compute_logits(hidden)

    def _draft_rows(self, s: ScheduledSeq, masks: torch.Tensor | None) -> list[SamplingRow]:
        """The k + 1 sampling rows of a sequence with k drafts: row i follows the output
        so far plus drafts[:i], which its penalties, min_tokens and grammar mask
        (masks[i], [ceil(V / 32)]) see as history."""
        p = s.params
        gen = self._generator(s.request_id, p)
        drafts = s.draft_token_ids
        uses_history = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                        or p.frequency_penalty != 0.0)
        rows = []
        for i in range(len(drafts) + 1):
            history = [*s.output_ids, *drafts[:i]] if uses_history and i else s.output_ids
            suppress = s.suppress_ids if len(s.output_ids) + i < p.min_tokens else ()
            rows.append(SamplingRow(p, s.prompt_ids, history, gen, suppress,
                                    masks[i] if masks is not None else None))
        return rows

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, int]:
        """The PyTorch modules over the step's flattened tokens: [T, hidden] and T."""
        token_ids: list[int] = []
        positions: list[int] = []
        for s in sched.decodes + sched.prefills:
            token_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.context_len))
        input_ids = torch.tensor(token_ids, dtype=torch.long)  # [T]
        pos = torch.tensor(positions, dtype=torch.long)  # [T]
        meta = self._metadata(sched, pos)
        hidden = self.model(input_ids, pos, meta, self.kv_caches)  # [T, hidden]
        return hidden, len(token_ids)

    def _use_native(self, sched: SchedulerOutput) -> bool:
        if self.decoder is None or not sched.use_cache or not (sched.decodes or sched.prefills):
            return False
        if self.native_prefill:
            return all(s.num_tokens <= NATIVE_MAX_PREFILL for s in sched.prefills)
        return not sched.prefills and len(sched.decodes) <= self.native_max_rows

    def _native_step(self, sched: SchedulerOutput) -> torch.Tensor:  # [T, hidden]
        """The step's tokens through the C++ decoder: all layers in one call. Decode rows
        are one token each; a prefill's rows are the chunk's positions."""
        assert self.decoder is not None and self.kv_caches is not None
        bs = self.block_size
        seqs = sched.decodes + sched.prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids)
            span = range(s.start_pos, s.context_len)
            pos.extend(span)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in span)
        # None for a decode-only step: one row per sequence.
        query_start = (torch.tensor([0, *itertools.accumulate(s.num_tokens for s in seqs)])
                       if sched.prefills else None)
        data, scales = native_kv_args(self.kv_caches)
        # Group 0's table gives `slots`; the other groups' tables go alongside.
        groups = [padded_block_tables(seqs, g) for g in range(1, len(self.kv_groups))]
        return self.decoder.forward(  # type: ignore[no-any-return]
            torch.tensor(ids), torch.tensor(pos), data, torch.tensor(slots),
            padded_block_tables(seqs), torch.tensor([s.context_len for s in seqs]), bs,
            query_start, scales, groups or None)

    def _metadata(self, sched: SchedulerOutput, pos: torch.Tensor) -> AttentionMetadata:
        meta = AttentionMetadata(num_decodes=len(sched.decodes))
        if not sched.use_cache:  # recompute mode: each sequence attends to its own fresh K/V
            start = 0
            for s in sched.prefills:
                meta.prefills.append(PrefillSegment(start, s.num_tokens))
                start += s.num_tokens
            return meta

        seqs = sched.decodes + sched.prefills
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(seqs)), torch.tensor([s.num_tokens for s in seqs]))  # [T]
        self._cache_metadata(meta, sched, pos, seq_of_row, padded_block_tables(seqs))
        if len(self.kv_groups) > 1:
            groups = [meta]
            for g in range(1, len(self.kv_groups)):
                m = AttentionMetadata(num_decodes=len(sched.decodes))
                self._cache_metadata(m, sched, pos, seq_of_row, padded_block_tables(seqs, g))
                groups.append(m)
            meta.groups, meta.layer_group = tuple(groups), self.layer_group
        return meta

    def _cache_metadata(self, meta: AttentionMetadata, sched: SchedulerOutput,
                        pos: torch.Tensor, seq_of_row: torch.Tensor,
                        tables: torch.Tensor) -> None:
        """Fill in where one KV cache group's tables (`tables` [num_seqs, max_blocks])
        put the step's new K/V and what each sequence attends to."""
        bs = self.block_size
        meta.slot_mapping = tables[seq_of_row, pos // bs] * bs + pos % bs  # [T]

        heads, num_slots = self.model.config.num_kv_heads, self.num_slots
        if sched.decodes and self.use_kernels:
            meta.decode_block_tables = tables[: len(sched.decodes)]  # padding is never read
            meta.decode_context_lens = torch.tensor([s.context_len for s in sched.decodes])
            meta.block_size = bs
        elif sched.decodes:
            n = len(sched.decodes)
            ctx = torch.tensor([s.context_len for s in sched.decodes])  # [B]
            S = int(ctx.max())
            slots = (tables[:n, :, None] * bs + torch.arange(bs)).view(n, -1)[:, :S]  # [B, S]
            pad = None
            if int(ctx.min()) != S:
                # A shorter context's padding reads zeroed slot 0, never its own block's
                # unwritten slots: masked scores weigh 0, but 0 * NaN left in reused memory
                # would still be NaN.
                pad = torch.arange(S) >= ctx[:, None]  # [B, S]
                slots = slots.masked_fill(pad, 0)
            meta.decode_kv_index = flat_kv_index(slots, heads, num_slots)
            meta.decode_shape = (n, S)
            if pad is not None:
                # Additive float mask: SDPA's CPU kernel was faster with it than with bool.
                meta.decode_mask = torch.zeros(n, 1, 1, S).masked_fill_(
                    pad.view(n, 1, 1, S), float("-inf"))

        start = len(sched.decodes)
        for i, s in enumerate(sched.prefills, start=len(sched.decodes)):
            seg = PrefillSegment(start, s.num_tokens)
            if s.start_pos > 0:  # prefix cached or an earlier chunk: attend to the cache
                ctx_len = s.context_len
                slots = (tables[i, :, None] * bs + torch.arange(bs)).view(1, -1)[:, :ctx_len]
                seg.kv_index = flat_kv_index(slots, heads, num_slots)
                seg.mask = causal_prefix_mask(s.num_tokens, ctx_len)
            meta.prefills.append(seg)
            start += s.num_tokens
