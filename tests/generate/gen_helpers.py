"""Fixtures for generation tests: free ports, a real `transformers serve`, a fault-injecting proxy.

The proxy is our own loopback aiohttp app in a background thread. It forwards to an upstream
server and, per prompt, injects the faults named by a marker in the prompt text:
`[500]` (one HTTP 500), `[trunc]` (one 200 with truncated JSON), `[slow]` (one response held past
the client's timeout), `[poison]` (HTTP 500 every time). It counts what it forwarded and the chat requests
it received. Started with a `key`, it is a gateway that reads one as vLLM's and SGLang's `--api-key` do:
every request without `Authorization: Bearer KEY` gets HTTP 401 (counted in `refused`); a request whose
URL still carries an `api_key` is counted in `keys_in_url`. Its router answers 404 to any other path,
as a real server does.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launcher_core.processes import free_port, stop_group

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
    from dflash.generate.servers import health_ok

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        if health_ok(url):
            return
        time.sleep(0.2)
    raise TimeoutError(url)


def write_prompts(path: Path, count: int, markers: dict[int, str] | None = None, tools_every: int = 5) -> list[str]:
    """`count` prompts (every `tools_every`-th with a tool); returns their ids in order."""
    tool = {"type": "function", "function": {"name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    ids, lines = [], []
    for index in range(count):
        prompt_id = f"q{index:03d}"
        text = f"Question {index}: what is {index} + {index * 3}? {(markers or {}).get(index, '')}".strip()
        record = {"id": prompt_id, "messages": [{"role": "user", "content": text}]}
        if tools_every and index % tools_every == 0:
            record["tools"] = [tool]
        ids.append(prompt_id)
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return ids


def write_profile(path: Path, model_dir: Path, run_dir: Path, prompts: Path, **generate) -> Path:
    settings = {"backend": "transformers", "port": free_port(), "concurrency": 2, "max_tokens": 6,
                "temperature": 0.0, "thinking": False, "request_timeout_s": 60.0, "retries": 2,
                "flush_every": 2, **generate}
    body = "\n".join(f"{key} = {json.dumps(value)}" for key, value in settings.items())
    path.write_text(f'[machine]\ndevice = "cpu"\n\n[model]\ntarget = {json.dumps(str(model_dir))}\n'
                    f'dtype = "float32"\n\n[paths]\nrun_dir = {json.dumps(str(run_dir))}\n'
                    f'prompts = {json.dumps(str(prompts))}\n\n[generate]\n{body}\n')
    return path


def read_output_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def launcher_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_launcher(profile_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launcher.py generate --profile P --skip-preflight --no-progress EXTRA...` to its end (`env` added)."""
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), "generate", "--profile", str(profile_path),
            "--skip-preflight", "--no-progress", *extra]
    return subprocess.run(argv, cwd=REPO_ROOT, env={**launcher_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def served_tiny_model(tiny_qwen3_target):
    """A real `transformers serve` on 127.0.0.1 serving the tiny Qwen3; yields its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(tiny_qwen3_target),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=launcher_env(), start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(process)


@dataclass
class FaultProxy:
    upstream: str
    slow_s: float = 5.0
    key: str | None = None
    forwarded: int = 0
    refused: int = 0
    chat_requests: int = 0
    keys_in_url: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    url: str = ""
    _seen: dict[str, int] = field(default_factory=dict)

    def fault_for(self, text: str) -> str | None:
        """The fault to inject for this prompt now: markers fire once, except [poison]."""
        if "[poison]" in text:
            return "500"
        for marker, fault in (("[500]", "500"), ("[trunc]", "trunc"), ("[slow]", "slow")):
            if marker in text:
                self._seen[text] = self._seen.get(text, 0) + 1
                return fault if self._seen[text] == 1 else None
        return None


@pytest.fixture
def fault_proxy_factory():
    """start(upstream) -> FaultProxy listening on a free loopback port; all stopped after the test."""
    started = []

    def start(upstream: str, slow_s: float = 5.0, key: str | None = None) -> FaultProxy:
        proxy = FaultProxy(upstream, slow_s, key)
        ready = threading.Event()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_serve_proxy, args=(proxy, loop, ready), daemon=True)
        thread.start()
        assert ready.wait(10)
        started.append((loop, thread))
        return proxy

    yield start
    for loop, thread in started:
        asyncio.run_coroutine_threadsafe(loop.proxy_cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def _serve_proxy(proxy: FaultProxy, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    import aiohttp
    from aiohttp import web

    asyncio.set_event_loop(loop)
    session: aiohttp.ClientSession | None = None

    def unauthorized(request: web.Request) -> web.Response | None:
        proxy.keys_in_url += "api_key" in request.query
        if proxy.key is None or request.headers.get("Authorization") == f"Bearer {proxy.key}":
            return None
        proxy.refused += 1
        return web.Response(status=401, text='{"error": "Unauthorized"}', content_type="application/json")

    async def forward(request: web.Request) -> web.Response:
        refusal = unauthorized(request)
        if refusal is not None:
            return refusal
        body = await request.read()
        async with session.request(request.method, proxy.upstream + request.path, data=body or None,
                                   headers={"Content-Type": "application/json"}) as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(),
                                content_type="application/json")

    async def chat(request: web.Request) -> web.Response:
        proxy.chat_requests += 1
        refusal = unauthorized(request)
        if refusal is not None:
            return refusal
        body = await request.read()
        text = json.loads(body)["messages"][-1]["content"]
        fault = proxy.fault_for(text)
        if fault:
            proxy.injected[fault] = proxy.injected.get(fault, 0) + 1
        if fault == "500":
            return web.Response(status=500, text="injected internal error")
        if fault == "slow":
            await asyncio.sleep(proxy.slow_s)
        response = await forward(request)
        proxy.forwarded += response.status == 200
        if fault == "trunc":
            return web.Response(status=200, body=response.body[: len(response.body) // 2],
                                content_type="application/json")
        return response

    async def setup() -> None:
        nonlocal session
        session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", forward)
        app.router.add_get("/v1/models", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        proxy.url = f"http://127.0.0.1:{port}"

        async def cleanup() -> None:
            await runner.cleanup()
            await session.close()

        loop.proxy_cleanup = cleanup

    loop.run_until_complete(setup())
    ready.set()
    loop.run_forever()
