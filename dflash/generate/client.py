"""Async OpenAI-compatible chat client with endpoint rotation.

One `aiohttp` session drives any number of servers (`/v1/chat/completions`): SGLang, `transformers
serve`, or anything compatible. `EndpointPool` rotates requests over the healthy endpoints; an
endpoint that refuses connections, drops them, or fails several requests in a row is taken out of
rotation and probed on `/health` until it answers again. Every failure is a `RequestFailure` that
says whether a retry makes sense and whether the endpoint (not the request) is to blame.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from launcher_core.errors import ConfigError, RunFailed

if TYPE_CHECKING:
    import aiohttp

FAILURES_BEFORE_DOWN = 3
PROBE_INTERVAL_S = 1.0


@dataclass
class Endpoint:
    """One server: its base URL (without /v1) and its health as this client sees it."""

    base_url: str
    healthy: bool = True
    consecutive_failures: int = 0
    requests: int = 0

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"


class RequestFailure(Exception):
    """A request that did not produce a usable completion."""

    def __init__(self, reason: str, retryable: bool = True, endpoint_down: bool = False, status: int = 0):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retryable = retryable
        self.endpoint_down = endpoint_down


def normalize_endpoint(url: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/chat/completions` -> the base URL."""
    base = url.strip().rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        base = base.removesuffix(suffix)
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"endpoint {url!r} must be an http(s) URL such as http://127.0.0.1:30000")
    return base


@dataclass
class EndpointPool:
    """Round-robin over healthy endpoints; unhealthy ones are probed and put back when they answer."""

    endpoints: list[Endpoint]
    failures_before_down: int = FAILURES_BEFORE_DOWN
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @classmethod
    def from_urls(cls, urls: Sequence[str]) -> "EndpointPool":
        unique = list(dict.fromkeys(normalize_endpoint(url) for url in urls))
        if not unique:
            raise ConfigError("no endpoint to send requests to; pass --endpoint URL")
        return cls([Endpoint(url) for url in unique])

    def healthy(self) -> list[Endpoint]:
        return [endpoint for endpoint in self.endpoints if endpoint.healthy]

    def pick(self) -> Endpoint | None:
        candidates = self.healthy()
        if not candidates:
            return None
        return candidates[next(self._turn) % len(candidates)]

    async def acquire(self, unavailable_timeout_s: float | None) -> Endpoint:
        """A healthy endpoint, waiting for one to come back; RunFailed after the timeout (None: forever)."""
        endpoint = self.pick()
        started = time.monotonic()
        while endpoint is None:
            if unavailable_timeout_s is not None and time.monotonic() - started > unavailable_timeout_s:
                urls = ", ".join(e.base_url for e in self.endpoints)
                raise RunFailed(f"no endpoint answered for {unavailable_timeout_s:.0f} s ({urls}); "
                                "everything completed so far is saved, rerun to continue")
            await asyncio.sleep(0.05)
            endpoint = self.pick()
        return endpoint

    def report_success(self, endpoint: Endpoint) -> None:
        endpoint.consecutive_failures = 0
        endpoint.requests += 1

    def report_failure(self, endpoint: Endpoint, failure: RequestFailure) -> None:
        endpoint.consecutive_failures += 1
        if failure.endpoint_down or endpoint.consecutive_failures >= self.failures_before_down:
            endpoint.healthy = False

    def mark(self, healthy: bool) -> None:
        """Mark every endpoint (the managed server died, or came back)."""
        for endpoint in self.endpoints:
            endpoint.healthy = healthy
            endpoint.consecutive_failures = 0

    async def probe_forever(self, session: aiohttp.ClientSession, interval_s: float = PROBE_INTERVAL_S) -> None:
        """Background task: put an unhealthy endpoint back once its /health answers 200."""
        while True:
            await asyncio.sleep(interval_s)
            for endpoint in self.endpoints:
                if not endpoint.healthy and await probe_health(session, endpoint.base_url):
                    endpoint.consecutive_failures = 0
                    endpoint.healthy = True


async def probe_health(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 2.0) -> bool:
    import aiohttp

    try:
        async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model id from /v1/models (None when the server does not say)."""
    import aiohttp

    try:
        async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
            document = await response.json(content_type=None)
        return str(document["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def new_session(concurrency: int) -> aiohttp.ClientSession:
    """One aiohttp session with keep-alive connections enough for `concurrency` requests in flight."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) + 8, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))


async def post_chat(session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes, timeout_s: float) -> dict[str, Any]:
    """POST one chat completion; the parsed response or a RequestFailure saying what went wrong."""
    import aiohttp

    try:
        async with session.post(endpoint.chat_url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            payload = await response.read()
            status = response.status
    except asyncio.TimeoutError:
        raise RequestFailure(f"timeout after {timeout_s:g} s") from None
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as error:
        raise RequestFailure(f"connection failed: {type(error).__name__}", endpoint_down=True) from None
    except (aiohttp.ClientError, OSError) as error:
        raise RequestFailure(f"transport error: {type(error).__name__}: {error}") from None
    return parse_chat_response(status, payload)


def parse_chat_response(status: int, payload: bytes) -> dict[str, Any]:
    """Check status and shape; 5xx/429/garbage are retryable, other 4xx are not. The document is the
    server's JSON, checked only for `choices[0].message` (an object)."""
    if status != 200:
        excerpt = payload[:300].decode("utf-8", "replace").replace("\n", " ")
        retryable = status >= 500 or status in (408, 429)
        raise RequestFailure(f"HTTP {status}: {excerpt}", retryable=retryable, status=status)
    try:
        document = json.loads(payload)
        message = document["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestFailure(f"malformed response ({len(payload)} bytes): not a chat completion") from None
    if not isinstance(message, dict):
        raise RequestFailure("malformed response: choices[0].message is not an object")
    return document
