"""The uvicorn server kvloop runs: connection limits in, graceful shutdown out.

On SIGTERM or SIGINT (or `should_exit`) the server first drains: new requests get 503 with
Retry-After and /health says 503, while requests already running get up to the grace
period to finish. Those still running then are ended through the serving layer, so each
client is told (a JSON error, or an SSE error event and `[DONE]`) instead of having its
connection cut. Only then does uvicorn's own shutdown run, with nothing left for it to
cancel, and the process exits 0.

    server = build_server(app, host="127.0.0.1", port=8000)
    server.run()
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvloop.server.connections import ConnectionLimits, protocol_class
from kvloop.server.errors import APIError
from kvloop.server.serving import OpenAIServing

logger = logging.getLogger("kvloop.server")

# After the drain, how long handlers get to write the errors of the requests it ended
# (they only format and send one message each).
_WRITE_OUT_S = 5.0


class KvloopServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, grace: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.grace = grace
        # Called with the bound port once the server accepts connections (a run file is
        # written then: before, a client that found it would be refused).
        self.on_started: Callable[[int], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started(self.servers[0].sockets[0].getsockname()[1])

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn records the signal and raises it again once it has shut down, so the
        # process dies of it (exit status 143); a drained shutdown is a clean exit.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.drain()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        serving = self.serving
        serving.draining = True
        loop = asyncio.get_running_loop()
        if serving.num_jobs:
            logger.info("shutting down: %d requests in flight get up to %g s to finish",
                        serving.num_jobs, self.grace)
        deadline = loop.time() + self.grace
        while serving.num_jobs and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if not serving.num_jobs:
            return
        logger.warning("shutting down: ending %d requests still running after %g s",
                       serving.num_jobs, self.grace)
        serving.end_all(APIError(503, "the server shut down before this request finished",
                                 "service_unavailable", code="shutting_down"))
        deadline = loop.time() + _WRITE_OUT_S
        while serving.num_jobs and loop.time() < deadline:
            await asyncio.sleep(0.02)


# File descriptors kept back from the connection cap: model files, threads' pipes, logs.
_FD_RESERVE = 64


def _within_fd_limit(cap: int | None) -> int | None:
    """The connection cap, lowered below the process's open-file limit: past that limit
    accept() itself fails, and the cap's 503 is never sent."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return cap
    if soft == resource.RLIM_INFINITY or soft <= 2 * _FD_RESERVE:
        return cap
    room = soft - _FD_RESERVE
    if cap is None:
        return room
    if cap > room:
        logger.warning("connection cap lowered to %d: the open-file limit is %d (raise it "
                       "with ulimit -n)", room, soft)
        return room
    return cap


def build_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "info") -> KvloopServer:
    """A server for an app from kvloop.server.app.create_app, with its settings' limits."""
    settings = app.state.settings
    limits = ConnectionLimits(header_timeout=settings.header_timeout,
                              body_timeout=settings.body_timeout,
                              max_connections=_within_fd_limit(settings.max_connections),
                              max_header_bytes=settings.max_header_bytes)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=protocol_class(limits),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
        # The drain has ended every request by then; this only bounds the last writes.
        timeout_graceful_shutdown=int(_WRITE_OUT_S))
    return KvloopServer(config, app.state.serving, settings.shutdown_grace)
