"""Bad input gets one clear message naming the problem, the same from the API and the CLI.

API: a `KvloopError` (a `ValueError`) of the right subclass. CLI (`kvloop.cli.main`, run
in-process here; test_cli.py runs it as a subprocess): exit status 2, one line on stderr
starting ``kvloop: error:`` followed by the API's words, no traceback. And a rejected request
leaves nothing half-started behind: no queued request, every KV block free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import write_gguf, write_tiny_model
from kvloop import LLM, SamplingParams
from kvloop.cli import main
from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError, PromptTooLongError

CONTEXT = 64
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 12  # > CONTEXT tokens
SMALL_KV = "16MiB"


def write_llama_gguf(path: Path, tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]],
                     arch: str = "llama") -> Path:
    """A small but complete GGUF: llama.* hyper-parameters, a byte-level vocabulary, tensors."""
    from tokenizers import pre_tokenizers

    def metadata(w: gguf.GGUFWriter) -> None:
        if arch != "llama":
            return
        w.add_context_length(CONTEXT)
        w.add_embedding_length(256)
        w.add_block_count(1)
        w.add_feed_forward_length(64)
        w.add_head_count(4)
        w.add_head_count_kv(4)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))

    return write_gguf(path, tensors, arch, metadata)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One path per way a model can be wrong."""
    d = tmp_path_factory.mktemp("bad-models")
    text = d / "notes.txt"
    text.write_text("this is not a model\n")
    empty_dir = d / "empty-dir"
    empty_dir.mkdir()
    bert = d / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps(
        {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4}))
    truncated = d / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 5)
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    iq2_bytes = np.zeros((256, gguf.GGML_QUANT_SIZES[iq2][1]), dtype=np.uint8)  # 256 x 256 IQ2
    return {
        "missing": d / "no-such-model.gguf",
        "text": text,
        "empty_dir": empty_dir,
        "gpt2_gguf": write_llama_gguf(d / "gpt2.gguf", [], arch="gpt2"),
        "bert_dir": bert,
        "iq2_gguf": write_llama_gguf(d / "iq2.gguf", [("token_embd.weight", iq2_bytes, iq2)]),
        "truncated": truncated,
    }


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a 64-token context."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny64"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def llm64(tiny64: Path) -> LLM:
    return LLM(tiny64, kv_cache_memory=SMALL_KV)


@dataclass
class Case:
    argv: list[str]  # after `generate PROMPT`; "{model}" is replaced by the model path
    error: type[KvloopError]
    words: tuple[str, ...]  # each must appear in the message
    model: str = "tiny64"  # key into bad_models, or "tiny64"
    prompt: str = "Hello"
    params: dict | None = None  # SamplingParams kwargs for the API side


CASES: dict[str, Case] = {
    "missing_file": Case([], ModelLoadError, ("not found", "no-such-model.gguf"), "missing"),
    "not_gguf": Case([], ModelLoadError, ("notes.txt", "not a GGUF file"), "text"),
    "not_model_dir": Case([], ModelLoadError, ("empty-dir", "not a model directory"),
                          "empty_dir"),
    "gguf_arch_gpt2": Case([], ModelLoadError, ("unsupported architecture", "'gpt2'"),
                           "gpt2_gguf"),
    "hf_arch_bert": Case([], ModelLoadError, ("unsupported architecture", "'bert'"), "bert_dir"),
    "quant_iq2_xxs": Case([], ModelLoadError, ("token_embd.weight", "IQ2_XXS", "not support"),
                          "iq2_gguf"),
    "corrupt_gguf": Case([], ModelLoadError, ("truncated.gguf", "not a readable GGUF"),
                         "truncated"),
    "prompt_too_long": Case([], PromptTooLongError, ("prompt has", "context is 64"),
                            prompt=LONG_PROMPT),
    "temperature_negative": Case(["--temperature", "-1"], InvalidParamsError,
                                 ("temperature", ">= 0", "-1"), params={"temperature": -1.0}),
    "top_p_zero": Case(["--top-p", "0"], InvalidParamsError, ("top_p", "(0, 1]", "0.0"),
                       params={"top_p": 0.0}),
    "top_p_above_one": Case(["--top-p", "1.5"], InvalidParamsError, ("top_p", "(0, 1]", "1.5"),
                            params={"top_p": 1.5}),
    "top_k_negative": Case(["--top-k", "-2"], InvalidParamsError, ("top_k", ">= 0", "-2"),
                           params={"top_k": -2}),
    "max_tokens_zero": Case(["--max-tokens", "0"], InvalidParamsError,
                            ("max_tokens", ">= 1", "got 0"), params={"max_tokens": 0}),
    "max_tokens_negative": Case(["--max-tokens", "-3"], InvalidParamsError,
                                ("max_tokens", ">= 1", "-3"), params={"max_tokens": -3}),
}


def model_path(case: Case, bad_models: dict[str, Path], tiny64: Path) -> Path:
    return tiny64 if case.model == "tiny64" else bad_models[case.model]


def api_error(case: Case, path: Path, llm64: LLM) -> KvloopError:
    """Run the case through the Python API; return the error it raised."""
    call: Callable[[], object]
    if case.params is not None:
        call = lambda: SamplingParams(**case.params)  # noqa: E731
    elif case.model != "tiny64":
        call = lambda: LLM(path, kv_cache_memory=SMALL_KV)  # noqa: E731
    else:
        call = lambda: llm64.generate(case.prompt, SamplingParams(max_tokens=4))  # noqa: E731
    with pytest.raises(case.error) as info:
        call()
    return info.value


@pytest.mark.parametrize("name", list(CASES))
def test_api_error_names_the_problem(name: str, bad_models: dict[str, Path], tiny64: Path,
                                     llm64: LLM) -> None:
    """The API raises the case's KvloopError subclass (a ValueError), words in the message."""
    case = CASES[name]
    err = api_error(case, model_path(case, bad_models, tiny64), llm64)
    assert isinstance(err, KvloopError) and isinstance(err, ValueError)
    msg = str(err)
    assert "\n" not in msg
    for word in case.words:
        assert word in msg, f"{word!r} not in {msg!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_cli_error_is_one_line_with_the_api_words(
    name: str, bad_models: dict[str, Path], tiny64: Path, llm64: LLM,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvloop generate` exits 2 with exactly `kvloop: error: <API message>` on stderr."""
    case = CASES[name]
    path = model_path(case, bad_models, tiny64)
    expected = str(api_error(case, path, llm64))
    capsys.readouterr()
    rc = main(["generate", case.prompt, "--model", str(path), *case.argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err == f"kvloop: error: {expected}\n"
    assert out == ""
    assert "Traceback" not in out + err


def test_minus_one_top_k_disables_rather_than_errors() -> None:
    """top_k=-1 is the documented 'disabled' spelling (vLLM), so only < -1 is an error."""
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(InvalidParamsError, match="top_k"):
        SamplingParams(top_k=-2)


def test_params_validated_again_at_add_request(llm64: LLM) -> None:
    """A SamplingParams mutated into a bad state after construction is refused when queued."""
    p = SamplingParams(max_tokens=4)
    p.temperature = -0.5
    with pytest.raises(InvalidParamsError, match="temperature"):
        llm64.generate("Hello", p)
    assert not llm64.engine.has_unfinished_requests()


def _assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_rejected_batch_leaves_nothing_behind(llm64: LLM) -> None:
    """generate([good, too long, good]) raises; no request stays queued, every KV block is
    free, and the engine then serves a good request exactly as before."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm64.generate("The quick brown", greedy)[0].outputs[0].token_ids
    _assert_engine_idle(llm64)

    with pytest.raises(PromptTooLongError, match="context is 64"):
        llm64.generate(["The quick brown", LONG_PROMPT, "lazy dog"], greedy)
    _assert_engine_idle(llm64)

    bad = SamplingParams(max_tokens=4)
    bad.top_p = 0.0
    with pytest.raises(InvalidParamsError, match="top_p"):
        llm64.generate(["The quick brown", "lazy dog"], [greedy, bad])
    _assert_engine_idle(llm64)

    with pytest.raises(PromptTooLongError):
        list(llm64.stream(LONG_PROMPT, greedy))
    _assert_engine_idle(llm64)

    after = llm64.generate("The quick brown", greedy)
    assert after[0].outputs[0].token_ids == before
    assert after[0].outputs[0].finish_reason == "length"
    _assert_engine_idle(llm64)


def test_prompt_that_just_fits_is_served(llm64: LLM) -> None:
    """The boundary: a prompt of context-1 tokens still gets its one token; context is refused."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm64.generate([list(range(2, 2 + CONTEXT - 1))], greedy)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    with pytest.raises(PromptTooLongError, match=f"prompt has {CONTEXT} tokens"):
        llm64.generate([list(range(2, 2 + CONTEXT))], greedy)
    _assert_engine_idle(llm64)
