"""kvloop's command line: translate flags into SamplingParams and engine options, print.

    kvloop generate "PROMPT" [--chat] [--json] [--temperature T] [--max-tokens N] ...
    kvloop chat
Every behaviour lives in the engine; this module only parses, validates and prints.
User mistakes end with one line on stderr and exit status 2, never a traceback: sampling and
engine flags are checked by SamplingParams and EngineConfig (the API's own words) before the
model loads, and text that is not UTF-8 (a prompt argument with undecodable bytes, a binary
--prompts-file) is refused the same way. In `kvloop chat` a line that is not UTF-8 is
reported and skipped and the conversation goes on; the session then exits with status 2, so a
script that piped a file in notices.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvloop import runfile
from kvloop.engine_flags import (
    add_engine_flags,
    add_trace_flag,
    default_engine_options,
    engine_options,
)
from kvloop.errors import KvloopError, RemoteError
from kvloop.params import SamplingParams, StructuredOutput
from kvloop.plan_cli import add_plan_parser, cmd_plan
from kvloop.server.cli import add_serve_parser, cmd_serve

if TYPE_CHECKING:  # kvloop.client (http.client, json): only the remote path loads it
    from kvloop.client import Remote
    from kvloop.engine.trace import TraceRecorder

EXIT_USAGE = 2
EXIT_REMOTE = 1  # the resident engine failed to answer


def _resident_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resident engine")
    g.add_argument("--server", default=None, metavar="URL",
                   help="send the request to the kvloop serve at URL (default: $KVLOOP_SERVER, "
                        "else a local `kvloop serve` found by its run file)")
    g.add_argument("--local", action="store_true",
                   help="load the model in this process even when a server is running")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[],
                   dest="stop_token_ids")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS")
    g.add_argument("--n", type=int, default=1, help="independent samples per prompt")
    g.add_argument("--num-beams", type=int, default=1, help="beam search with B beams")
    g.add_argument("--length-penalty", type=float, default=1.0)
    g.add_argument("--early-stopping", default="false", choices=["true", "false", "never"])
    g.add_argument("--num-return-sequences", type=int, default=None)
    g = p.add_argument_group("structured output (one of)")
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="the output is JSON valid against this JSON schema file")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--choice", action="append", default=None,
                   help="the output is one of these strings (repeatable)")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="the output follows this Lark grammar file")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one `kvloop: error:` line like every other."""

    def error(self, message: str) -> NoReturn:
        # self.prog is "kvloop" or "kvloop generate": the program's name is in it once.
        self.exit(EXIT_USAGE, f"kvloop: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvloop", description="LLM inference on the CPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one prompt, streamed")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--prompts-file", default=None,
                     help="one prompt per line, all run as one continuous batch")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--parse-special", action="store_true",
                     help="tokenize special-token strings in the prompt as control tokens; "
                          "by default they are plain text")
    _sampling_flags(gen)
    add_engine_flags(gen)
    add_trace_flag(gen, "written when the reply is done (the model runs in this "
                        "process, never on a resident engine)")
    _resident_flags(gen)

    roof = sub.add_parser("roofline", help="predict TTFT and time per token from first "
                          "principles (and, for a loaded model, compare with kvloop)")
    roof.add_argument("--params", type=float, default=None,
                      help="a hypothetical model's parameter count (e.g. 13e9); "
                           "without it, the model given by --model (or the default) is measured")
    roof.add_argument("--dtype", default="fp16", help="weights' type with --params "
                      "(fp32, fp16, bf16, int8, int4, q8_0, q4_0, q4_1)")
    roof.add_argument("--prompt-tokens", type=int, default=512)
    roof.add_argument("--output-tokens", type=int, default=128)
    roof.add_argument("--flops", type=float, default=None, help="FLOP/s (default: measured here)")
    roof.add_argument("--bandwidth", type=float, default=None,
                      help="memory bytes/s (default: measured here)")
    add_engine_flags(roof)

    add_plan_parser(sub)
    add_serve_parser(sub)

    tok = sub.add_parser("export-tokenizer",
                         help="write a model's tokenizer as transformers reads one (for "
                              "lm-evaluation-harness against `kvloop serve`)")
    tok.add_argument("directory")
    tok.add_argument("--model", default=None, help="model path (default: the default model)")

    sub.add_parser("ps", help="list the running `kvloop serve` engines")
    stop = sub.add_parser("stop", help="stop running `kvloop serve` engines (they drain first)")
    stop.add_argument("target", nargs="?", default=None, metavar="PID|URL",
                      help="the one to stop (default: every one `kvloop ps` lists)")

    chat = sub.add_parser("chat", help="an interactive conversation")
    chat.add_argument("--system", default=None)
    _sampling_flags(chat)
    add_engine_flags(chat)
    _resident_flags(chat)
    return parser


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    bias: dict[int, float] = {}
    for item in args.logit_bias:
        tok, sep, val = item.partition("=")
        try:
            bias[int(tok)] = float(val)
        except ValueError:
            raise KvloopError(f"--logit-bias expects ID=BIAS, got {item!r}") from None
        if not sep:
            raise KvloopError(f"--logit-bias expects ID=BIAS, got {item!r}")
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        logit_bias=bias or None, n=args.n, num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping={"true": True, "false": False}.get(args.early_stopping, "never"),
        num_return_sequences=args.num_return_sequences,
        structured=_structured(args),
    )


def _structured(args: argparse.Namespace) -> StructuredOutput | None:
    """The output constraint flags (one of them), files read here."""
    given = [f for f in ("json_schema", "json_object", "regex", "choice", "grammar")
             if getattr(args, f) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise KvloopError(f"give one of --json-schema, --json-object, --regex, --choice, "
                          f"--grammar (got {', '.join('--' + g.replace('_', '-') for g in given)})")
    if args.json_schema is not None:
        return StructuredOutput(json_schema=_read_text(args.json_schema, "--json-schema"))
    if args.grammar is not None:
        return StructuredOutput(grammar=_read_text(args.grammar, "--grammar"))
    return StructuredOutput(json_object=args.json_object, regex=args.regex,
                            choice=args.choice)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KvloopError(f"cannot read {flag} {path}: {e}") from None


# Whether this process loaded a model itself (the one-shot path): see run().
_engine_loaded = False


def _make_llm(args: argparse.Namespace) -> Any:
    from kvloop.loading.chat_template import prestart_worker

    prestart_worker()  # it boots on the other core while torch imports
    from kvloop.engine.llm import LLM  # deferred: torch import is slow, --help stays fast

    global _engine_loaded
    _engine_loaded = True
    return LLM(args.model, **engine_options(args))


def _check_text(text: str, what: str) -> str:
    """`text` if it is valid Unicode, else one KvloopError line.

    Python hands undecodable argv bytes over as lone surrogates (surrogateescape), which no
    tokenizer can encode: say which byte, where, instead of a traceback from deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what_byte = (f"undecodable byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF
                     else f"lone surrogate U+{ch:04X}")
        raise KvloopError(f"{what} is not valid UTF-8 text ({what_byte} at character "
                          f"{e.start})") from None
    return text


def _decode_line(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvloopError(f"{what} is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"byte {e.start})") from None


def _figures(metrics: dict[str, Any]) -> str:
    ttft = metrics.get("ttft_s") or 0.0
    tps = metrics.get("decode_tokens_per_s")
    accepted = metrics.get("mean_accepted_length")
    spec = f" | {accepted:.2f} tokens/step accepted" if accepted else ""
    if metrics.get("forced_tokens"):
        spec += f" | {metrics['forced_tokens']} forced by the grammar"
    return (f"[TTFT {ttft * 1000:.0f} ms | decode {tps or 0:.1f} tok/s | "
            f"{metrics['output_tokens']} tokens | "
            f"{metrics['positions_processed']} positions processed{spec}]")


def _completion_json(comp: Any, params: SamplingParams) -> dict[str, Any]:
    obj: dict[str, Any] = {"text": comp.text, "token_ids": comp.token_ids,
                           "finish_reason": comp.finish_reason}
    if comp.score is not None:
        obj["score"] = comp.score
    if params.logprobs is not None:
        obj["logprobs"] = comp.logprobs
        obj["top_logprobs"] = comp.top_logprobs
    return obj


def _output_json(comps: Sequence[Any], metrics: dict[str, Any], params: SamplingParams,
                 load_seconds: float) -> dict[str, Any]:
    """One object per prompt: flat for one sequence, an `outputs` list (best first) for
    several (n > 1 or beams). `comps`: the engine's CompletionOutputs, or the client's
    Completions (the same fields, as a resident engine sent them)."""
    if len(comps) == 1 and params.n == 1 and params.num_beams == 1:
        obj = {**_completion_json(comps[0], params), "metrics": metrics}
    else:
        best_first = sorted(comps, key=lambda c: -(c.score if c.score is not None
                                                    else c.cumulative_logprob))
        obj = {"outputs": [_completion_json(c, params) for c in best_first],
               "metrics": metrics}
    return {**obj, "load_seconds": load_seconds}


def _print_outputs(comps: Sequence[Any], metrics: dict[str, Any], params: SamplingParams,
                   args: argparse.Namespace, prompt_index: int, load_seconds: float) -> None:
    """The answer to one prompt of a batch (or of several sequences), not streamed."""
    if args.json:
        print(json.dumps(_output_json(comps, metrics, params, load_seconds)))
        return
    for comp in comps:
        label = f"prompt {prompt_index}" if args.prompts_file else ""
        extra = f" score {comp.score:.4f}" if comp.score is not None else ""
        print(f"--- {label} sequence {comp.index}{extra} ---".replace("  ", " "))
        print(comp.text)
    print(_figures(metrics), file=sys.stderr)


def _read_prompts(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KvloopError(f"cannot read --prompts-file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        # Decoded whole (not line by line) so the offset is the file's: say where it breaks.
        line = data.count(b"\n", 0, e.start) + 1
        raise KvloopError(f"--prompts-file {path} is not UTF-8 text (byte "
                          f"0x{data[e.start]:02x} on line {line}, at byte {e.start})") from None
    prompts = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise KvloopError(f"--prompts-file {path} has no prompts")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate before the slow model load
    engine_options(args)
    if (args.prompt is None) == (args.prompts_file is None):
        raise KvloopError("give a PROMPT or --prompts-file FILE (one of them)")
    if args.parse_special and args.chat:
        # With --chat the template's own tokens are control tokens already; message text
        # stays text. A raw prompt written in the template's syntax needs no --chat.
        raise KvloopError("--parse-special applies to plain prompts, not to --chat")
    texts = (_read_prompts(args.prompts_file) if args.prompts_file
             else [_check_text(args.prompt, "PROMPT")])
    if args.system is not None:
        _check_text(args.system, "--system")
    remote = _resident(args)
    if remote is not None:
        return _generate_remote(remote, args, params, texts)
    trace = _trace_recorder(args.trace)  # a bad path is refused before the model loads
    llm = _make_llm(args)
    if trace is None:
        return _generate_local(llm, args, params, texts)
    llm.engine.observer = trace
    try:
        return _generate_local(llm, args, params, texts)
    finally:  # what ran is written, an interrupted run's too
        _write_trace(trace)


def _trace_recorder(path: str | None) -> TraceRecorder | None:
    if path is None:
        return None
    from kvloop.engine.trace import TraceRecorder

    return TraceRecorder(path)  # writes an empty trace now: a KvloopError if it cannot


def _write_trace(trace: TraceRecorder) -> None:
    try:
        trace.write()
    except OSError as e:
        raise KvloopError(f"cannot write --trace {trace.path}: {e.strerror or e}") from None


def _generate_local(llm: Any, args: argparse.Namespace, params: SamplingParams,
                    texts: list[str]) -> int:
    """`kvloop generate` on a model loaded in this process."""
    def encode(text: str) -> str | list[int]:
        if args.parse_special:
            return list(llm.tokenizer.encode(text, parse_special=True))
        if not args.chat:
            return text
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return llm.tokenizer.encode_chat([*msgs, {"role": "user", "content": text}])

    prompts = [encode(t) for t in texts]
    if args.prompts_file or params.n > 1 or params.num_beams > 1:
        outs = llm.generate(prompts, params, use_tqdm=bool(args.prompts_file))
        for i, out in enumerate(outs):
            _print_outputs(out.outputs, out.metrics.as_dict(), params, args, i,
                           llm.load_seconds)
        return 0

    last = None
    for out in llm.stream_outputs(prompts[0], params):
        if not args.json and out.outputs[0].delta:
            sys.stdout.write(out.outputs[0].delta)
            sys.stdout.flush()
        last = out
    assert last is not None
    _end_stream(last.outputs, last.metrics.as_dict(), params, args, llm.load_seconds)
    return 0


def _end_stream(comps: Sequence[Any], metrics: dict[str, Any], params: SamplingParams,
                args: argparse.Namespace, load_seconds: float) -> None:
    """After a streamed answer: the JSON object, or the newline and the figures line."""
    if args.json:
        print(json.dumps(_output_json(comps, metrics, params, load_seconds)))
    else:
        sys.stdout.write("\n")
        print(_figures(metrics), file=sys.stderr)


# -- a resident engine ----------------------------------------------------------------------
def _resident(args: argparse.Namespace) -> Remote | None:
    """The running server this command goes to, or None: load the model here. Decided
    before anything heavy is imported, so a remote command never loads torch."""
    if args.local or getattr(args, "trace", None):  # a trace is of this process's engine
        return None
    if not (args.server or os.environ.get(runfile.SERVER_ENV) or runfile.live()):
        return None  # nothing to reach: kvloop.client stays unimported
    from kvloop import client

    defaults = default_engine_options()
    asked = {k: v for k, v in engine_options(args).items() if defaults.get(k) != v}
    return client.discover(args.server, args.model, asked)


def _generate_remote(remote: Remote, args: argparse.Namespace, params: SamplingParams,
                     texts: list[str]) -> int:
    """`kvloop generate` through a resident engine: the same output as a local run."""
    from kvloop import client

    body = client.sampling_body(params, chat=args.chat)
    if args.parse_special:
        body["parse_special_tokens"] = True
    # The model was loaded before this command: it spent nothing on loading.
    load_seconds = 0.0
    if args.prompts_file or params.n > 1 or params.num_beams > 1:
        answers = client.complete(remote, texts, body, args.system, chat=args.chat)
        for i, ans in enumerate(answers):
            _print_outputs(ans.outputs, ans.metrics, params, args, i, load_seconds)
        return 0
    if args.chat:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        body["messages"] = [*msgs, {"role": "user", "content": texts[0]}]
    else:
        body["prompt"] = texts[0]
    answer, written = None, False
    try:
        for piece in client.stream_text(remote, body, chat=args.chat):
            if isinstance(piece, client.Answer):
                answer = piece
            elif not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
                written = True
    except RemoteError:
        if written:  # end the half-written line: the error goes on a line of its own
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    assert answer is not None
    _end_stream(answer.outputs, answer.metrics, params, args, load_seconds)
    return 0


def _read_chat_line(line_no: int) -> str | None:
    """One line of the conversation from stdin, without its newline; None at end of input.

    Read as bytes and decoded here, so a line that is not UTF-8 is a KvloopError for that
    line alone (the text layer would raise mid-stream, or hand over lone surrogates)."""
    sys.stdout.write(">>> ")
    sys.stdout.flush()
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        raw = buffer.readline()
        if not raw:
            return None
        line = _decode_line(raw, f"input line {line_no}")
    else:  # a text stream without bytes underneath (tests, embedding)
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError:
            raise KvloopError(f"input line {line_no} is not valid UTF-8 text") from None
        if not line:
            return None
        _check_text(line, f"input line {line_no}")
    return line.removesuffix("\n").removesuffix("\r")


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine_options(args)
    if args.system is not None:
        _check_text(args.system, "--system")
    remote = _resident(args)
    turn = _remote_turn(remote, params) if remote is not None else _local_turn(args, params)
    history: list[dict[str, str]] = (
        [{"role": "system", "content": args.system}] if args.system else [])
    print("kvloop chat: /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    status, line_no = 0, 0
    while True:
        line_no += 1
        try:
            got = _read_chat_line(line_no)
        except KeyboardInterrupt:
            got = None
        except KvloopError as e:  # not UTF-8: skip the line, keep the conversation
            print(f"kvloop: error: {e}; skipped", file=sys.stderr)
            status = EXIT_USAGE
            continue
        if got is None:
            print(file=sys.stderr)
            return status
        line = got
        if line.strip() in ("/exit", "/quit"):
            return status
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        metrics = None
        try:
            for piece in turn(history):
                if isinstance(piece, dict):
                    metrics = piece
                    continue
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KvloopError as e:  # e.g. the conversation outgrew the context
            print(f"\nkvloop: error: {e}", file=sys.stderr)
            history.pop()
            continue
        except RemoteError:  # the engine is gone: the session ends (exit 1)
            print()
            raise
        print()
        if metrics is not None:
            print(_figures(metrics), file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})


# One turn of a conversation: the reply's text pieces as they come, then its metrics.
Turn = Callable[[list[dict[str, str]]], Iterator[str | dict[str, Any]]]


def _local_turn(args: argparse.Namespace, params: SamplingParams) -> Turn:
    llm = _make_llm(args)
    if not llm.tokenizer.chat_template:  # say so now, not after the first line is typed
        from kvloop.loading.tokenizer import NO_CHAT_TEMPLATE

        raise KvloopError(NO_CHAT_TEMPLATE)

    def turn(history: list[dict[str, str]]) -> Iterator[str | dict[str, Any]]:
        last = None
        for out in llm.stream_outputs(llm.tokenizer.encode_chat(history), params):
            if out.outputs[0].delta:
                yield out.outputs[0].delta
            last = out
        if last is not None:
            yield last.metrics.as_dict()

    return turn


def _remote_turn(remote: Remote, params: SamplingParams) -> Turn:
    """A turn on the resident engine: the conversation goes as messages, the server
    applies the chat template (this process has no tokenizer)."""
    from kvloop import client

    body = client.sampling_body(params, chat=True)

    def turn(history: list[dict[str, str]]) -> Iterator[str | dict[str, Any]]:
        for piece in client.stream_text(remote, {**body, "messages": history}, chat=True):
            yield piece.metrics if isinstance(piece, client.Answer) else piece

    return turn


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    from kvloop.loading.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)  # headers and tokenizer only: no weights read
    for path in checkpoint.tokenizer.save_pretrained(
            args.directory, checkpoint.config.max_position_embeddings):
        print(path)
    return 0


def cmd_roofline(args: argparse.Namespace) -> int:
    from kvloop import roofline as rl

    if args.prompt_tokens < 1 or args.output_tokens < 1:
        raise KvloopError("--prompt-tokens and --output-tokens must be >= 1")
    if args.params is not None and args.params <= 0:
        raise KvloopError(f"--params must be > 0, got {args.params}")
    dtype = args.dtype.lower()
    if dtype not in rl.BYTES_PER_PARAM:
        raise KvloopError(f"unknown --dtype {args.dtype!r}; one of {sorted(rl.BYTES_PER_PARAM)}")
    if args.flops is None or args.bandwidth is None:
        from kvloop.engine.machine import measure_bandwidth, measure_flops

        flops = args.flops or measure_flops()
        bandwidth = args.bandwidth or measure_bandwidth()
    else:
        flops, bandwidth = args.flops, args.bandwidth
    machine = rl.Machine(flops, bandwidth)
    if args.params is not None:
        pred = rl.predict(args.params, rl.BYTES_PER_PARAM[dtype], args.prompt_tokens,
                          args.output_tokens, machine)
        print(f"model: {args.params / 1e9:,.3g} B parameters, {dtype}; prompt "
              f"{args.prompt_tokens} tokens, {args.output_tokens} output tokens")
        print(rl.report(pred, machine))
        return 0

    llm = _make_llm(args)
    c = llm.engine.model_config
    weight_bytes = llm.engine.model.decode_read_bytes()
    n_params = c.num_params()
    kv_per_token = llm.engine.kv_bytes_per_token  # as --kv-cache-dtype stores it
    pred = rl.predict(n_params, weight_bytes / n_params, args.prompt_tokens,
                      args.output_tokens, machine, kv_per_token)
    print(f"model: {llm.engine.checkpoint.name}, {n_params / 1e6:,.1f} M parameters, "
          f"{weight_bytes / 1e6:,.0f} MB read per decode step; prompt {args.prompt_tokens} "
          f"tokens, {args.output_tokens} output tokens")
    print(rl.report(pred, machine))
    ids = list(range(100, 100 + args.prompt_tokens))
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    m = out.metrics
    ttft, tpot = m.ttft or float("nan"), m.tpot or float("nan")
    print(f"measured: TTFT {ttft * 1e3:,.1f} ms ({pred.ttft_s / ttft:.0%} of the compute "
          f"limit), {tpot * 1e3:,.2f} ms/token ({pred.decode_step_s / tpot:.0%} of the "
          f"bandwidth limit)")
    # The same request's own account (kvloop.engine.attribution): the bytes charged to it
    # step by step over its decode, and the FLOPs of all its positions.
    rate, frac = m.decode_bytes_per_s, m.decode_bandwidth_fraction(bandwidth)
    if rate is not None and frac is not None:
        print(f"attributed: {m.flops / 1e9:,.3g} GFLOP, {m.weight_bytes / 1e9:,.3g} GB of "
              f"weights and {m.kv_bytes / 1e6:,.3g} MB of KV cache read; its decode read "
              f"{rate / 1e9:,.3g} GB/s ({frac:.0%} of the bandwidth limit)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "roofline":
            return cmd_roofline(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "serve":
            return cmd_serve(args, raw[raw.index("serve") + 1:])
        if args.command == "export-tokenizer":
            return cmd_export_tokenizer(args)
        if args.command in ("ps", "stop"):
            from kvloop.server import control

            return control.ps() if args.command == "ps" else control.stop(args.target)
        return cmd_chat(args)
    except KvloopError as e:
        print(f"kvloop: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteError as e:
        print(f"kvloop: error: {e}", file=sys.stderr)
        return EXIT_REMOTE
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The `kvloop` command. After a one-shot generate or chat, the output flushed and the
    exit handlers run (tensor parallel ranks stopped, template workers closed), the process
    ends without the interpreter's teardown: with torch loaded, destroying its modules and
    libraries took ~0.35 s of a ~2.4 s `kvloop generate` (Zen 3), and nothing in it
    matters to a process whose work is done. Other commands exit as usual."""
    try:
        code = main()
    except BrokenPipeError:  # the reader went away (`kvloop generate ... | head`)
        # Nothing more can be said to it; what is still buffered must not fail again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    if _engine_loaded:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError):
                stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
