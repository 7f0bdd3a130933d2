"""llama.cpp as a benchmark peer, through llama-cpp-python's low-level C API (ctypes).

    peer = LlamaCppPeer(path, n_threads=2)
    peer.decode(prompt, 128)          # batch-1 decode tokens/s, timed after the first token
    peer.prefill(prompt)              # prompt tokens/s of one llama_decode over the prompt
    peer.throughput(prompts, 128)     # generated tokens/s, one sequence per prompt

Everything is greedy (argmax of the logits) and ignores EOS, like the kvloop and transformers
measurements it sits beside. The GGUF weights stay in their stored formats (Q4_1 / Q8_0 for the
default model): llama.cpp computes on them quantized. Prompts come in as token ids, so every
engine sees the same tokens; only `numpy`, `gguf` and `llama_cpp` are imported (no torch), so
the resident-set figure of a process running this peer is llama.cpp's own.

The C API renames things between versions; the few calls that moved are looked up by their
current name first and their older one second (`_api`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import llama_cpp
    from llama_cpp._logger import set_verbose
except ImportError:  # the harness reports llama.cpp as "not installed"
    llama_cpp = None


def available() -> bool:
    return llama_cpp is not None


def version() -> str:
    return str(getattr(llama_cpp, "__version__", "?")) if llama_cpp else "not installed"


def decode_read_bytes(path: str | Path) -> int:
    """Weight bytes llama.cpp reads per decode step: every tensor as stored in the GGUF file,
    except the token-embedding table (one row per token), unless the model has no separate
    `output.weight` and so uses the embedding table as its output head (read in full)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def _api(*names: str) -> Any:
    """The first of `names` this llama_cpp version has (the C API renames calls)."""
    for name in names:
        fn = getattr(llama_cpp, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"llama_cpp {version()} has none of {names}")


class _Context:
    """One llama_context (its own KV cache) and one llama_batch of `n_batch` token slots."""

    def __init__(self, model: Any, n_threads: int, n_ctx: int, n_batch: int, n_ubatch: int,
                 n_seq_max: int = 1) -> None:
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        p.n_threads = p.n_threads_batch = n_threads
        if hasattr(p, "kv_unified"):
            # One KV stream per sequence, each attending to its own cells only: llama.cpp's
            # default, and what llama-batched-bench measures unless given -kvu.
            p.kv_unified = False
        if hasattr(p, "no_perf"):
            p.no_perf = True
        self.ctx = _api("llama_init_from_model", "llama_new_context_with_model")(model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        """Empty the KV cache (a fresh start for the next measurement)."""
        get_memory = getattr(llama_cpp, "llama_get_memory", None)
        if get_memory is not None and hasattr(llama_cpp, "llama_memory_clear"):
            llama_cpp.llama_memory_clear(get_memory(self.ctx), True)
        else:
            _api("llama_kv_self_clear", "llama_kv_cache_clear")(self.ctx)

    def fill(self, tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        """Load (token, position, sequence id, wants logits) entries into the batch."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(tokens)

    def decode(self, n_vocab: int, n_outputs: int) -> np.ndarray:
        """Run the loaded batch; the argmax token of each of the `n_outputs` entries that
        asked for logits, in batch order."""
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if n_outputs == 0:
            return np.empty(0, dtype=np.int64)
        # Outputs are contiguous rows of n_vocab floats, in the order of the batch.
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx),
                                       shape=(n_outputs, n_vocab))
        return logits.argmax(axis=1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


class LlamaCppPeer:
    """The GGUF model loaded once into llama.cpp (CPU, `n_threads` threads)."""

    def __init__(self, path: str | Path, n_threads: int, verbose: bool = False) -> None:
        if llama_cpp is None:
            raise RuntimeError("llama-cpp-python is not installed")
        set_verbose(verbose)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = _api("llama_model_load_from_file", "llama_load_model_from_file")(
            str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        if hasattr(llama_cpp, "llama_model_get_vocab"):
            self.n_vocab = llama_cpp.llama_vocab_n_tokens(
                llama_cpp.llama_model_get_vocab(self.model))
        else:
            self.n_vocab = llama_cpp.llama_n_vocab(self.model)
        self.n_threads = n_threads
        self.generated: list[list[int]] = []
        # Batch-1 figures share one context; concurrent runs make one per size.
        self._single = _Context(self.model, n_threads, n_ctx=4096, n_batch=2048, n_ubatch=512)

    def close(self) -> None:
        self._single.close()
        _api("llama_model_free", "llama_free_model")(self.model)

    def _eval_prompt(self, c: _Context, prompt: Sequence[int], seq: int = 0) -> int:
        """Prefill `prompt` into sequence `seq` (chunks of n_batch); the first new token."""
        out = np.empty(0, dtype=np.int64)
        for start in range(0, len(prompt), c.n_batch):
            chunk = prompt[start:start + c.n_batch]
            last = start + len(chunk) == len(prompt)
            c.fill([(t, start + j, seq, last and j == len(chunk) - 1)
                    for j, t in enumerate(chunk)])
            out = c.decode(self.n_vocab, int(last))
        return int(out[0])

    def prefill(self, prompt: Sequence[int]) -> float:
        """Prompt tokens/s: one llama_decode over the whole prompt (n_batch >= its length)
        into an empty KV cache, plus the argmax of the last position's logits."""
        c = self._single
        if len(prompt) > c.n_batch:
            raise ValueError(f"prefill prompt longer than n_batch ({c.n_batch})")
        c.clear()
        c.fill([(t, j, 0, j == len(prompt) - 1) for j, t in enumerate(prompt)])
        t = time.perf_counter()
        c.decode(self.n_vocab, 1)
        return len(prompt) / (time.perf_counter() - t)

    def decode(self, prompt: Sequence[int], n_tokens: int) -> float:
        """Batch-1 decode tokens/s: greedy, EOS ignored, one llama_decode per token; timed
        from the first generated token (the prompt's) to the last, like kvloop's TPOT."""
        c = self._single
        c.clear()
        tok = self._eval_prompt(c, prompt)
        pos = len(prompt)
        t = time.perf_counter()
        for _ in range(n_tokens - 1):
            c.fill([(tok, pos, 0, True)])
            tok = int(c.decode(self.n_vocab, 1)[0])
            pos += 1
        return (n_tokens - 1) / (time.perf_counter() - t)

    def throughput(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Generated tokens/s with one sequence per prompt, like llama-batched-bench: every
        prompt prefilled (packed into batches of n_batch tokens), then decode steps in which
        each sequence adds one token per llama_decode call. Wall time includes the prefill,
        not the creation of the context (its KV cache is allocated up front, as kvloop's is
        when the LLM is built)."""
        k = len(prompts)
        # Cells per sequence, rounded up to llama.cpp's padding of 256 (it would round anyway).
        per_seq = -(-(max(len(p) for p in prompts) + new_tokens) // 256) * 256
        c = _Context(self.model, self.n_threads, n_ctx=k * per_seq, n_batch=2048,
                     n_ubatch=512, n_seq_max=k)
        gen: list[list[int]] = [[] for _ in range(k)]
        t = time.perf_counter()
        try:
            last: list[int] = [0] * k
            pending = [(tok, j, s, j == len(p) - 1)
                       for s, p in enumerate(prompts) for j, tok in enumerate(p)]
            for start in range(0, len(pending), c.n_batch):
                chunk = pending[start:start + c.n_batch]
                c.fill(chunk)
                ends = [seq for _, _, seq, want in chunk if want]
                for seq, tok in zip(ends, c.decode(self.n_vocab, len(ends)), strict=True):
                    last[seq] = int(tok)
                    gen[seq].append(int(tok))
            pos = [len(p) for p in prompts]
            for _ in range(new_tokens - 1):
                c.fill([(last[s], pos[s], s, True) for s in range(k)])
                last = [int(x) for x in c.decode(self.n_vocab, k)]
                pos = [q + 1 for q in pos]
                for g, tok in zip(gen, last, strict=True):
                    g.append(tok)
            wall = time.perf_counter() - t
        finally:
            c.close()
        self.generated = gen  # the tokens of the last run, for checks
        return sum(map(len, gen)) / wall
