"""The generation run: prompts in, one completion per prompt id out, surviving crashes and kills.

`generate_from_profile` resolves paths, opens the crash-safe store, starts the profile's server
(or uses `--endpoint`s), and drives `concurrency` async workers through the OpenAI-compatible
client. Transient errors and timeouts are retried with exponential backoff; what still fails is
recorded in `generate/failures.jsonl`. A server that dies is restarted (bounded) and the run goes
on. The manifest's "generate" stage is updated as it goes.
"""
from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dflash.generate.client import EndpointPool, RequestFailure, fetch_model_name, new_session, post_chat
from dflash.generate.prompts import PromptRecord, load_prompts
from dflash.generate.records import SamplingParams, build_request_body, completion_record, rejected_optional_field
from dflash.generate.servers import ServerSupervisor
from dflash.generate.store import CompletionStore, check_output
from launcher_core.errors import ConfigError, RunFailed
from launcher_core.manifest import StageState, update_stage
from launcher_core.schema import Profile

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
MAX_ENDPOINT_REQUEUES = 50        # connection failures one request may ride out (not counted as attempts)
MANIFEST_EVERY_S = 5.0
SERVER_CHECK_EVERY_S = 0.5


@dataclass
class GenerateSummary:
    """Figures of one `generate` invocation (`retried` counts re-sent requests)."""

    total: int = 0
    already_done: int = 0
    selected: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    server_restarts: int = 0
    output_path: str = ""
    failures_path: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def failure_rate(self) -> float:
        attempted = self.completed + self.failed
        return self.failed / attempted if attempted else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2),
                "requests_per_s": round(self.requests_per_s, 2), "failure_rate": round(self.failure_rate, 6)}

    def lines(self) -> list[str]:
        return [f"completed {self.completed}, failed {self.failed} (failure rate {self.failure_rate:.3%}), "
                f"retried {self.retried} request(s), {self.already_done} already done before this run",
                f"prompt tokens {self.prompt_tokens}, output tokens {self.output_tokens}, "
                f"{self.tokens_per_s:.1f} output tokens/s, {self.requests_per_s:.2f} requests/s over {self.wall_s:.1f} s",
                f"output: {self.output_path}" + (f"; failures: {self.failures_path}" if self.failed else "")]


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    prompts: Path
    output: Path

    @property
    def state_dir(self) -> Path:
        return self.run_dir / "generate"


def resolve_paths(profile: Profile, input_path: str | Path | None, output_path: str | Path | None,
                  run_dir: str | Path | None) -> RunPaths:
    """Profile path templates expanded against `run_dir` (the profile's unless overridden)."""
    from launcher_core.profile import expand_path

    base = Path(run_dir) if run_dir is not None else expand_path(profile, profile.paths.run_dir)

    def expand(template: str) -> Path:
        path = Path(template.format(profile=profile.name, run_dir=base)).expanduser()
        return path if path.is_absolute() else expand_path(profile, str(path))

    prompts = Path(input_path) if input_path else expand(profile.paths.prompts)
    output = Path(output_path) if output_path else expand(profile.paths.completions)
    return RunPaths(base, prompts, output)


def select_prompts(prompts: list[PromptRecord], store: CompletionStore, retry_failed: bool,
                   limit: int | None) -> list[PromptRecord]:
    """The prompts this run sends: the first `limit` of the file, minus done (and minus failed unless retrying)."""
    considered = prompts[:limit] if limit is not None else prompts
    if retry_failed:
        return [p for p in considered if p.id in store.failures and p.id not in store.done_ids]
    return [p for p in considered if p.id not in store.done_ids and p.id not in store.failures]


@dataclass
class GenerationRun:
    """The async part: workers pull prompts, send them with retries, and hand results to the store."""

    store: CompletionStore
    pool: EndpointPool
    sampling: SamplingParams
    backend: str
    timeout_s: float
    retries: int
    concurrency: int
    model_label: str
    run_dir: Path
    supervisor: ServerSupervisor | None = None
    progress: bool = True
    summary: GenerateSummary = field(default_factory=GenerateSummary)
    _model: str | None = None
    _fatal: BaseException | None = None
    _bar: tqdm | None = None
    _workers: list[asyncio.Task[None]] = field(default_factory=list)
    _omit: frozenset[str] = frozenset()
    _sampling_cache: tuple[frozenset[str], dict[str, object]] | None = None

    async def run(self, prompts: list[PromptRecord]) -> None:
        queue: asyncio.Queue[PromptRecord] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        async with new_session(self.concurrency) as session:
            self._model = await fetch_model_name(session, self.pool.endpoints[0].base_url)
            helpers = [asyncio.create_task(self.pool.probe_forever(session)),
                       asyncio.create_task(self._report_forever(len(prompts)))]
            if self.supervisor is not None:
                helpers.append(asyncio.create_task(self._watch_server(self.supervisor)))
            try:
                with self._progress_bar(len(prompts)):
                    count = min(self.concurrency, len(prompts))
                    self._workers = [asyncio.create_task(self._worker(session, queue)) for _ in range(count)]
                    results = await asyncio.gather(*self._workers, return_exceptions=True)
                    _raise_unexpected(results)
            finally:
                for task in helpers:
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal

    def _progress_bar(self, total: int) -> tqdm:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", desc="generate", disable=not self.progress,
                         mininterval=0.5, smoothing=0.1, dynamic_ncols=True)
        return self._bar

    async def _worker(self, session: aiohttp.ClientSession, queue: asyncio.Queue[PromptRecord]) -> None:
        while self._fatal is None:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await self._complete(session, prompt)
            except RunFailed as error:
                self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Stop the run: workers are cancelled (an unfinished request is simply pending next time)."""
        self._fatal = self._fatal or error
        current = asyncio.current_task()
        for task in self._workers:
            if task is not current:
                task.cancel()

    async def _complete(self, session: aiohttp.ClientSession, prompt: PromptRecord) -> None:
        """Send one prompt until it succeeds, fails for good, or the run is failing."""
        attempts = requeues = 0
        while self._fatal is None:
            omitted = self._omit
            body = build_request_body(prompt, self.sampling, self.backend, self._model, omitted)
            endpoint = await self.pool.acquire(None if self.supervisor else max(self.timeout_s, 60.0))
            started = time.time()
            try:
                response = await post_chat(session, endpoint, body, self.timeout_s)
            except RequestFailure as failure:
                if self._drop_rejected_field(failure, omitted):
                    continue
                self.pool.report_failure(endpoint, failure)
                if failure.endpoint_down and requeues < MAX_ENDPOINT_REQUEUES:
                    requeues += 1
                    continue
                attempts += 1
                if not failure.retryable or attempts > self.retries:
                    self._record_failure(prompt, failure.reason, attempts)
                    return
                self.summary.retried += 1
                await asyncio.sleep(backoff_s(attempts))
                continue
            self.pool.report_success(endpoint)
            self._record(prompt, response, started)
            return

    def _drop_rejected_field(self, failure: RequestFailure, omitted: frozenset[str]) -> bool:
        """A 4xx naming an optional field this request sent (e.g. top_k): stop sending it, resend uncounted."""
        field_name = rejected_optional_field(failure.reason, omitted) if 400 <= failure.status < 500 else None
        if field_name is None:
            return False
        if field_name not in self._omit:
            self._omit = self._omit | {field_name}
            print(f"warning: the server rejects {field_name!r}; sending requests without it", file=sys.stderr)
        return True

    def _record(self, prompt: PromptRecord, response: dict[str, Any], started: float) -> None:
        """`response`: the server's parsed JSON (`client.parse_chat_response`)."""
        record = completion_record(prompt, response, self._recorded_sampling(), started, time.time(),
                                   self.model_label)
        self.store.add(record)
        self.summary.completed += 1
        self.summary.prompt_tokens += record["prompt_tokens"]
        self.summary.output_tokens += record["completion_tokens"]
        self._advance()

    def _recorded_sampling(self) -> dict[str, object]:
        """The sampling dict of each output line, rebuilt only when the omitted fields change."""
        if self._sampling_cache is None or self._sampling_cache[0] != self._omit:
            self._sampling_cache = (self._omit, self.sampling.recorded(self.backend, self._omit))
        return self._sampling_cache[1]

    def _record_failure(self, prompt: PromptRecord, reason: str, attempts: int) -> None:
        self.store.add_failure(prompt.id, reason, attempts)
        self.summary.failed += 1
        self._advance()

    def _advance(self) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.update(1)
            if self._bar.n % 16 == 0:
                elapsed = max(self._bar.format_dict.get("elapsed", 0.0), 1e-9)
                self._bar.set_postfix(tok_s=f"{self.summary.output_tokens / elapsed:.0f}",
                                      failed=self.summary.failed, refresh=False)

    async def _report_forever(self, total: int) -> None:
        while True:
            await asyncio.sleep(MANIFEST_EVERY_S)
            self.store.flush()
            await asyncio.to_thread(update_stage, self.run_dir, "generate", "running", selected=total,
                                    completed=self.summary.completed, failed=self.summary.failed)

    async def _watch_server(self, supervisor: ServerSupervisor) -> None:
        """Restart the managed server when it dies; a restart budget used up fails the run."""
        while True:
            await asyncio.sleep(SERVER_CHECK_EVERY_S)
            if supervisor.alive():
                continue
            self.pool.mark(healthy=False)
            try:
                await asyncio.to_thread(supervisor.restart)
            except RunFailed as error:
                self._fail(error)
                return
            self.summary.server_restarts = supervisor.restarts
            self.pool.mark(healthy=True)


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter: ~0.5 s, 1 s, 2 s ... capped at 30 s."""
    return min(BACKOFF_BASE_S * 2 ** (attempt - 1), BACKOFF_MAX_S) * random.uniform(0.75, 1.25)


def _raise_unexpected(results: Sequence[object]) -> None:
    """A worker that died of anything but cancellation is a bug: surface it."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result


def generate_from_profile(profile: Profile, *, input_path: str | Path | None = None,
                          output_path: str | Path | None = None, endpoints: Sequence[str] = (),
                          retry_failed: bool = False, force: bool = False, run_dir: str | Path | None = None,
                          limit: int | None = None, preflight: bool = False,
                          progress: bool = True) -> GenerateSummary:
    """Generate completions for the profile's prompts; resumable, one completion per prompt id.

    `endpoints` use already-running servers instead of starting the profile's backend.
    `retry_failed` sends only the prompts in the failures file. `preflight` runs the preflight
    audit first (`force` runs anyway on a FAIL). Updates the manifest's "generate" stage.
    """
    paths = resolve_paths(profile, input_path, output_path, run_dir)
    check_output(paths.output, paths.prompts, paths.run_dir)
    if limit is None and profile.generate.max_prompts > 0:
        limit = profile.generate.max_prompts
    if preflight:
        run_preflight_if_available(profile, force=force, run_dir=paths.run_dir)
    prompts = load_prompts(paths.prompts)
    store = CompletionStore(paths.output, paths.state_dir, flush_every=profile.generate.flush_every)
    recovery = store.open()
    if recovery.torn_bytes_dropped:
        print(f"note: dropped a torn last line ({recovery.torn_bytes_dropped} bytes) from {paths.output}", file=sys.stderr)
    selected = select_prompts(prompts, store, retry_failed, limit)
    summary = GenerateSummary(total=len(prompts[:limit] if limit is not None else prompts),
                              already_done=len(store.done_ids), selected=len(selected),
                              output_path=str(paths.output), failures_path=str(store.failures_path))
    update_stage(paths.run_dir, "generate", "running", selected=len(selected), output=str(paths.output))
    try:
        if selected:
            _drive(profile, paths, store, selected, summary, endpoints, progress)
    except BaseException as error:
        store.close()
        _finish_manifest(paths.run_dir, summary, store, "failed", error)
        raise
    store.close()
    _finish_manifest(paths.run_dir, summary, store, "done", None)
    return summary


def _drive(profile: Profile, paths: RunPaths, store: CompletionStore, selected: list[PromptRecord],
           summary: GenerateSummary, endpoints: Sequence[str], progress: bool) -> None:
    """Start the server (unless endpoints are given), run the async workers, stop the server."""
    settings = profile.generate
    supervisor, urls, backend, model_label = _backend(profile, paths, endpoints)
    started = time.monotonic()
    try:
        if supervisor is not None:
            supervisor.start()
            started = time.monotonic()  # rates are about generating, not loading the model
        engine = GenerationRun(store=store, pool=EndpointPool.from_urls(urls), run_dir=paths.run_dir,
                               sampling=SamplingParams.from_section(settings), backend=backend,
                               timeout_s=settings.request_timeout_s, retries=settings.retries,
                               concurrency=settings.concurrency, model_label=model_label,
                               supervisor=supervisor, progress=progress, summary=summary)
        with _sigterm_as_interrupt():
            asyncio.run(engine.run(selected))
    finally:
        summary.wall_s = time.monotonic() - started
        if supervisor is not None:
            summary.server_restarts = supervisor.restarts
            supervisor.stop()


def _backend(profile: Profile, paths: RunPaths,
             endpoints: Sequence[str]) -> tuple[ServerSupervisor | None, list[str], str, str]:
    """(supervisor or None, endpoint URLs, backend name for request shaping, model label)."""
    settings = profile.generate
    if endpoints:
        return None, list(endpoints), "endpoint", profile.model.target
    if settings.backend == "endpoint":
        raise ConfigError("generate.backend is 'endpoint': pass one or more --endpoint URL "
                          "(an OpenAI-compatible server such as http://127.0.0.1:30000)")
    from dflash.generate.servers import server_command_for
    from dflash.models import resolve_model_path

    model_path = resolve_model_path(profile.model.target)
    command = server_command_for(profile, model_path)
    supervisor = ServerSupervisor(command, paths.state_dir / "server.log",
                                  startup_timeout_s=settings.server_startup_timeout_s,
                                  max_restarts=settings.max_server_restarts)
    return supervisor, [command.base_url], settings.backend, profile.model.target


class _sigterm_as_interrupt:
    """While generating, SIGTERM behaves like Ctrl-C: flush what is done and stop the server cleanly."""

    def __enter__(self) -> None:
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt


def _finish_manifest(run_dir: Path, summary: GenerateSummary, store: CompletionStore, state: StageState,
                     error: BaseException | None) -> None:
    figures = summary.as_dict()
    figures.update(done_total=len(store.done_ids), failures_outstanding=len(store.failures))
    if error is not None:
        figures["error"] = str(error) or type(error).__name__
    update_stage(run_dir, "generate", state, **figures)


def run_preflight_if_available(profile: Profile, *, force: bool, run_dir: Path) -> None:
    """The preflight audit (raises PreflightFailed on a FAIL unless `force`)."""
    from envcheck.preflight import run_preflight

    run_preflight(profile, force=force, run_dir=run_dir)
