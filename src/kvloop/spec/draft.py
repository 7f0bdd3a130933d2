"""A draft model proposes: a smaller model that shares the target's tokenizer (or the target
itself with 4-bit weights: quantized self-speculation) runs k cheap greedy decode steps, and
the target verifies them all in one forward.

The draft keeps its own paged KV cache, its own block tables and its own runner, so the
target's scheduler never sees it. Per sequence it remembers which tokens its cache holds;
each call it keeps the longest prefix those share with the sequence's tokens now (the
target rejected whatever follows), runs the rest in one catch-up chunk and then drafts.

Drafts are the draft's argmax, a point mass: the target's rejection rule then needs no q,
and sampled requests keep exactly the target's distribution (kvloop.sampling.rejection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloop.batch import ScheduledSeq, SchedulerOutput
from kvloop.kv_cache import KVCacheManager
from kvloop.models import CausalLM
from kvloop.params import SamplingParams
from kvloop.request import Request
from kvloop.runner import ModelRunner
from kvloop.spec.proposer import DraftRequest

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftSeq:
    request: Request  # the draft cache's bookkeeping: id and computed tokens
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the draft holds
    trusted: int = 0  # leading tokens of `cached` known to be the target's own


class DraftModelProposer:
    def __init__(self, model: CausalLM, block_size: int, num_blocks: int,
                 use_kernels: bool = True, kv_dtype: str = "fp32") -> None:
        self.runner = ModelRunner(model, block_size, num_blocks, True, use_kernels,
                                  kv_dtype=kv_dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                                 watermark=0.0)
        self._seqs: dict[str, _DraftSeq] = {}

    def release(self, seq_id: str) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self.kv.free(seq_id)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.seq_id: [] for r in requests}
        live = [r for r in requests if r.k > 0 and r.token_ids]
        want = {r.seq_id: r.k for r in live}
        # Step 0: catch up on the tokens the draft has not seen (at least the sequence's
        # pending last token) and draft the first token from there.
        step: list[tuple[str, list[int], int]] = []  # (seq, tokens to run, start position)
        for r in live:
            st = self._seqs.get(r.seq_id) or self._new(r.seq_id)
            valid = self._valid_prefix(st, r.token_ids)
            start = min(valid, len(r.token_ids) - 1)  # always run the last token
            if not self._make_room(st, start, len(r.token_ids) - start,
                                   {q.seq_id for q in live}):
                continue  # no room in the draft's pool: this sequence goes without
            st.cached = list(r.token_ids)
            st.trusted = len(r.token_ids)
            step.append((r.seq_id, st.cached[start:], start))
        # Steps 1..k-1: one greedy decode step for every sequence that wants more.
        while step:
            sampled = self._run(step)
            nxt = []
            for sid, tokens, start in step:
                tok = sampled[sid]
                drafts[sid].append(tok)
                if len(drafts[sid]) >= want[sid]:
                    continue
                st = self._seqs[sid]
                pos = start + len(tokens)
                if not self._make_room(st, pos, 1, set(want)):
                    continue
                st.cached.append(tok)  # its K/V is written by the step that runs it
                nxt.append((sid, [tok], pos))
            step = nxt
        return [drafts[r.seq_id] for r in requests]

    # -- internals -------------------------------------------------------------------------
    def _new(self, seq_id: str) -> _DraftSeq:
        st = self._seqs[seq_id] = _DraftSeq(Request(seq_id, [0], _GREEDY))
        return st

    @staticmethod
    def _valid_prefix(st: _DraftSeq, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the draft's cache holds K/V for: the tokens
        it has run, up to the first one that differs (a rejected draft)."""
        n = min(len(st.cached), len(tokens))
        i = min(st.trusted, n)  # the target's own tokens never change
        while i < n and st.cached[i] == tokens[i]:
            i += 1
        return i

    def _make_room(self, st: _DraftSeq, start: int, n: int, keep: set[str]) -> bool:
        """Cache blocks for positions [start, start + n) of the sequence, dropping what lies
        past `start`; when the pool is full, sequences not drafting now give theirs up."""
        req = st.request
        self.kv.truncate(req.request_id, start)
        req.num_computed_tokens = start
        if self.kv.allocate(req, n):
            return True
        for sid in [s for s in self._seqs if s not in keep]:
            self.release(sid)
        if self.kv.allocate(req, n):
            return True
        self.release(req.request_id)
        return False

    def _run(self, step: list[tuple[str, list[int], int]]) -> dict[str, int]:
        """One forward of the draft over each sequence's tokens; its argmax after each."""
        out = SchedulerOutput()
        for sid, tokens, start in step:
            req = self._seqs[sid].request
            seq = ScheduledSeq(request_id=sid, token_ids=tokens, start_pos=start,
                               block_ids=self.kv.block_ids(sid), sample=True, params=_GREEDY,
                               prompt_ids=(), output_ids=())
            (out.decodes if len(tokens) == 1 and start > 0 else out.prefills).append(seq)
            req.num_computed_tokens = start + len(tokens)
        return self.runner.greedy_tokens(out)
