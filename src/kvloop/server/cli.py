"""`kvloop serve`: flags in, a uvicorn server out.

Wired into kvloop.cli by `add_serve_parser(sub)` and `cmd_serve(args)`; also runnable on
its own as `python -m kvloop.server.cli [flags]`. Imports nothing heavy at module level,
so `kvloop --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvloop import runfile
from kvloop.config import parse_size
from kvloop.engine_flags import add_engine_flags, add_trace_flag, engine_options
from kvloop.errors import KvloopError
from kvloop.runfile import RunInfo, comparable_options, model_identity

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_ENV = "KVLOOP_API_KEY"
DETACHED_LOG_ENV = "KVLOOP_DETACHED_LOG"  # set by `serve --detach` for its child: its log


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1MiB, 65536)") from None


def _add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes and the live page "
                        f"(default: ${API_KEY_ENV} if set)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint's name)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences allowed to wait for a seat; more get 429 (default 256)")
    p.add_argument("--max-body-bytes", type=_size, default=1 << 20,
                   help="larger request bodies get 413 (default 1MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one /v1/completions list may hold; more get 400 (default 64)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="max_tokens of a chat request that sets none, capped by the room "
                        "left in the context (default 1024)")
    g = p.add_argument_group("connections")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before "
                        "they are ended with an error (default 30)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive (default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take once its headers are in "
                        "(default 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    g.add_argument("--max-connections", type=int, default=1024,
                   help="open connections; more are refused with 503 (default 1024)")
    g.add_argument("--max-header-bytes", type=_size, default=16 * 1024,
                   help="larger request heads get 431 (default 16KiB)")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (output to a log beside the run files) and "
                        "return once it answers; `kvloop ps` lists it, `kvloop stop` ends it")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--measure-machine", action="store_true",
                   help="measure this machine's FLOP/s and memory bandwidth at start (a "
                        "few seconds), for the live page's roofline gauge (without it the "
                        "page says 'not measured')")
    g = p.add_argument_group("replicas (Ray Serve: pip install 'kvloop[cluster]')")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas, each with the engine flags' --threads and "
                        "--kv-cache-memory, deployed on Ray Serve behind this one server, "
                        "which routes each prompt by its leading KV blocks (default 1: "
                        "one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on (default: $RAY_ADDRESS, else a local "
                        "one started here)")
    g.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix",
                   help="how requests are spread over replicas (default prefix: by the "
                        "prompt's cached blocks, bounded by load)")
    add_engine_flags(p)
    add_trace_flag(p, "written when the server shuts down")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to kvloop's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health "
                    "and /metrics, and a live page of the engine's loop at /. Concurrent "
                    "requests join one continuous batch.")
    _add_flags(p)
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags before the slow model load."""
    if not 0 <= args.port <= 65535:
        raise KvloopError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 1:
        raise KvloopError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    for flag in ("max_body_bytes", "max_prompts_per_request", "default_max_tokens",
                 "max_connections", "max_header_bytes"):
        if getattr(args, flag) < 1:
            raise KvloopError(f"--{flag.replace('_', '-')} must be >= 1, "
                              f"got {getattr(args, flag)}")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not 0 < getattr(args, flag) < 1e6:
            raise KvloopError(f"--{flag.replace('_', '-')} must be a positive number of "
                              f"seconds, got {getattr(args, flag)}")
    if not 0 <= args.shutdown_grace < 1e6:
        raise KvloopError(f"--shutdown-grace must be >= 0 seconds, got {args.shutdown_grace}")
    engine_options(args)  # EngineConfig's own checks, in the API's words
    if args.replicas < 1:
        raise KvloopError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        from kvloop.cluster.deploy import require_ray

        require_ray()
        if args.trace is not None:
            raise KvloopError("--trace records one engine's steps; it cannot be used "
                              "with --replicas > 1")


def _is_loopback(host: str) -> bool:
    import ipaddress  # this module loads for every CLI command: its imports wait till used

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $KVLOOP_API_KEY; empty means none."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def cmd_serve(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Serve until SIGTERM/SIGINT; with --detach, start that in the background from
    `argv` (the serve command's own arguments) and return once it answers."""
    _check(args)
    if args.detach and not os.environ.get(DETACHED_LOG_ENV):  # never detach twice
        from kvloop.server import control

        # Any spelling argparse took for --detach ("--det"): the child serves in place.
        rest = [a for a in argv if not (len(a) > 2 and "--detach".startswith(a))]
        return control.detach(rest)
    import logging

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvloop.server")
    api_key = resolve_api_key(args)
    if api_key is None and not _is_loopback(args.host):
        log.warning("binding %s without --api-key: anyone who can reach it can use it",
                    args.host)

    # Deferred: torch and FastAPI take seconds to import.
    from kvloop.config import EngineConfig
    from kvloop.engine.async_engine import AsyncEngine
    from kvloop.engine.client import EngineClient
    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.server.app import ServerSettings, create_app
    from kvloop.server.lifecycle import build_server

    config = EngineConfig(**engine_options(args))  # a bad option: refused before loading
    trace = None
    if args.trace is not None:  # a path that cannot be written: refused before loading too
        from kvloop.engine.trace import TraceRecorder

        trace = TraceRecorder(args.trace)
    machine = None
    if args.measure_machine:
        from kvloop.engine.machine import measure_machine

        machine = measure_machine()
        log.info("measured %s for the live page's roofline", machine.describe())
    cluster = None
    engine: EngineClient
    if args.replicas > 1:
        from kvloop.cluster.deploy import start_cluster

        cluster = start_cluster(args.model, config, args.replicas, args.max_waiting,
                                args.ray_address, args.routing)
        engine = cluster.pool
    else:
        # Loaded on the engine's own thread, which then runs it (AsyncEngine.build: why).
        engine = AsyncEngine.build(lambda: LLMEngine(args.model, config))
    app = create_app(engine, ServerSettings(
        model_name=args.served_model_name, api_key=api_key, max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes, max_prompts_per_request=args.max_prompts_per_request,
        default_max_tokens=args.default_max_tokens, shutdown_grace=args.shutdown_grace,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections,
        max_header_bytes=args.max_header_bytes), trace=trace, machine=machine)
    # SIGTERM/SIGINT drain the server (see kvloop.server.lifecycle): a clean exit, 0.
    server = build_server(app, host=args.host, port=args.port, log_level=args.log_level)
    info = RunInfo(url="", pid=os.getpid(), model=app.state.serving.model_name,
                   model_identity=model_identity(engine.engine.checkpoint.path),
                   engine_options=comparable_options(engine_options(args)),
                   api_key_required=api_key is not None,
                   log=os.environ.get(DETACHED_LOG_ENV))
    server.on_started = lambda port: _announce(info, args.host, port)
    try:
        server.run()
    finally:
        runfile.remove(info)
        if cluster is not None:
            cluster.close()
    return 0


def client_url(host: str, port: int) -> str:
    """The address a local client dials for a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce(info: RunInfo, host: str, port: int) -> None:
    """The run file that lets `kvloop generate` / `chat` / `ps` find this server."""
    info.url = client_url(host, port)
    try:
        runfile.write(info)
    except OSError as e:  # serving goes on; only discovery is lost
        import logging

        logging.getLogger("kvloop.server").warning("cannot write the run file %s: %s",
                                                   info.path, e)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvloop serve", description="kvloop's HTTP server")
    _add_flags(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args, sys.argv[1:] if argv is None else list(argv))
    except KvloopError as e:
        print(f"kvloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
