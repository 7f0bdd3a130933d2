"""The live page's routes: the page and its assets (package data, no CDN), a server-sent
event stream of the engine's LiveFeed, and a key form for browsers when the server has
an API key. Translation only: what the page shows is folded by kvloop.engine.live.

    GET  /                  the page (kvloop/server/static/index.html)
    GET  /live/static/NAME  its script and style sheet
    GET  /live/events       text/event-stream: one "info" event, then JSON updates
    GET  /live/login        the key form (open: it holds nothing)
    POST /live/login        key=KEY: sets the page's cookie, back to /

Rate: each stream polls the feed every `interval` seconds (0.1 s: at most 10 updates a
second) and sends only when something changed; the engine never waits on a stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from kvloop.engine.live import LiveFeed

COOKIE = "kvloop_live"
UPDATE_INTERVAL_S = 0.1
HEARTBEAT_S = 15.0  # a comment line now and then, so proxies keep an idle stream open
_ASSETS = {"live.js": "text/javascript", "live.css": "text/css"}


def page_token(api_key: str) -> str:
    """The cookie's value: derived from the key, so the cookie never holds the key."""
    return hmac.new(api_key.encode(), b"kvloop live page", hashlib.sha256).hexdigest()


def is_page_path(path: str) -> bool:
    """Paths the API key guards for the page (a browser's cookie is accepted on them)."""
    return path == "/" or (path.startswith("/live/") and path != "/live/login")


def _asset(name: str) -> str:
    return (resources.files("kvloop.server") / "static" / name).read_text(encoding="utf-8")


def add_live_routes(app: FastAPI, feed: LiveFeed, info: dict[str, Any],
                    draining: Any, api_key: str | None,
                    interval: float = UPDATE_INTERVAL_S) -> None:
    """Add the page's routes to `app`. `info`: sent first on each stream (model, pool
    size, whether a key is needed); `draining()`: true once shutdown began, which ends
    every stream so the server's drain never waits on a browser."""

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return HTMLResponse(_asset("index.html"))

    @app.get("/live/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _ASSETS:  # a fixed list: no path from the URL reaches the disk
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(_asset(name), media_type=_ASSETS[name])

    @app.get("/live/events", include_in_schema=False)
    async def events() -> Response:
        return StreamingResponse(
            stream_updates(feed, info, draining, interval), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/live/login", include_in_schema=False)
    async def login_form() -> Response:
        return HTMLResponse(_asset("login.html"))

    @app.post("/live/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        key = (form.get("key") or [""])[0]
        if api_key is None:
            return RedirectResponse("/", status_code=303)
        if not hmac.compare_digest(key.encode(), api_key.encode()):
            return HTMLResponse(_asset("login.html").replace(
                "<!--error-->", "<p class=error>That key is not this server's.</p>"),
                status_code=401)
        resp = RedirectResponse("/", status_code=303)
        # HttpOnly: scripts never read it; SameSite=Strict: no other site's page sends it.
        resp.set_cookie(COOKIE, page_token(api_key), httponly=True, samesite="strict")
        return resp


async def stream_updates(feed: LiveFeed, info: dict[str, Any], draining: Any,
                         interval: float = UPDATE_INTERVAL_S) -> AsyncIterator[str]:
    """The event stream: `info`, then the feed's snapshot whenever its version moved,
    polled every `interval` s. A slow client only delays this generator (its send
    awaits); the feed keeps no queue for it."""
    yield _event(info, "info")
    cursor, version = -1, -1
    quiet = 0.0
    while not draining():
        started = time.monotonic()
        if feed.version != version:
            # A fresh block map, taken at the engine's next step (a running engine steps
            # well within the interval; an idle one has its map already).
            serial = feed.want_map()
            while feed.map_serial == serial and time.monotonic() - started < interval:
                await asyncio.sleep(interval / 20)
            snap = feed.snapshot(cursor)
            version = snap["version"]
            if snap["steps"]:
                cursor = snap["steps"][-1]["i"]
            yield _event(snap)
            quiet = 0.0
        elif (quiet := quiet + interval) >= HEARTBEAT_S:
            yield ": idle\n\n"
            quiet = 0.0
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    yield _event({"reason": "the server is shutting down"}, "end")


def _event(data: dict[str, Any], name: str | None = None) -> str:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"
