"""Connection hygiene: uvicorn's h11 protocol with the limits it lacks.

uvicorn closes an idle keep-alive connection, but not a new connection that never sends a
byte, nor one that sends its headers (or its body) one byte at a time: each holds a socket
and a file descriptor for as long as the client likes. It has no cap on open connections
(`limit_concurrency` answers only once a request is complete), and it answers headers that
outgrow h11's buffer by closing the socket with the rest of the request unread, which the
kernel turns into a reset the client sees instead of any status. This protocol adds:

- a header timeout: a request's head must be complete this long after the connection
  opened (or the previous response ended); no reset by each byte, so a slow-loris client
  gains nothing by trickling;
- a body timeout: once the head is in, the body must be complete within this;
- a cap on open connections: one over it is answered 503 at once and closed;
- 431 (and 400 for other malformed requests) in the OpenAI error shape;
- a lingering close after every error it writes itself: half-close, discard what the
  client still sends for a moment, then close, so the client reads the answer.
"""

from __future__ import annotations

import asyncio
import http
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from kvloop.server.errors import APIError
from kvloop.server.protocol import dumps

logger = logging.getLogger("kvloop.server")

DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's own default


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int | None = 1024
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    linger: float = 2.0  # how long a refused client may keep sending before the close


class _RecordingConnection(h11.Connection):
    """Keeps the last protocol error: uvicorn swallows it and answers a plain 400, but the
    error knows the right status (431 when the head outgrew the buffer).

    It also holds the whole request head to `max_header_bytes`. h11 checks its limit only
    while an event is incomplete, so a head that arrives in one read, however large, was
    parsed and served (a 70 KB header got 200); here the bytes a Request event took from
    the buffer are counted, however they arrived."""

    last_error: h11.RemoteProtocolError | None = None

    def __init__(self, our_role: type[h11.SERVER], max_header_bytes: int) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        buffered = len(self._receive_buffer)  # h11's buffer: only its length is read
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise
        if isinstance(event, h11.Request) and \
                buffered - len(self._receive_buffer) > self.max_header_bytes:
            self.last_error = h11.RemoteProtocolError("request head too large",
                                                      error_status_hint=431)
            raise self.last_error
        return event


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _RecordingConnection(h11.SERVER, self.limits.max_header_bytes)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # bytes of the awaited request's head have come
        self._lingering = False

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cap = self.limits.max_connections
        over = cap is not None and len(self.connections) >= cap
        super().connection_made(transport)  # type: ignore[arg-type]
        if over:
            # Not counted, not waited for at shutdown: it is already on its way out.
            self.connections.discard(self)
            logger.warning("refused a connection: %d open (limit %d)",
                           len(self.connections), cap)
            self._write_error(APIError(503, f"too many open connections (limit {cap}); retry "
                                       "later", "service_unavailable", code="server_busy",
                                       headers={"Retry-After": "1"}))
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer is written; what the client still sends is dropped
        if self._header_timer is not None:
            self._head_started = True
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._body_timer, self._close_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    # -- uvicorn hooks ------------------------------------------------------------------------
    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a request's head is complete
            self._cancel_header_timer()
            if cycle.more_body and self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout,
                                                        self._body_timed_out)
        if cycle is not None and not cycle.more_body and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        if self._body_timer is not None:  # answered before the body came (413, 401)
            self._body_timer.cancel()
            self._body_timer = None
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this connection
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        error = self.conn.last_error if isinstance(self.conn, _RecordingConnection) else None
        if error is not None and error.error_status_hint == 431:
            self._write_error(APIError(
                431, f"request headers exceed {self.limits.max_header_bytes} bytes",
                code="headers_too_large"))
        else:
            self._write_error(APIError(400, f"malformed HTTP request: {error or msg}",
                                       code="invalid_http"))

    def shutdown(self) -> None:
        if self._lingering:  # already answered and on its way out; h11 may be in ERROR
            self.transport.close()
            return
        super().shutdown()

    # -- timers -------------------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._head_started = False
        self._header_timer = self.loop.call_later(self.limits.header_timeout,
                                                  self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._head_started:  # idle: nobody is waiting for an answer
            self.transport.close()
            return
        self._write_error(APIError(408, f"the request headers did not arrive within "
                                   f"{self.limits.header_timeout:g} s", code="request_timeout"))

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            return
        if not cycle.response_started:
            self._write_error(APIError(408, f"the request body did not arrive within "
                                       f"{self.limits.body_timeout:g} s",
                                       code="request_timeout"))
        else:
            self.transport.close()
        # The app, waiting on the body, hears a disconnect; its later sends are dropped.
        cycle.disconnected = True
        cycle.message_event.set()

    # -- answers we write ourselves -------------------------------------------------------------
    def _write_error(self, error: APIError) -> None:
        """Write `error` as a whole response, bypassing h11 (whose state may not allow one
        yet), and close the connection after it."""
        body = dumps(error.body().model_dump()).encode()
        head = [f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}",
                "content-type: application/json", f"content-length: {len(body)}",
                "connection: close", *(f"{k}: {v}" for k, v in error.headers.items())]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close and drop what the client still sends, then close: a close with
        unread bytes makes the kernel send a reset, and the client may lose the answer."""
        self._cancel_header_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._lingering = True
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self._close_timer is None:
            self._close_timer = self.loop.call_later(self.limits.linger, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol bound to `limits`, for `uvicorn.Config(http=...)` (uvicorn
    builds the protocol itself, with its own arguments)."""
    return type("KvloopH11Protocol", (GuardedH11Protocol,), {"limits": limits})
