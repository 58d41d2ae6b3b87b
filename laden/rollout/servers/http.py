"""JSON over HTTP to a rollout server, from asyncio code, with the standard library only.

Each request is a blocking `urllib` call run on a thread pool of this client's own
(`max_concurrent_requests` threads), not on asyncio's default executor: a generation request
holds its thread until the completion is done, so the pool size is the number of requests in
flight per client, and sharing the default executor (5 + CPU count threads) would cap it
silently. The cost is a thread per request in flight (about 8 MiB of virtual stack each, little
resident memory); `aiohttp` would avoid that but is not a dependency of laden.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ServerRequestError(RuntimeError):
    """A server answered an HTTP request with an error status or unreadable JSON."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        """HTTP status code (None when the server could not be reached)."""
        self.body = body
        """The start of the response body, for diagnosis."""


def request_json(
    method: str,
    url: str,
    payload: Any = None,
    *,
    params: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Send one request (a JSON body when `payload` is not None) and decode the JSON answer.

    An empty or non-JSON 200 answer decodes to its text (some control endpoints answer plain
    text or nothing). Raise `ServerRequestError` naming the URL, the status and the body's start.
    """
    if params:
        url = url + "?" + urllib.parse.urlencode(_query_items(params), doseq=True)
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        body = err.read().decode("utf-8", errors="replace")[:2000]
        raise ServerRequestError(
            f"{method} {url} failed with HTTP {err.code}: {body}", status=err.code, body=body
        ) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        raise ServerRequestError(f"{method} {url} failed: {err}; is the server still running?") from None
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _query_items(params: Mapping[str, Any]) -> list[tuple[str, str]]:
    items = []
    for key, value in params.items():
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            items.append((key, ("true" if v else "false") if isinstance(v, bool) else str(v)))
    return items


class AsyncJSONClient:
    """`request_json` from asyncio code, on a thread pool of this client's own (see the module
    docstring); `close()` shuts the pool down."""

    def __init__(self, *, max_concurrent_requests: int = 256, timeout_s: float | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent_requests, thread_name_prefix="laden-http")
        self.timeout_s = timeout_s
        """Per-request timeout in seconds (None = wait as long as the server takes)."""

    async def request(
        self,
        method: str,
        url: str,
        payload: Any = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """`request_json(method, url, payload, params=...)` without blocking the event loop."""
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return await loop.run_in_executor(
            self._pool, lambda: request_json(method, url, payload, params=params, timeout_s=timeout)
        )

    async def post(self, url: str, payload: Any = None, **kwargs: Any) -> Any:
        """POST `payload` as JSON (an empty body when None)."""
        return await self.request("POST", url, payload, **kwargs)

    async def get(self, url: str, **kwargs: Any) -> Any:
        """GET `url`."""
        return await self.request("GET", url, **kwargs)

    def close(self) -> None:
        """Stop accepting requests; threads of requests in flight finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
