"""Async OpenAI-compatible chat client with endpoint rotation.

One `aiohttp` session drives any number of servers (`/v1/chat/completions`): SGLang, `transformers
serve`, or anything compatible. `EndpointPool` rotates requests over the healthy endpoints; an
endpoint that refuses connections, drops them, or fails several requests in a row is taken out of
rotation and probed on `/health` until it answers again. Every failure is a `RequestFailure` that
says whether a retry makes sense and whether the endpoint (not the request) is to blame.

An endpoint URL is parsed (`parse_endpoint`): its path up to `/v1` is the server's base, and its
query string goes with every request it is sent, `/health` and `/v1/models` included; a fragment
(`#...`), which no request carries, is refused. Its `api_key` (`?api_key=KEY`), else `--api-key`, else
the environment's DFLASH_API_KEY (`api_key_fallback`) is the key: taken out of the URL and sent as
`Authorization: Bearer KEY`, the header vLLM's and SGLang's `--api-key` read. `check_endpoints`, the
start-up probe of `/v1/models`, ends the run with ConfigError (exit 2) when a server refuses the key
(HTTP 401 or 403), before any prompt is sent.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import unquote_plus, urlsplit, urlunsplit

from launcher_core.errors import ConfigError, RunFailed
from launcher_core.redact import REDACTED, redact_url

if TYPE_CHECKING:
    import aiohttp

FAILURES_BEFORE_DOWN = 3
PROBE_INTERVAL_S = 1.0
API_KEY_PARAM = "api_key"             # the endpoint URL's query key that holds the key
API_KEY_ENV = "DFLASH_API_KEY"        # the key of every --endpoint whose URL has none, when --api-key is not given
AUTH_REFUSED = (401, 403)


@dataclass
class Endpoint:
    """One server: its base URL (without /v1 and without a query), the query string every request
    to it carries (without the key), its key (sent as `Authorization: Bearer`; `key_source` says
    where it came from, for messages: never the key) and its health as this client sees it."""

    base_url: str
    query: str = ""
    api_key: str = field(default="", repr=False)
    key_source: str = ""
    healthy: bool = True
    consecutive_failures: int = 0
    requests: int = 0

    def url(self, path: str) -> str:
        """The URL of `path` (e.g. "/health") on this server, with the endpoint's query string."""
        return f"{self.base_url}{path}" + (f"?{self.query}" if self.query else "")

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request to this server carries: its key as a bearer token, if it has one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

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


def parse_endpoint(url: str, fallback_key: tuple[str, str] = ("", "")) -> Endpoint:
    """`http://host:port`, `.../v1` or `.../v1/chat/completions`, each with an optional query string
    -> the Endpoint (base URL + query). Its key: the query's `api_key` (taken out of the query), else
    `fallback_key` (key, where it came from). ConfigError naming the endpoint, its secrets masked, when
    it is not an http(s) URL with a host, or has a fragment."""
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
    query, key = split_api_key(parts.query)
    key, source = (key, f"?{API_KEY_PARAM}=") if key else fallback_key
    if key and (parts.username or parts.password):
        raise ConfigError(f"--endpoint {_shown(text)}: it holds user:password@ (sent as 'Authorization: Basic') and "
                          f"has an API key from {source} (sent as 'Authorization: Bearer'); a request carries one "
                          "Authorization header: give the endpoint one of the two")
    return Endpoint(urlunsplit((parts.scheme, parts.netloc, path, "", "")), query, key, source if key else "")


def split_api_key(query: str) -> tuple[str, str]:
    """A query string -> (the query without its `api_key` pairs, the key: the last non-empty one)."""
    kept, key = [], ""
    for pair in query.split("&") if query else []:
        name, _, value = pair.partition("=")
        if unquote_plus(name) != API_KEY_PARAM:
            kept.append(pair)
        elif value:
            key = unquote_plus(value)
    return "&".join(kept), key


def api_key_fallback(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """The key of the endpoints whose URL has none, and where it came from: `--api-key`, else DFLASH_API_KEY."""
    if flag:
        return flag, "--api-key"
    key = environ.get(API_KEY_ENV, "")
    return (key, API_KEY_ENV) if key else ("", "")


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
    def from_urls(cls, urls: Sequence[str], fallback_key: tuple[str, str] = ("", "")) -> "EndpointPool":
        parsed = {(e.base_url, e.query, e.api_key): e for e in (parse_endpoint(url, fallback_key) for url in urls)}
        if not parsed:
            raise ConfigError("no endpoint to send requests to; pass --endpoint URL")
        return cls(list(parsed.values()))

    def api_keys(self) -> list[str]:
        """The endpoints' keys: masked in whatever this run writes (a server may echo one)."""
        return [endpoint.api_key for endpoint in self.endpoints if endpoint.api_key]

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
        async with session.get(endpoint.url("/health"), headers=endpoint.headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def check_endpoints(session: aiohttp.ClientSession, endpoints: Sequence[Endpoint]) -> str | None:
    """The start-up probe: each endpoint's /v1/models. ConfigError (exit 2) naming the endpoint when one
    refuses its key (HTTP 401/403); else the first model id a server names (None when none says)."""
    names = [await fetch_model_name(session, endpoint) for endpoint in endpoints]
    return next((name for name in names if name is not None), None)


async def fetch_model_name(session: aiohttp.ClientSession, endpoint: Endpoint) -> str | None:
    """The first model id from /v1/models (None when the server does not say); ConfigError on HTTP 401/403."""
    import aiohttp

    try:
        async with session.get(endpoint.url("/v1/models"), headers=endpoint.headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status in AUTH_REFUSED:
                raise ConfigError(refused_key_message(endpoint, response.status))
            document = await response.json(content_type=None)
        return str(document["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def refused_key_message(endpoint: Endpoint, status: int) -> str:
    """Why a server refused us at the start-up probe, naming the endpoint and where its key came from (never a
    flag followed by a word: the messages' masking would take the word for the flag's value)."""
    what = f"refused the API key from {endpoint.key_source}" if endpoint.api_key else "wants an API key and none was given"
    return (f"--endpoint {endpoint.label}: the server {what} (HTTP {status} on /v1/models); no prompt was sent. The key "
            f"goes in the URL (?{API_KEY_PARAM}=KEY), in {API_KEY_ENV} or as the value of --api-key; it is sent as "
            f"'Authorization: Bearer KEY', the header vLLM's and SGLang's servers check (their --api-key)")


def new_session(concurrency: int) -> aiohttp.ClientSession:
    """One aiohttp session with keep-alive connections enough for `concurrency` requests in flight."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) + 8, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))


async def post_chat(session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes, timeout_s: float) -> dict[str, Any]:
    """POST one chat completion; the parsed response or a RequestFailure saying what went wrong."""
    import aiohttp

    try:
        async with session.post(endpoint.chat_url, data=body, headers={"Content-Type": "application/json",
                                                                        **endpoint.headers},
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
