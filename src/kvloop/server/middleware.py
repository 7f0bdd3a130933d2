"""Two gates every request passes before any route runs: the API key (on /v1 and the live
page) and the body-size limit. Plain ASGI, so a refused body is never parsed, nor read past
the limit. And one net under the routes: a bug is one failed request, logged once."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie

from starlette.responses import RedirectResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvloop.server.errors import APIError

logger = logging.getLogger("kvloop.server")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every path under `prefix`; /health and /metrics stay
    open so probes and scrapers need no secret.

    The live page's paths (`page_paths(path)` true) are guarded by the same key, and also
    accept the cookie `cookie` = `page_token` that the page's key form sets: a browser
    cannot send a header when it opens a URL. A browser opening the page without it is
    sent to `login_path`."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1",
                 page_paths: Callable[[str], bool] | None = None, cookie: str = "",
                 page_token: str = "", login_path: str = "") -> None:
        self.app = app
        self.key = api_key.encode()
        self.prefix = prefix
        self.page_paths = page_paths
        self.cookie = cookie
        self.page_token = page_token.encode()
        self.login_path = login_path

    def _bearer_ok(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _cookie_ok(self, scope: Scope) -> bool:
        jar = SimpleCookie()
        try:
            jar.load((_header(scope, b"cookie") or b"").decode("latin-1"))
        except CookieError:
            return False
        morsel = jar.get(self.cookie)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(),
                                                          self.page_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            page = self.page_paths is not None and self.page_paths(path)
            if page and not (self._bearer_ok(scope) or self._cookie_ok(scope)):
                if path == "/" and scope.get("method") == "GET" and self.login_path:
                    await RedirectResponse(self.login_path, status_code=303)(
                        scope, receive, send)
                    return
                await _unauthorized().response()(scope, receive, send)
                return
            if path.startswith(self.prefix) and not self._bearer_ok(scope):
                await _unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                    "authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413: at once when Content-Length says so, else
    as soon as the bytes received pass the limit (chunked uploads have no length).

    The body is read here in full and replayed to the app; later `receive` calls go to
    the server, so the app still hears a client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                error = APIError(400, f"invalid Content-Length header: {length!r}")
                await error.response()(scope, receive, send)
                return
            if declared > self.max_bytes:
                await self._too_large().response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class CrashGuardMiddleware:
    """An exception a route did not turn into an APIError: logged once, answered with a
    500 in the OpenAI shape if no response has begun, and not raised further (a dead
    handler must never look like a dead server)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError(500, f"internal error: {exc!r}", "internal_error")
                await error.response()(scope, receive, send)
