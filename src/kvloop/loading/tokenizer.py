"""The tokenizer: text <-> token ids, and the chat template.

Everything runs on a real `tokenizers.Tokenizer` (Hugging Face's Rust library); this module
only *builds* one. A Hugging Face model directory ships a `tokenizer.json`, so that is
loaded as is. A GGUF file has none: it stores the vocabulary, merges and special ids as
metadata under llama.cpp's key names, and we rebuild the equivalent tokenizer from them:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The one thing the metadata only names
  is the pre-tokenizer (``tokenizer.ggml.pre``), i.e. the regexes that cut text into words
  before BPE; `_PRE_SPLITS` maps each name to the regexes of the model's own
  `tokenizer.json` (llama.cpp keeps the same table in ``llama-vocab.cpp``).
- ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with byte fallback
  (Llama 1/2, Mistral, Gemma). Merges are derived from the scores when the file has none.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from itertools import compress, count, repeat
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError
from kvloop.loading.chat_template import (
    TEMPLATE_MAX_CHARS,  # noqa: F401  (callers know the limits from here)
    TEMPLATE_TIME_LIMIT_S,  # noqa: F401
    TemplateCompileError,
    TemplateLimitError,
    TemplateRefusedError,
    _one_line,
    render_chat_template,
)

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType); spelled out so this module reads without the gguf package.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer regexes, as the models' own tokenizer.json files write them -------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

# tokenizer.ggml.pre -> regexes applied one after another (each splits the pieces of the last).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"), (_GPT2,)),
    # Code models that cut every digit on its own, then split like GPT-2.
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "dbrx", "smaug-bpe",
         "chatglm-bpe", "pixtral", "midm-2.0", "lfm2"),
        (_LLAMA3,),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez", "grok-2"), (_QWEN2,)
    ),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), (_GPT4O,)),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK3),
    "falcon": _FALCON,
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_PORO,)),
    "viking": (_PORO, r"\p{N}"),
}
# Vocabularies whose tokenizer.json sets `ignore_merges`: a word that is itself a token is
# taken whole instead of being rebuilt from merges (llama.cpp does the same for these).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies use.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are moved to U+0100...
    so that no token contains whitespace or control characters.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------------------------------------
NO_CHAT_TEMPLATE = (
    "this model has no chat template (its checkpoint carries no tokenizer.chat_template): "
    "supply one (--chat-template FILE, or chat_template= in the Python API) or send a "
    "plain-text prompt instead of chat messages")


class Tokenizer:
    """Wraps a real `tokenizers.Tokenizer` plus the facts the engine needs around it:
    special ids, whether BOS is added, and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        # User text must stay text: a copy of the backend that reads special-token strings
        # (``<|im_end|>``) in its input as plain characters (`_text_backend`). Two copies
        # rather than flipping `encode_special_tokens` per call: encode runs on several
        # threads at once, and the flag is shared state. Neither copy is changed once
        # built. The copy is built on first need (a serialise and parse of the whole
        # tokenizer, a tenth of a one-shot's load): text with no special-token string in
        # it encodes the same through either (`_plain_backend`).
        self._text_copy: HFTokenizer | None = None
        self._text_lock = threading.Lock()
        # Special-token strings, longest first (the pattern's alternation takes the first
        # that matches), and the characters they start with: text with none of those holds
        # none of them, and needs no search. The pattern itself is compiled on first need:
        # Gemma 3's 6k specials made a regex that took ~0.25 s of every load to compile.
        self._specials = sorted(
            (t.content for t in backend.get_added_tokens_decoder().values()
             if t.special and t.content),
            key=len, reverse=True,
        )
        self._special_starts = frozenset(t[0] for t in self._specials)
        self._pattern: re.Pattern[str] | None = None
        # Ids run 0..vocab_size-1 (the model's embedding rows); GGUF passes its token count.
        if vocab_size is None:
            vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.vocab_size: int = vocab_size
        self.bos_token_id = bos_token_id
        # Deduplicated, in declaration order (the plain EOS first).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        # The post-processor is the single source of truth for BOS/EOS; ask it once.
        added = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token: bool = bos_token_id is not None and added[:1] == [bos_token_id]
        if chat_template:
            self._check_chat_template()

    @property
    def _text_backend(self) -> HFTokenizer:
        """The backend copy that reads special-token strings as plain characters."""
        copy = self._text_copy
        if copy is None:
            with self._text_lock:
                copy = self._text_copy
                if copy is None:
                    copy = HFTokenizer.from_str(self._backend.to_str())
                    copy.encode_special_tokens = True
                    self._text_copy = copy
        return copy

    def _special_pattern(self, text: str) -> re.Pattern[str] | None:
        """The pattern that finds special-token strings, or None where `text` can hold
        none (no special token starts with any of its characters)."""
        if not any(c in text for c in self._special_starts):
            return None
        pattern = self._pattern
        if pattern is None:  # two threads may both compile it: the same pattern
            pattern = self._pattern = re.compile("|".join(map(re.escape, self._specials)))
        return pattern

    def _plain_backend(self, text: str) -> HFTokenizer:
        """A backend that reads `text`'s special-token strings as plain characters: the
        shared one where it holds none (encode_special_tokens changes only how those are
        read), else the text copy."""
        pattern = self._special_pattern(text)
        if pattern is None or pattern.search(text) is None:
            return self._backend
        return self._text_backend

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any],
                           merges_cache: MergesCache | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (key -> `field.contents()` values).
        `merges_cache`: where merges derived for a vocabulary without them are kept
        between loads of the same file."""
        model = _meta_str(metadata, "tokenizer.ggml.model")
        tokens = _meta_list(metadata, "tokenizer.ggml.tokens", str)
        if model is None or not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.* metadata)")
        types = _meta_list(metadata, "tokenizer.ggml.token_type", int)
        types += [_NORMAL] * (len(tokens) - len(types))

        def token_id(key: str) -> int | None:
            value = _meta_int(metadata, f"tokenizer.ggml.{key}")
            return value if value is not None and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        unk, pad = token_id("unknown_token_id"), token_id("padding_token_id")
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
        add_bos = _meta_bool(metadata, "tokenizer.ggml.add_bos_token", model == "llama")
        add_eos = _meta_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        chat_template = _meta_str(metadata, "tokenizer.chat_template")

        hf_json = _meta_str(metadata, "tokenizer.huggingface.json")
        if hf_json:  # some converters embed the original tokenizer.json: nothing to rebuild
            try:
                backend = HFTokenizer.from_str(hf_json)
            except Exception as e:  # the Rust error names the bad field: keep it, one line
                raise ModelLoadError(
                    f"tokenizer.huggingface.json is not a valid tokenizer.json: {e}"
                ) from None
        elif model == "gpt2":
            backend = _byte_level_bpe(tokens, types, metadata)
        elif model == "llama":
            backend = _sentencepiece_bpe(tokens, types, metadata, unk, merges_cache)
        else:
            raise ModelLoadError(
                f"unsupported tokenizer model {model!r} in GGUF (kvloop reads 'gpt2' byte-level "
                "BPE and 'llama' SentencePiece vocabularies)"
            )
        _set_bos_eos(
            backend,
            backend.id_to_token(bos) if add_bos and bos is not None else None,
            backend.id_to_token(eos) if add_eos and eos is not None else None,
        )
        # Every end-of-generation token the file declares, the plain EOS first.
        ends = (eos, token_id("eot_token_id"), token_id("eom_token_id"))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in ends if i is not None],
            pad_token_id=pad,
            unk_token_id=unk,
            chat_template=chat_template,
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, generation_config.json, chat template)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (kvloop needs the fast tokenizer)")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error names the bad field; keep it, drop the traceback
            raise ModelLoadError(f"cannot read {tok_file}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")

        def special_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise _config_error("tokenizer_config.json", name, "a token string",
                                    config.get(name))
            return backend.token_to_id(value) if value is not None else None

        bos, eos = special_id("bos_token"), special_id("eos_token")
        for flag in ("add_bos_token", "add_eos_token"):
            if config.get(flag) is not None and not isinstance(config[flag], bool):
                raise _config_error("tokenizer_config.json", flag, "a boolean", config[flag])
        if "add_bos_token" in config or "add_eos_token" in config:
            # An explicit flag overrides whatever the tokenizer.json post-processor does.
            add_bos = config.get("add_bos_token") and bos is not None
            add_eos = config.get("add_eos_token") and eos is not None
            _set_bos_eos(
                backend,
                backend.id_to_token(bos) if add_bos and bos is not None else None,
                backend.id_to_token(eos) if add_eos and eos is not None else None,
            )
        ends = [eos] if eos is not None else []
        gen_eos = gen_config.get("eos_token_id")
        ends += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ends):
            raise _config_error("generation_config.json", "eos_token_id",
                                "an integer or an array of integers", gen_eos)
        pad = special_id("pad_token")
        if pad is None and isinstance(gen_config.get("pad_token_id"), int):
            pad = gen_config["pad_token_id"]
        if bos is None and isinstance(gen_config.get("bos_token_id"), int):
            bos = gen_config["bos_token_id"]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=ends,
            pad_token_id=pad,
            unk_token_id=special_id("unk_token"),
            chat_template=_hf_chat_template(path, config),
        )

    # --- text <-> ids --------------------------------------------------------------------
    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._backend

    def save_pretrained(self, directory: str | Path, model_max_length: int | None = None
                        ) -> list[Path]:
        """Write this tokenizer as transformers reads one (tokenizer.json with its
        post-processor's BOS/EOS, tokenizer_config.json with the special tokens and chat
        template, special_tokens_map.json): what lm-evaluation-harness's
        `tokenizer_backend=huggingface` needs for a model kvloop read from a GGUF file.
        Returns the files written."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                    "pad_token": self.id_to_token(self.pad_token_id)
                    if self.pad_token_id is not None else None,
                    "unk_token": self.id_to_token(self.unk_token_id)
                    if self.unk_token_id is not None else None}
        specials = {k: v for k, v in specials.items() if v is not None}
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                                  "clean_up_tokenization_spaces": False}
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        if self.chat_template:
            config["chat_template"] = self.chat_template
        files = {"tokenizer.json": self._backend.to_str(),
                 "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
                 "special_tokens_map.json": json.dumps(specials, indent=2, ensure_ascii=False)}
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
        return [out / name for name in files]

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of `text`; BOS (EOS) only if the model asks for it and add_special_tokens.

        Special-token strings written in the text (``<|im_start|>``) are plain text by
        default, so user text cannot forge control tokens; ``parse_special=True`` (for raw
        prompts that really mean them) makes each its single id, as transformers does.
        Text that is not valid Unicode (a lone surrogate) is an InvalidParamsError.
        """
        _check_text(text, "prompt", "prompt")
        backend = self._backend if parse_special else self._plain_backend(text)
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry for id `i` as stored (byte-level or ▁-spelled), None if unknown."""
        return self._backend.id_to_token(i)

    def set_chat_template(self, template: str) -> None:
        """Use `template` instead of the checkpoint's own chat template (or lack of one),
        checked as a file's own is at load: a ModelLoadError line if it does not compile
        or runs over the render limits."""
        previous, self.chat_template = self.chat_template, template
        try:
            self._check_chat_template()
        except ModelLoadError as e:
            self.chat_template = previous
            raise ModelLoadError(str(e).replace("chat template", "--chat-template", 1)) from None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # --- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """Render the model's jinja2 chat template (sandboxed, within the TEMPLATE_* limits),
        as transformers does.

        `template_vars` reach the template too (e.g. ``tools=[...]``, ``enable_thinking=False``).
        Every failure is one KvloopError line: the template's own refusals ("roles must
        alternate"), its bugs, and a TemplateLimitError when it runs over a limit.
        """
        if not self.chat_template:
            raise KvloopError(NO_CHAT_TEMPLATE)
        def text_of(i: int | None) -> str:
            return (self.id_to_token(i) or "") if i is not None else ""

        context: dict[str, Any] = {
            "bos_token": text_of(self.bos_token_id),
            "eos_token": text_of(self.eos_token_ids[0] if self.eos_token_ids else None),
            "unk_token": text_of(self.unk_token_id),
            "pad_token": text_of(self.pad_token_id),
            "tools": None,
            "documents": None,
            **template_vars,
        }
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        return render_chat_template(self.chat_template, context)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Template, then encode without the automatic BOS: templates that want a BOS write
        it themselves. If the model needs one and the template did not write it, add it.

        The template's own special tokens become control ids; special-token strings inside
        the messages (content, names, tool calls) and the `tools` declarations (which reach
        the template as its `tools` variable) stay plain text, so a user cannot forge a turn.
        """
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise InvalidParamsError(
                    f"messages[{i}] must be an object with role and content, got "
                    f"{type(m).__name__}", "messages",
                )
            for key, value in m.items():
                _check_strings(value, f"messages[{i}].{key}")
        if tools is not None:
            _check_strings(list(tools), "tools")
        # The tools ride along as one more "message" so that one placeholder tag covers both.
        with_tools = [*messages, {"tools": list(tools) if tools is not None else None}]
        escaped_all, forged = self._escape_specials(with_tools)
        escaped, escaped_tools = escaped_all[:-1], escaped_all[-1]["tools"]
        if not forged:
            # The usual case: no special-token text in any message, so the whole rendered
            # string encodes exactly as before (BPE merges across the template/content
            # boundaries included).
            ids = self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                       **self._tools_var(tools)), False,
                              parse_special=True)
        else:
            ids = self._encode_escaped(
                self.apply_chat_template(escaped, add_generation_prompt,
                                         **self._tools_var(escaped_tools)), forged
            )
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @staticmethod
    def _tools_var(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
        return {} if tools is None else {"tools": [dict(t) for t in tools]}

    def _escape_specials(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], tuple[str, list[str]] | None]:
        """`messages` with every special-token string in their text replaced by a placeholder
        the template passes through untouched (private-use characters around a random
        number: no case, no spaces, unguessable), and (placeholder tag, originals), or None
        when no message holds a special-token string."""
        tag = str(secrets.randbits(64))
        originals: list[str] = []

        def sub(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"\ue000{tag}.{len(originals) - 1}\ue001"

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                pattern = self._special_pattern(value)
                return value if pattern is None else pattern.sub(sub, value)
            if isinstance(value, Mapping):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [escape(v) for v in value]
            return value

        escaped = [{k: escape(v) for k, v in m.items()} for m in messages]
        return escaped, ((tag, originals) if originals else None)

    def _encode_escaped(self, rendered: str, forged: tuple[str, list[str]]) -> list[int]:
        """Encode a template rendered over escaped messages: the template's text with special
        tokens parsed, each escaped special-token string as plain text."""
        tag, originals = forged
        pieces = re.split(f"\ue000{tag}\\.(\\d+)\ue001", rendered)
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:  # template text (and the ordinary text around the forged tokens)
                ids += self._backend.encode(piece, add_special_tokens=False).ids
            else:
                ids += self._text_backend.encode(
                    originals[int(piece)], add_special_tokens=False
                ).ids
        return ids

    def _check_chat_template(self) -> None:
        """Render the template once on sample chats, under the render limits: a template
        that does not compile, runs over a limit, or fails on every sample is refused
        here, at load, rather than on every request. One that refuses a sample on purpose
        (raise_exception: "roles must alternate") is fine; that is its job."""
        errors: list[KvloopError] = []
        for sample in _SAMPLE_CHATS:
            try:
                self.apply_chat_template(sample)
                return
            except TemplateCompileError as e:
                raise ModelLoadError(str(e)) from None
            except TemplateLimitError as e:
                raise ModelLoadError(
                    f"chat template refused: on a {len(sample)}-message sample chat it {e.what}"
                ) from None
            except KvloopError as e:
                errors.append(e)
        if any(isinstance(e, TemplateRefusedError) for e in errors):
            logger.warning("the chat template refused every sample chat (%s)", errors[0])
            return
        raise ModelLoadError(f"chat template refused: it fails on a sample chat: {errors[0]}")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos_token})"
        )


# --- GGUF builders ---------------------------------------------------------------------------
def _merge_pairs(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = _meta_list(metadata, "tokenizer.ggml.merges", str)
    split = list(map(str.split, merges, repeat(" ")))  # no Python loop: ~50k merges
    if set(map(len, split)) - {2}:
        bad = next(m for m, p in zip(merges, split, strict=True) if len(p) != 2)
        raise ModelLoadError(f"malformed merge {bad!r} in tokenizer.ggml.merges")
    return cast(list[tuple[str, str]], list(map(tuple, split)))


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Each token's first id (a token listed twice keeps the lower one), built in C: the
    later of two equal keys wins, so the list goes in reversed."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1), strict=True))


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    """CONTROL tokens (``<|im_end|>``) become special added tokens: matched whole in text and
    dropped by decode(skip_special_tokens=True). USER_DEFINED ones (``<think>``) are matched
    whole too (llama.cpp always does) but are ordinary text when decoding."""
    return [
        AddedToken(tok, special=kind == _CONTROL, normalized=False)
        for tok, kind in zip(tokens, types, strict=False)
        if kind in (_CONTROL, _USER_DEFINED)
    ]


def _byte_level_bpe(
    tokens: Sequence[str], types: Sequence[int], metadata: Mapping[str, Any]
) -> HFTokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    if set("".join(tokens)) <= spelled:  # nothing to respell (the usual case): no loop
        vocab = _first_ids(tokens)
        tokens_left: Sequence[str] = ()
    else:
        tokens_left = tokens
    for i, (tok, kind) in enumerate(zip(tokens_left, types, strict=False)):
        if kind == _NORMAL and not set(tok) <= spelled:
            # A normal token written in plain UTF-8 (rare converters): respell it in the byte
            # alphabet so BPE can reach it. Added tokens keep their text: they are matched raw.
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    pre = _meta_str(metadata, "tokenizer.ggml.pre") or "default"
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        logger.warning("unknown tokenizer.ggml.pre %r: splitting text like GPT-2", pre)
        splits = (_GPT2,)
    backend = HFTokenizer(_bpe(vocab=vocab, merges=_merge_pairs(metadata),
                               ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(_added_tokens(tokens, types))
    return backend


class MergesCache(Protocol):
    """Merges derived from a file's vocabulary (`_derive_merges`), kept between loads of
    that file as pairs of token ids (the loader keeps them beside its weight layouts)."""

    def load(self) -> np.ndarray | None: ...  # [M, 2] token ids

    def save(self, pairs: list[list[int]]) -> None: ...


def _sentencepiece_bpe(
    tokens: Sequence[str], types: Sequence[int], metadata: Mapping[str, Any], unk: int | None,
    merges_cache: MergesCache | None = None,
) -> HFTokenizer:
    """SentencePiece BPE (spaces spelled ▁, unknown characters as <0xXX> byte tokens)."""
    arch = str(metadata.get("general.architecture", ""))
    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma stores its runs-of-spaces tokens with real spaces; the text side sees ▁.
        # (str.isspace over the whole vocabulary in C, then the few candidates in Python:
        # ~0.015 s on Gemma 3's 262k tokens, where a Python loop over all of them took ~0.1.)
        tokens = list(tokens)
        for i in compress(count(), map(str.isspace, tokens)):
            if not tokens[i].strip(" "):
                tokens[i] = "▁" * len(tokens[i])
    vocab = _first_ids(tokens)
    merges = _merge_pairs(metadata)
    if not merges:
        cached = _cached_merges(merges_cache, tokens)
        if cached is not None:
            merges = cached
        else:
            # SentencePiece merges the adjacent pair whose result scores best, so ranking
            # every (left, right) split of each token by that token's score gives the same
            # BPE. Gemma's scores do not follow its merge order; its file order does.
            scores = (
                [-float(i) for i in range(len(tokens))]
                if gemma
                else _meta_list(metadata, "tokenizer.ggml.scores", float) or [0.0] * len(tokens)
            )
            merges = _derive_merges(tokens, types, scores, vocab)
            if merges_cache is not None:
                merges_cache.save([[vocab[left], vocab[right]] for left, right in merges])
    unk_token = tokens[unk] if unk is not None else None
    backend = HFTokenizer(
        _bpe(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    prefix = _meta_bool(metadata, "tokenizer.ggml.add_space_prefix", not gemma)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # undo the space the pre-tokenizer put in front
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    backend.add_tokens(_added_tokens(tokens, types))
    return backend


def _bpe(**kwargs: Any) -> models.BPE:
    """models.BPE, its one failure (a merge of tokens the vocabulary lacks) a one-line
    ModelLoadError naming the metadata keys."""
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # the Rust error says which token: keep that, drop the traceback
        raise ModelLoadError(
            f"tokenizer.ggml.merges does not fit tokenizer.ggml.tokens: {_one_line(e)}"
        ) from None


def _cached_merges(cache: MergesCache | None,
                   tokens: Sequence[str]) -> list[tuple[str, str]] | None:
    """The merges `cache` holds for this vocabulary, or None (none kept, or ids that do not
    fit it: derived again). Deriving Gemma 3's 515k merges takes ~1 s, reading them ~0.1."""
    pairs = cache.load() if cache is not None else None
    if (pairs is None or pairs.ndim != 2 or pairs.shape[1] != 2
            or (pairs.size and (pairs.min() < 0 or pairs.max() >= len(tokens)))):
        return None
    # Gathered by numpy and zipped in C (Gemma 3's 515k pairs: ~0.33 s, a Python loop ~0.43).
    table = np.empty(len(tokens), dtype=object)
    table[:] = tokens
    return list(zip(table[pairs[:, 0]].tolist(), table[pairs[:, 1]].tolist(), strict=True))


def _derive_merges(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every (left, right) split of each normal token into two vocabulary tokens, best
    first: by the token's score, then the longer left part, then the longer right part,
    ties in vocabulary order. One stable lexsort over arrays, not a sort of tuples: Gemma
    3's 262k tokens give 515k merges (1.0 s and 169 MiB as tuples)."""
    pairs: list[tuple[str, str]] = []
    key_score: list[float] = []
    key_left: list[int] = []
    key_right: list[int] = []
    for tok, kind, score in zip(tokens, types, scores, strict=False):
        if kind not in (_NORMAL, _USER_DEFINED) or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                pairs.append((left, right))
                key_score.append(score)
                key_left.append(cut)
                key_right.append(len(tok) - cut)
    # np.lexsort: the last key is the primary one; stable, so ties keep vocabulary order.
    order = np.lexsort((-np.asarray(key_right), -np.asarray(key_left),
                        -np.asarray(key_score, dtype=np.float64)))
    return [pairs[i] for i in order.tolist()]


def _set_bos_eos(backend: HFTokenizer, bos: str | None, eos: str | None) -> None:
    """Make encode(add_special_tokens=True) add BOS/EOS through the post-processor."""
    if bos is None and eos is None:
        backend.post_processor = None
        return

    def special(token: str | None, type_id: int) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": token, "type_id": type_id}}] if token else []

    def seq(name: str, type_id: int) -> list[dict[str, Any]]:
        return [{"Sequence": {"id": name, "type_id": type_id}}]

    # Written as tokenizer.json would spell it: the Python constructor's "token:type_id"
    # strings cannot name a token that itself contains ':'.
    spec = {
        "type": "TemplateProcessing",
        "single": [*special(bos, 0), *seq("A", 0), *special(eos, 0)],
        "pair": [
            *special(bos, 0), *seq("A", 0), *special(eos, 0),
            *special(bos, 1), *seq("B", 1), *special(eos, 1),
        ],
        "special_tokens": {
            t: {"id": t, "ids": [backend.token_to_id(t)], "tokens": [t]}
            for t in dict.fromkeys(filter(None, (bos, eos)))
        },
    }
    processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    processor.__setstate__(json.dumps(spec).encode())
    backend.post_processor = processor


# --- typed reads of GGUF tokenizer metadata ------------------------------------------------------
# The file is untrusted: a field of the wrong type is a ModelLoadError naming its key, never a
# TypeError from deep inside the tokenizer build.
def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _wrong_type(key: str, want: str, value: Any) -> ModelLoadError:
    return ModelLoadError(f"tokenizer metadata {key} must be {want}, got {_shown(value)}")


def _meta_str(metadata: Mapping[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise _wrong_type(key, "a string", value)
    return value


def _meta_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _wrong_type(key, "an integer", value)
    return value


def _meta_bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise _wrong_type(key, "a boolean", value)
    return value


def _meta_list(metadata: Mapping[str, Any], key: str, kind: type) -> list[Any]:
    """An array of `kind` (ints are taken where floats are asked); [] when absent."""
    value = metadata.get(key)
    if value is None:
        return []
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, list | tuple):
        raise _wrong_type(key, f"an array of {kind.__name__}s", value)
    if set(map(type, value)) <= set(kinds):  # the usual case, checked without a loop
        return list(value)
    if not all(isinstance(v, kinds) and not isinstance(v, bool) for v in value):
        raise _wrong_type(key, f"an array of {kind.__name__}s", value)
    return list(value)


# --- HF directory helpers ---------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _config_error(file: str, key: str, want: str, value: Any) -> ModelLoadError:
    return ModelLoadError(f"{file}: {key} must be {want}, got {_shown(value)}")


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template, wherever this transformers version saved it."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {jinja_file}: {e}") from None
    file, template = "chat_template.json", _read_json(path / "chat_template.json").get(
        "chat_template")
    if not template:
        file, template = "tokenizer_config.json", config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise _config_error(file, "chat_template", "a string", template)
    return template


# --- user text --------------------------------------------------------------------------------
def _check_text(text: Any, param: str, where: str) -> None:
    """Refuse text the tokenizer cannot take: not a string, or not encodable as UTF-8 (a lone
    surrogate such as "\ud800", which JSON and Python strings can carry)."""
    if not isinstance(text, str):
        raise InvalidParamsError(f"{where} must be a string, got {type(text).__name__}", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParamsError(
            f"{where} is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}", param,
        ) from None


def _check_strings(value: Any, where: str) -> None:
    """_check_text over every string inside one message field (content parts included)."""
    if isinstance(value, str):
        _check_text(value, "messages", where)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}[{i}]")


# templates take the first; some refuse a system turn, some want the user to start.
_SAMPLE_CHATS: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [{"role": "user", "content": "Hello!"}],
)
