"""A minimal HTTP/1.1 JSON server on asyncio streams, for the OpenAI-compatible endpoint.

Standard library only (laden has no aiohttp): `asyncio.start_server` on the loopback interface, one
coroutine per connection, keep-alive (the `openai` client's httpx pool reuses connections), bodies
by `Content-Length` (no chunked uploads: JSON clients send a length). Handlers run on the caller's
event loop, beside the rollout engine and the agents, so a handler only awaits. What it costs: no
TLS, no HTTP/2, no streaming responses; none is needed on loopback for non-streaming completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request body read (a long conversation with tools is far below it)."""
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error"}  # fmt: skip


@dataclass(slots=True)
class Request:
    """One HTTP request: its method, path (without the query), lower-cased headers and body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""

    def json(self) -> Any:
        """The body decoded as JSON; `HTTPError(400)` when it is not."""
        try:
            return json.loads(self.body or b"null")
        except ValueError as err:
            raise HTTPError(400, f"the request body is not JSON: {err}") from None


@dataclass(slots=True)
class Response:
    """A JSON answer."""

    status: int
    payload: Any


class HTTPError(Exception):
    """Raised by a handler: answered as `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def response(self) -> Response:
        return Response(self.status, {"error": {"message": str(self), "type": self.kind, "param": None,
                                                "code": self.status}})  # fmt: skip


Handler = Callable[[Request], Awaitable[Response]]


class JSONServer:
    """Serves `handler` on `host`:`port` (0 = a free port, read back from `port` after `start`)."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen (on the running loop); `port` is then the bound port."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every open connection; idempotent."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                response = await self._answer(request)
                keep = request.headers.get("connection", "").lower() != "close"
                writer.write(_encode(response, keep_alive=keep))
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # `close()` ends the connection (a cancelled handler task would be logged by asyncio's streams)
        except HTTPError as err:  # an unreadable request: answer once and close
            with contextlib.suppress(ConnectionError):
                writer.write(_encode(err.response(), keep_alive=False))
                await writer.drain()
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, request: Request) -> Response:
        try:
            return await self._handler(request)
        except HTTPError as err:
            return err.response()
        except Exception as err:  # noqa: BLE001 - the client gets the error; the server goes on
            log.exception("the OpenAI endpoint failed on %s %s", request.method, request.path)
            return HTTPError(500, f"{type(err).__name__}: {err}", kind="server_error").response()


async def _readline(reader: asyncio.StreamReader) -> bytes:
    """One line of the request head; `HTTPError(400)` for a line over the stream's limit (64 KiB)."""
    try:
        return await reader.readline()
    except ValueError:  # asyncio's limit overrun: the line is not read whole
        raise HTTPError(400, "a request line or header is over 64 KiB; send a shorter one") from None


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on a connection, or None at its end."""
    line = await _readline(reader)
    if not line.strip():
        return None
    try:
        method, target, _ = line.decode("latin-1").split(" ", 2)
    except ValueError:
        raise HTTPError(400, f"malformed request line {line[:100]!r}") from None
    headers: dict[str, str] = {}
    while True:
        raw = await _readline(reader)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HTTPError(400, "chunked request bodies are not supported; send a Content-Length")
    raw_length = headers.get("content-length") or "0"
    length = int(raw_length) if raw_length.isascii() and raw_length.isdigit() else -1
    if length < 0:
        raise HTTPError(
            400, f"Content-Length {raw_length[:40]!r} is not a byte count; send the body's length in bytes"
        )
    if length > MAX_BODY_BYTES:
        raise HTTPError(413, f"a request body of {length} bytes is over the {MAX_BODY_BYTES} byte limit")
    body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), target.split("?", 1)[0], headers, body)


def _encode(response: Response, *, keep_alive: bool) -> bytes:
    body = json.dumps(response.payload, ensure_ascii=False).encode()
    head = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}"]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
