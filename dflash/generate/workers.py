"""The async part of a generation run: workers pull prompts, send them with retries and backoff
through the endpoint pool, hand results to the store, report to the manifest, and restart a managed
server that dies. A run whose first requests all failed for good with the same reason stops there
(RunFailed, exit 5): the rest would fail the same way. How many (`early_stop_bound`): as many as take
every endpoint out of rotation (FAILURES_BEFORE_DOWN each), at most EARLY_STOP_AFTER; a run with one
endpoint stops after 3, before it would wait for an endpoint that answers every request with an error.
`dflash.generate.generation_run` sets it up and drives it."""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from dflash.generate.client import FAILURES_BEFORE_DOWN, EndpointPool, RequestFailure, check_endpoints, new_session, post_chat
from dflash.generate.completions import SamplingParams, build_request_body, completion_record, rejected_optional_field
from dflash.generate.prompt_files import PromptRecord
from dflash.generate.servers import ServerSupervisor
from dflash.generate.store import CompletionStore
from launcher_core.errors import RunFailed
from launcher_core.manifest import update_stage
from launcher_core.redact import redact_text

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
MAX_ENDPOINT_REQUEUES = 50        # connection failures one request may ride out (not counted as attempts)
MANIFEST_EVERY_S = 5.0
SERVER_CHECK_EVERY_S = 0.5
EARLY_STOP_AFTER = 8              # at most this many first requests, all failed for the same reason, stop the run


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
    first_failure: str = ""         # the reason of this run's first prompt that failed for good

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
    _first_outcomes: list[str | None] = field(default_factory=list)   # None: a completion; else the failure
    _queued: int = 0

    async def run(self, prompts: list[PromptRecord]) -> None:
        queue: asyncio.Queue[PromptRecord] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        self._queued = len(prompts)
        async with new_session(self.concurrency) as session:
            self._model = await check_endpoints(session, self.pool.endpoints)   # a refused key ends it here
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
        self._note_outcome(None)
        self._advance()

    def _recorded_sampling(self) -> dict[str, object]:
        """The sampling dict of each output line, rebuilt only when the omitted fields change."""
        if self._sampling_cache is None or self._sampling_cache[0] != self._omit:
            self._sampling_cache = (self._omit, self.sampling.recorded(self.backend, self._omit))
        return self._sampling_cache[1]

    def _record_failure(self, prompt: PromptRecord, reason: str, attempts: int) -> None:
        reason = redact_text(reason, self.pool.api_keys())       # a server may echo the key
        self.store.add_failure(prompt.id, reason, attempts)
        self.summary.failed += 1
        self.summary.first_failure = self.summary.first_failure or reason
        self._note_outcome(reason)
        self._advance()

    def _note_outcome(self, failure: str | None) -> None:
        """Keep the first outcomes; when `early_stop_bound` of them are the same failure and prompts are left,
        stop the run (`early_stop`)."""
        bound = early_stop_bound(len(self.pool.endpoints), self.pool.failures_before_down)
        if len(self._first_outcomes) >= bound:
            return
        self._first_outcomes.append(failure)
        error = early_stop(self._first_outcomes, bound, self._queued, self.summary.failures_path)
        if error is not None:
            self._fail(error)

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


def early_stop_bound(endpoints: int, failures_before_down: int = FAILURES_BEFORE_DOWN) -> int:
    """How many first outcomes, all one failure, stop a run: as many as take every endpoint out of rotation,
    at most EARLY_STOP_AFTER."""
    return min(EARLY_STOP_AFTER, failures_before_down * endpoints)


def early_stop(outcomes: Sequence[str | None], bound: int, queued: int, failures_path: str) -> RunFailed | None:
    """The error that stops a run whose first `bound` outcomes (of `queued` prompts) are one and the same
    failure; None otherwise (a completion among them, different reasons, or no prompt left)."""
    reasons = set(outcomes)
    if len(outcomes) < bound or queued <= len(outcomes) or len(reasons) != 1 or None in reasons:
        return None
    return RunFailed(f"stopped early: the first {len(outcomes)} requests all failed the same way ({outcomes[0]}); "
                     f"the other {queued - len(outcomes)} prompt(s) are left for a rerun, the failed ones are in "
                     f"{failures_path}. Check the server or --endpoint (its address, path and key), "
                     f"then rerun with --retry-failed")


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter: ~0.5 s, 1 s, 2 s ... capped at 30 s."""
    return min(BACKOFF_BASE_S * 2 ** (attempt - 1), BACKOFF_MAX_S) * random.uniform(0.75, 1.25)


def _raise_unexpected(results: Sequence[object]) -> None:
    """A worker that died of anything but cancellation is a bug: surface it."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
