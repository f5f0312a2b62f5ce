"""Async OpenAI-compatible chat client with endpoint rotation.

One `aiohttp` session drives any number of servers (`/v1/chat/completions`): SGLang, `transformers
serve`, or anything compatible. `EndpointPool` rotates requests over the healthy endpoints; an
endpoint that refuses connections, drops them, or fails several requests in a row is taken out of
rotation and probed on `/health` until it answers again. Every failure is a `RequestFailure` that
says whether a retry makes sense and whether the endpoint (not the request) is to blame.

An endpoint URL is parsed (`parse_endpoint`): its path up to `/v1` is the server's base, and its
query string (e.g. `?api_key=KEY` for a gateway that reads one) goes with every request it is sent,
`/health` and `/v1/models` included; a fragment (`#...`), which no request carries, is refused.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import urlsplit, urlunsplit

from launcher_core.errors import ConfigError, RunFailed
from launcher_core.redact import REDACTED, redact_url

if TYPE_CHECKING:
    import aiohttp

FAILURES_BEFORE_DOWN = 3
PROBE_INTERVAL_S = 1.0


@dataclass
class Endpoint:
    """One server: its base URL (without /v1 and without a query), the query string every request
    to it carries, and its health as this client sees it."""

    base_url: str
    query: str = ""
    healthy: bool = True
    consecutive_failures: int = 0
    requests: int = 0

    def url(self, path: str) -> str:
        """The URL of `path` (e.g. "/health") on this server, with the endpoint's query string."""
        return f"{self.base_url}{path}" + (f"?{self.query}" if self.query else "")

    @property
    def chat_url(self) -> str:
        return self.url("/v1/chat/completions")

    @property
    def label(self) -> str:
        """The endpoint as messages show it: credentials and secret query values masked."""
        return redact_url(self.url(""))


class RequestFailure(Exception):
    """A request that did not produce a usable completion."""

    def __init__(self, reason: str, retryable: bool = True, endpoint_down: bool = False, status: int = 0):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retryable = retryable
        self.endpoint_down = endpoint_down


def parse_endpoint(url: str) -> Endpoint:
    """`http://host:port`, `.../v1` or `.../v1/chat/completions`, each with an optional query string
    (`?api_key=KEY`) -> the Endpoint (base URL + query). ConfigError naming the endpoint, its secrets
    masked, when it is not an http(s) URL with a host, or has a fragment."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        parts.port                                  # a port that is not a number raises here
    except ValueError as error:
        raise ConfigError(f"--endpoint {_shown(text)}: not a valid URL ({error}); give an http(s) URL such as "
                          "http://127.0.0.1:30000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--endpoint {_shown(text)}: must be an http(s) URL with a host, such as "
                          "http://127.0.0.1:30000 (optionally ending in /v1, and with a query string)")
    if parts.fragment or text.endswith("#"):
        raise ConfigError(f"--endpoint {_shown(text)}: a URL fragment (#...) is never sent to a server, so it can "
                          "carry neither a key nor a setting; remove it. A key the server reads from the URL goes in "
                          "its query string (after the ?), which is sent with every request")
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        path = path.removesuffix(suffix)
    return Endpoint(urlunsplit((parts.scheme, parts.netloc, path, "", "")), parts.query)


def _shown(url: str) -> str:
    """An endpoint as an error shows it: credentials and secret query values masked, a fragment hidden."""
    head, mark, _fragment = url.partition("#")
    return redact_url(head) + (f"#{REDACTED}" if mark else "")


@dataclass
class EndpointPool:
    """Round-robin over healthy endpoints; unhealthy ones are probed and put back when they answer."""

    endpoints: list[Endpoint]
    failures_before_down: int = FAILURES_BEFORE_DOWN
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @classmethod
    def from_urls(cls, urls: Sequence[str]) -> "EndpointPool":
        parsed = [parse_endpoint(url) for url in urls]
        unique = list(dict.fromkeys((endpoint.base_url, endpoint.query) for endpoint in parsed))
        if not unique:
            raise ConfigError("no endpoint to send requests to; pass --endpoint URL")
        return cls([Endpoint(base, query) for base, query in unique])

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
                urls = ", ".join(e.label for e in self.endpoints)
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
                if not endpoint.healthy and await probe_health(session, endpoint):
                    endpoint.consecutive_failures = 0
                    endpoint.healthy = True


async def probe_health(session: aiohttp.ClientSession, endpoint: Endpoint, timeout_s: float = 2.0) -> bool:
    import aiohttp

    try:
        async with session.get(endpoint.url("/health"), timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def fetch_model_name(session: aiohttp.ClientSession, endpoint: Endpoint) -> str | None:
    """The first model id from /v1/models (None when the server does not say)."""
    import aiohttp

    try:
        async with session.get(endpoint.url("/v1/models"), timeout=aiohttp.ClientTimeout(total=10)) as response:
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
