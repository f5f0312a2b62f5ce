"""Client throughput: our generation client against a trivial local responder.

The responder is a separate process on 127.0.0.1 (pinned to another core) that answers every
/v1/chat/completions with a fixed completion. The client side is the real thing: a full
`generate_from_profile` run with `--endpoint` (prompt loading, request building, the aiohttp
client, endpoint rotation, output records, the crash-safe store), pinned to one core. It prints
the requests/s it sustains at the profile's concurrency. Target: >= 2,000 requests/s.

    .venv/bin/python benchmarks/bench_client.py [--profile rtx6000-x8] [--requests 20000]
    .venv/bin/python benchmarks/bench_client.py --smoke      (cpu-demo, 200 requests)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from launcher_core.processes import free_port, stop_group  # noqa: E402

RESPONSE = json.dumps({
    "id": "bench", "object": "chat.completion", "model": "responder",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "Think."}}],
    "usage": {"prompt_tokens": 24, "completion_tokens": 8, "total_tokens": 32}}).encode()


def serve_responder(port: int) -> None:
    """The trivial responder: a minimal asyncio HTTP/1.1 keep-alive server."""
    import asyncio

    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(RESPONSE)).encode() + b"\r\n\r\n")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in header.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(head + RESPONSE if b"/health" not in header[:40] else
                             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_responder(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.05)
    stop_group(process)
    raise RuntimeError("responder did not start")


def pin(pid: int, core: int) -> int:
    cores = sorted(os.sched_getaffinity(0))
    chosen = cores[core % len(cores)]
    os.sched_setaffinity(pid, {chosen})
    return chosen


def run_client(profile_name: str, requests: int, url: str, workdir: Path, concurrency: int | None) -> tuple:
    from dflash.generate import generate_from_profile
    from launcher_core.profile import load_profile

    profile = load_profile(profile_name)
    if concurrency:
        profile = dataclasses.replace(profile, generate=dataclasses.replace(profile.generate, concurrency=concurrency))
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"b{i}", "prompt": f"Question {i}: what is {i} + {i}?"}) + "\n"
                               for i in range(requests)))
    summary = generate_from_profile(profile, input_path=prompts, output_path=workdir / "out.jsonl",
                                    run_dir=workdir / "run", endpoints=[url], progress=False)
    return profile, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="rtx6000-x8", help="whose generate.concurrency to use")
    parser.add_argument("--concurrency", type=int, default=None, help="override the profile's concurrency")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: cpu-demo, 200 requests")
    args = parser.parse_args()
    if args.smoke:
        args.profile, args.requests = "cpu-demo", 200
    if args.serve:
        serve_responder(args.serve)
        return 0
    port = free_port()
    responder = start_responder(port)
    try:
        responder_core, client_core = pin(responder.pid, 1), pin(0, 0)
        with tempfile.TemporaryDirectory() as workdir:
            profile, summary = run_client(args.profile, args.requests, f"http://127.0.0.1:{port}", Path(workdir),
                                          args.concurrency)
    finally:
        stop_group(responder)
    print(f"profile {profile.name}: concurrency {profile.generate.concurrency}, client pinned to core {client_core}, "
          f"responder on core {responder_core}")
    print(f"completed {summary.completed} requests in {summary.wall_s:.2f} s, failed {summary.failed}")
    print(f"client throughput: {summary.requests_per_s:.0f} requests/s (target >= 2000)")
    return 0 if summary.completed == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
