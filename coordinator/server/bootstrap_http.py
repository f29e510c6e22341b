"""A small HTTP/1.1 server on the event loop, for the KV bootstrap registry's few routes.

Only what vLLM's connector sends is understood: a request line, headers, and a
body of ``Content-Length`` bytes (no chunked bodies); connections are kept
alive between requests. Everything a peer controls is bounded: the header
block's size, the body's size, how long a request may take to arrive and how
long an idle connection stays open, and how many connections are served at
once (beyond that a connection is closed on accept). A request outside the
bounds gets a 4xx with a JSON detail and changes nothing; the connection is
closed after it when what follows it cannot be found.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

log = logging.getLogger("coordinator.bootstrap")

MAX_HEADER_BYTES = 8192
MAX_BODY_BYTES = 16384
"""A registration is about 200 bytes."""
MAX_CONNECTIONS = 256
REQUEST_TIMEOUT_S = 15.0
"""From the end of one request (or the connection's opening) to the end of the next."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: object
    """Encoded as JSON."""


Handler = Callable[[Request], Awaitable[Response]]


class RequestError(Exception):
    """The request cannot be read; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def encode_response(response: Response, *, keep_alive: bool) -> bytes:
    body = json.dumps(response.body, separators=(",", ":")).encode()
    reason = HTTPStatus(response.status).phrase
    head = (f"HTTP/1.1 {response.status} {reason}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            f"connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode("ascii") + body


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None = None
                       ) -> tuple[Request, bool] | None:
    """One request and whether the connection may stay open; None at a clean EOF.

    ``writer`` answers ``Expect: 100-continue`` (curl asks it before larger bodies)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise RequestError(400, "the connection closed in the middle of a request") from None
    except asyncio.LimitOverrunError:
        raise RequestError(431, f"the request line and headers exceed {MAX_HEADER_BYTES} "
                           "bytes") from None
    if len(head) > MAX_HEADER_BYTES:
        raise RequestError(431, f"the request line and headers exceed {MAX_HEADER_BYTES} "
                           "bytes")
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise RequestError(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise RequestError(505, f"{version[:16]!r} is not HTTP/1.x")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise RequestError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise RequestError(411, "chunked bodies are not taken; send a Content-Length")
    length_text = headers.get("content-length", "0")
    if not length_text.isdigit() or len(length_text) > 12:
        raise RequestError(400, "bad Content-Length")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise RequestError(413, f"the body has {length} bytes, the bound is {MAX_BODY_BYTES}")
    if length and writer is not None and headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    try:
        body = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise RequestError(400, "the connection closed in the middle of a body") from None
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return Request(method, target.split("?", 1)[0], body), keep_alive


class HttpServer:
    """Serves ``handler`` on an already bound listening socket; see the module docstring."""

    def __init__(self, sock: socket.socket, handler: Handler,
                 on_refused: Callable[[str], None]) -> None:
        self._sock = sock
        self._handler = handler
        self._on_refused = on_refused
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock,
                                                  limit=MAX_HEADER_BYTES)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._connections) >= MAX_CONNECTIONS or task is None:
            self._on_refused("too_many_connections")
            writer.close()
            return
        self._connections.add(task)
        try:
            await self._requests(reader, writer)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _requests(self, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                # Idle or slow, a connection gets this long per request, then is closed.
                parsed = await asyncio.wait_for(read_request(reader, writer), REQUEST_TIMEOUT_S)
            except RequestError as exc:
                self._on_refused(f"http_{exc.status}")
                writer.write(encode_response(Response(exc.status, {"detail": exc.detail}),
                                             keep_alive=False))
                await writer.drain()
                return
            if parsed is None:
                return
            request, keep_alive = parsed
            response = await self._handler(request)
            writer.write(encode_response(response, keep_alive=keep_alive))
            await writer.drain()
            if not keep_alive:
                return
