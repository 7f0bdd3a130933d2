"""Configuration dataclasses. Imports nothing of kvloop but its errors.

``ModelConfig`` is the one place a model's hyper-parameters live: the loader fills it from
GGUF metadata or ``config.json``; the model reads it and nothing else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvloop.errors import InvalidParamsError


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # What sets Gemma apart; the defaults are the Llama family's. layer_types names each
    # layer's attention as HF does ("full_attention" / "sliding_attention"); empty: every
    # layer attends to the whole context.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer sees, its own position included
    rope_local_theta: float | None = None  # rope base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scale is this**-0.5 (None: head_dim)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Gemma 2: attention scores = cap * tanh(scores / cap), before the mask and softmax.
    attn_logit_softcapping: float | None = None

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends only to the last `sliding_window` positions."""
        return (self.sliding_window is not None and layer < len(self.layer_types)
                and self.layer_types[layer] == "sliding_attention")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one decoder layer's matrices (q/k/v, o, gate/up, down): the
        multiply-adds a position costs there."""
        d, f = self.hidden_size, self.intermediate_size
        return d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f

    def head_cost_ratio(self) -> float:
        """The head's multiply-adds for one position as a share of the layers': what
        scoring a prompt token (its logits over the vocabulary) adds to its prefill."""
        return self.vocab_size * self.hidden_size / (self.num_layers * self.layer_matrix_params)

    def attention_cost_ratio(self) -> float:
        """What one earlier position a query attends to costs (QK and PV: two multiply-
        adds per query element) as a share of a position's matrices. An upper bound for
        sliding-window layers, which stop seeing positions past their window."""
        return 2 * self.q_size / self.layer_matrix_params

    def num_params(self) -> int:
        """Parameters of the transformer (embedding counted once when tied)."""
        d, L = self.hidden_size, self.num_layers
        per_layer = self.layer_matrix_params + 2 * d  # and its two norms
        emb = self.vocab_size * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return L * per_layer + emb + head + d


# Sizes above this are typos or attacks, not memory: 1 PiB.
MAX_SIZE_BYTES = 2**50
_SIZE_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
               "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
               "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}


def parse_size(text: str | int, param: str | None = None) -> int:
    """'2GiB' / '512MB' / '1.5G' / 1048576 -> bytes.

    Anything that is not a finite, non-negative size of at most 1 PiB raises
    InvalidParamsError (a ValueError) naming `param`: garbage, NaN, inf ('1e400'),
    negative and absurd sizes never reach the engine as a traceback."""
    what = param or "size"

    def bad(rule: str) -> InvalidParamsError:
        shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:37] + "..."
        return InvalidParamsError(f"{what} must be {rule}, got {shown}", param=param)

    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise bad("a size in bytes such as 2GiB, 512MB or 1048576")
    if isinstance(text, str):
        s = text.strip().upper().replace(" ", "").replace("_", "")
        mult = 1
        for unit, unit_mult in _SIZE_UNITS.items():
            if s.endswith(unit):
                s, mult = s[: -len(unit)], unit_mult
                break
        try:
            number: float = float(s)
        except ValueError:
            raise bad("a size in bytes such as 2GiB, 512MB or 1048576") from None
        value: float = number * mult
    else:
        value = text
    if isinstance(value, float) and not math.isfinite(value):
        raise bad("a finite size")
    if value < 0:
        raise bad("a size >= 0")
    if value > MAX_SIZE_BYTES:
        raise bad(f"at most {MAX_SIZE_BYTES} bytes (1 PiB)")
    return int(value)


# The weight-only quantization modes; kept equal to kvloop.quant.QUANTIZATIONS (a test checks)
# because config sits below quant in the layers and must not import it.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
# How the KV cache stores K and V; kept equal to kvloop.quant.kv.KV_CACHE_DTYPES' names (a
# test checks), for the same reason. int8 keeps one fp16 scale per token per head.
KV_CACHE_DTYPES = ("fp32", "bf16", "fp16", "int8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, quantization: str) -> str:
    """What "auto" stores for a model whose weights run in `quantization` (resolved, not
    "auto"): fp32 beside fp32 weights, which are asked for to compute what an fp32 oracle
    computes; fp16 beside quantized ones, whose own rounding is far above fp16's (the
    quality figures: README's KV cache section)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "fp32" if quantization == "none" else "fp16"
# None (off), prompt lookup, or a draft model: this model with int4/int8 weights ("self:"),
# or "draft:PATH", another model file sharing this one's tokenizer.
SPECULATIVE_METHODS = (None, "ngram", "self:int4", "self:int8")
MAX_SPECULATIVE_TOKENS = 16
MAX_BLOCK_SIZE = 1024  # tokens per KV block: larger only wastes the last block's slots
MAX_NUM_SEQS = 65536
MAX_TENSOR_PARALLEL = 1024  # ranks of tensor parallelism
MAX_THREADS_UNKNOWN_CPUS = 1024  # where os.cpu_count() cannot tell
MAX_CHAT_TEMPLATE_CHARS = 1 << 20  # real templates are a few KB
MAX_TOKENS_LIMIT = 2**31 - 1  # token counts and positions live in int32/int64 tensors
# Prompt tokens x top log-probs one request may ask for: the answer holds that many entries
# (~30 bytes of JSON each). Room for an 8,192-token prompt at top 16, a 4,000-token one at
# top 20, or 64 lm-evaluation-harness prompts of 2,048 tokens at logprobs 1.
DEFAULT_MAX_PROMPT_LOGPROBS = 131_072
# The least context a KV cache must hold (or the model's whole context, if smaller): below it
# a kv_cache_memory typo (1 instead of 1GiB) would silently run a 16-token model.
MIN_KV_CACHE_TOKENS = 256


def _cpu_count() -> int | None:
    return os.cpu_count()


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: cache, batching, threads.

    Checked on construction: every option out of range raises InvalidParamsError naming it
    (the CLI prints it as one line), so a bad option never reaches the engine, where
    max_num_batched_tokens=0 hung and block_size=0 divided by zero. kv_cache_memory may be
    given as a size string ("2GiB"); it is parsed here and stored as bytes.
    """

    use_cache: bool = True
    block_size: int = 16
    kv_cache_memory: int | str = 2 * 2**30  # bytes (or "2GiB") for all K and V blocks
    # How K and V are stored: "fp16" (as llama.cpp's f16 cache: half the bytes of fp32,
    # so the same kv_cache_memory holds twice the tokens; 11 bits of mantissa, range
    # +-65504, far above any K or V of the models kvloop runs), "bf16" (fp32's range, 8 bits
    # of mantissa), "fp32" (the reference: what exactness against an fp32 oracle needs),
    # "int8" (codes with one fp16 scale per token per head: ~4x). "auto" (the default):
    # fp32 when the weights are fp32 (quantization "none": exactness was asked for), fp16
    # otherwise (resolve_kv_cache_dtype). Attention always computes in fp32 over what is
    # stored.
    kv_cache_dtype: str = "auto"
    # Of kv_cache_memory, how much blocks no request holds may keep for prefix-cache hits
    # before the pool reuses them rather than touch memory it has not used yet (the pool
    # is committed as blocks are first written: kv_cache.BlockPool). The whole pool still
    # serves running requests, and caches whatever is free once all of it is in use.
    prefix_cache_memory: int | str = 64 * 2**20
    max_num_seqs: int = 64
    # Positions a step may run: the native step's largest prefill chunk
    # (dispatch.NATIVE_MAX_PREFILL), so that a long prompt's chunks stay on it. At 2048 a
    # 2048-token prompt ran as one chunk on the modules: Gemma 3 270M prefilled it at 398
    # tok/s, in chunks of 1024 at 625 (the default model: 457, and 479 in chunks of 512).
    max_num_batched_tokens: int = 1024
    # Prompt positions a step may run while it also decodes running streams: each such
    # step is a pause between those streams' tokens (SchedulerConfig). 128 positions of
    # SmolLM2 take ~0.25 s here; alone, a prompt still gets the whole budget.
    max_prefill_tokens_while_decoding: int = 128
    # Prompt log-probs: prompt tokens x max(1, top log-probs) one request may ask for
    # (kvloop.params.check_prompt_logprobs); 0 refuses every scored prompt.
    max_prompt_logprobs: int = DEFAULT_MAX_PROMPT_LOGPROBS
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # defaults to the model's context
    num_threads: int | None = None
    # Reorder linear weights for oneDNN (faster); False keeps F.linear, the reference path.
    pack_weights: bool = True
    # Native C++ kernels (paged attention), built at first use; False: PyTorch only.
    use_kernels: bool = True
    # Weight-only quantization of the linear layers: "gguf" (a GGUF file's blocks as stored,
    # computed exactly: the weights equal the fp32 dequantization), "none" (fp32, the
    # reference), "int8" or "int4" (re-quantized from fp32; int4 keeps Q4_0/Q4_1 codes).
    # "auto" (the default) is "gguf" for a GGUF file with quantized linear tensors and
    # "none" otherwise; the engine replaces it with what it resolved to.
    quantization: str = "auto"
    # Speculative decoding: None (off); "ngram" (prompt lookup: drafts copied from the
    # sequence's own earlier tokens); "self:int4" / "self:int8" (this model with quantized
    # weights drafts); "draft:PATH" (a smaller model with the same tokenizer drafts). The
    # model verifies the drafts in the same batch.
    speculative: str | None = None
    num_speculative_tokens: int = 4  # drafts per sequence per step, at most
    ngram_min: int = 1  # suffix lengths the lookup tries, longest first
    ngram_max: int = 4
    # With more sequences decoding than this, nobody drafts: the step is compute-bound
    # already, and draft rows would cost more than the steps they save.
    speculative_max_batch: int = 8
    # Structured output: where the grammar allows one continuation (a JSON key and its
    # punctuation), run those tokens in one step as drafts instead of one step each
    # (same output). False: one token a step, the reference.
    jump_forward: bool = True
    # A jinja2 chat template (its text) used instead of the checkpoint's own: for models
    # that ship none (base models such as Gemma 3 270M) or a wrong one. The CLI's
    # --chat-template reads it from a file. Checked at load like the file's own.
    chat_template: str | None = None
    # Tensor parallelism: this many ranks each hold a share of every layer's attention heads
    # (whole KV-head groups) and MLP columns, meeting over gloo in one all-reduce after the
    # attention output and one after the MLP down projection (kvloop.distributed). On one
    # machine the engine spawns ranks 1..N-1; under torchrun it is rank 0 of WORLD_SIZE.
    # Runs fp32 weights only ("auto" resolves to "none"), on the PyTorch modules' path.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("use_cache", "enable_prefix_caching", "pack_weights", "use_kernels",
                     "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "true or false")
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _check_int("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_TOKENS_LIMIT)
        _check_int("max_prefill_tokens_while_decoding",
                   self.max_prefill_tokens_while_decoding, 1, MAX_TOKENS_LIMIT)
        _check_int("max_prompt_logprobs", self.max_prompt_logprobs, 0, MAX_TOKENS_LIMIT)
        if self.max_model_len is not None:
            # Two positions at least: one prompt token and one generated.
            _check_int("max_model_len", self.max_model_len, 2, MAX_TOKENS_LIMIT)
        if self.num_threads is not None:
            # More threads than CPUs only makes them wait on each other (--threads 1000 ran
            # at 0.5 tok/s instead of 36).
            cpus = _cpu_count()
            if (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                    or not 1 <= self.num_threads <= (cpus or MAX_THREADS_UNKNOWN_CPUS)):
                raise _bad("num_threads", self.num_threads,
                           f"an integer >= 1 and <= {cpus} (this machine has {cpus} CPUs)"
                           if cpus else f"an integer >= 1 and <= {MAX_THREADS_UNKNOWN_CPUS}")
        if self.quantization not in QUANTIZATIONS:
            raise _bad("quantization", self.quantization, f"one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            raise _bad("kv_cache_dtype", self.kv_cache_dtype,
                       f"one of auto, {', '.join(KV_CACHE_DTYPES)}")
        if not (self.speculative in SPECULATIVE_METHODS or (
                isinstance(self.speculative, str) and self.speculative.startswith("draft:")
                and len(self.speculative) > len("draft:"))):
            raise _bad("speculative", self.speculative,
                       f"one of {', '.join(map(str, SPECULATIVE_METHODS))} or draft:PATH")
        if self.speculative == f"self:{self.quantization}":
            raise _bad("speculative", self.speculative,
                       "a draft with smaller weights than the target's (--quantization "
                       f"{self.quantization})")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   MAX_SPECULATIVE_TOKENS)
        _check_int("ngram_max", self.ngram_max, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("ngram_min", self.ngram_min, 1, self.ngram_max)
        _check_int("speculative_max_batch", self.speculative_max_batch, 0, MAX_NUM_SEQS)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL)
        if self.tensor_parallel_size > 1:
            if self.quantization not in ("auto", "none"):
                raise _bad("quantization", self.quantization,
                           f"'none' (fp32) with tensor_parallel_size "
                           f"{self.tensor_parallel_size}: its shards split fp32 weights")
            if self.speculative not in (None, "ngram"):
                raise _bad("speculative", self.speculative,
                           f"None or 'ngram' with tensor_parallel_size "
                           f"{self.tensor_parallel_size}: a draft model is not sharded")
        if self.chat_template is not None and (
                not isinstance(self.chat_template, str) or not self.chat_template.strip()
                or len(self.chat_template) > MAX_CHAT_TEMPLATE_CHARS):
            raise _bad("chat_template", self.chat_template,
                       f"the non-empty text of a jinja2 template, at most "
                       f"{MAX_CHAT_TEMPLATE_CHARS} characters")
        size = parse_size(self.kv_cache_memory, param="kv_cache_memory")
        if size < 1:
            raise _bad("kv_cache_memory", self.kv_cache_memory, "at least 1 byte")
        object.__setattr__(self, "kv_cache_memory", size)  # frozen: set once, here
        reserve = parse_size(self.prefix_cache_memory, param="prefix_cache_memory")
        if reserve < 0:
            raise _bad("prefix_cache_memory", self.prefix_cache_memory, "0 bytes or more")
        object.__setattr__(self, "prefix_cache_memory", reserve)

    def check_kv_capacity(self, bytes_per_block: int, model_context: int) -> int:
        """How many KV blocks kv_cache_memory holds; InvalidParamsError if that is too few.

        `bytes_per_block`: K and V of one block over all layers; `model_context`: the context
        the engine will serve (the model's, capped by max_model_len). The cache must hold at
        least min(model_context, MIN_KV_CACHE_TOKENS) tokens: otherwise a typo such as
        kv_cache_memory=1 would silently serve a one-block (16-token) context. Without a
        cache (use_cache False) nothing is stored and nothing is checked: returns 0.
        """
        if not self.use_cache:
            return 0
        if bytes_per_block < 1 or model_context < 1:
            raise ValueError("bytes_per_block and model_context must be >= 1")  # engine bug
        size = parse_size(self.kv_cache_memory, param="kv_cache_memory")
        blocks = size // bytes_per_block
        need_tokens = min(model_context, MIN_KV_CACHE_TOKENS)
        need_blocks = -(-need_tokens // self.block_size)
        if blocks < need_blocks:
            raise InvalidParamsError(
                f"kv_cache_memory {size} bytes holds {blocks} KV blocks of {self.block_size} "
                f"tokens ({bytes_per_block} bytes each); at least {need_blocks} "
                f"({need_blocks * bytes_per_block} bytes, a {need_tokens}-token context) are "
                f"needed: raise kv_cache_memory", param="kv_cache_memory")
        return blocks


def _bad(name: str, value: object, rule: str) -> InvalidParamsError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return InvalidParamsError(f"{name} must be {rule}, got {shown}", param=name)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    # bool is an int subclass, but block_size=True is a mistake, not a size of 1.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, value, f"an integer >= {lo} and <= {hi}")
