"""The generation run: prompts in, one completion per prompt id out, surviving crashes and kills.

`generate_from_profile` resolves paths, opens the crash-safe store, starts the profile's server
(or uses `--endpoint`s), and drives `concurrency` async workers through the OpenAI-compatible
client. Transient errors and timeouts are retried with exponential backoff; what still fails is
recorded in `generate/failures.jsonl`. A server that dies is restarted (bounded) and the run goes
on (`dflash.generate.workers`). A run whose every request failed is RunFailed (exit 5): nothing
was generated, and a script must not carry on as if it had been; so is one whose first requests all
failed the same way (it stops there), and a rerun that has nothing left to send while prompts of an
earlier run failed (they are sent only with `--retry-failed`). A key the server refuses at the start-up
probe is ConfigError (exit 2) before any prompt is sent. The manifest's "generate" stage is updated as it
goes.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash.generate.client import EndpointPool, api_key_fallback, parse_endpoint
from dflash.generate.completions import SamplingParams
from dflash.generate.prompt_files import PromptRecord, load_prompts
from dflash.generate.servers import ServerSupervisor
from dflash.generate.store import CompletionStore, check_output
from dflash.generate.workers import GenerateSummary, GenerationRun
from launcher_core.diskfull import disk_full_guard
from launcher_core.errors import ConfigError, RunFailed
from launcher_core.manifest import StageState, update_stage
from launcher_core.schema import Profile


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


def generate_from_profile(profile: Profile, *, input_path: str | Path | None = None,
                          output_path: str | Path | None = None, endpoints: Sequence[str] = (),
                          retry_failed: bool = False, force: bool = False, run_dir: str | Path | None = None,
                          limit: int | None = None, preflight: bool = False,
                          progress: bool = True, api_key: str | None = None) -> GenerateSummary:
    """Generate completions for the profile's prompts; resumable, one completion per prompt id.

    `endpoints` use already-running servers instead of starting the profile's backend; `api_key` is
    the key of those whose URL has no `?api_key=` (None: DFLASH_API_KEY, if set), sent as a bearer token.
    `retry_failed` sends only the prompts in the failures file. `preflight` runs the preflight
    audit first (`force` runs anyway on a FAIL). Updates the manifest's "generate" stage. RunFailed
    when prompts were sent and every one of them failed (`all_failed`); NothingSent (exit 5) when none is left to
    send and prompts of an earlier run failed (without `retry_failed`).
    """
    if api_key and not endpoints:
        raise ConfigError("an API key (--api-key) is for the server of an --endpoint; the profile's own server "
                          "takes none: pass --endpoint URL too, or drop the flag")
    fallback_key = api_key_fallback(api_key, os.environ)
    for url in endpoints:
        parse_endpoint(url)                         # a malformed endpoint is refused before anything is touched
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
    if not selected and not retry_failed:
        failed_before = select_prompts(prompts, store, True, limit)
        if failed_before:
            store.close()
            raise NothingSent(len(failed_before), len(store.done_ids), store.failures_path)
    summary = GenerateSummary(total=len(prompts[:limit] if limit is not None else prompts),
                              already_done=len(store.done_ids), selected=len(selected),
                              output_path=str(paths.output), failures_path=str(store.failures_path))
    update_stage(paths.run_dir, "generate", "running", selected=len(selected), output=str(paths.output))
    average = store.average_record_bytes
    with disk_full_guard(paths.output, lambda: (average() or 0) * len(selected) or None, f"{len(selected)} completions"):
        try:
            if selected:
                _drive(profile, paths, store, selected, summary, endpoints, progress, fallback_key)
        except BaseException as error:
            _close_after_failure(store)
            _finish_manifest(paths.run_dir, summary, store, "failed", error)
            raise
        store.close()
    failed = all_failed(summary)
    _finish_manifest(paths.run_dir, summary, store, "done" if failed is None else "failed", failed)
    if failed is not None:
        raise failed
    return summary


def all_failed(summary: GenerateSummary) -> RunFailed | None:
    """The error of a run that sent prompts and got no completion back: each failed after its retries
    (a wrong endpoint path or key, a server that rejects every request)."""
    if summary.completed or not summary.failed:
        return None
    return RunFailed(f"every request failed: {summary.failed} of {summary.selected} prompt(s) sent, no completion "
                     f"(the first failure: {summary.first_failure}); each prompt's reason is in "
                     f"{summary.failures_path}. Check the server or --endpoint (its address, path and key), then "
                     f"rerun with --retry-failed")


class NothingSent(RunFailed):
    """A rerun with no prompt left to send while earlier runs' failures are outstanding: not a success (they are
    sent again only with --retry-failed), and nothing was sent, so no endpoint was tried."""

    def __init__(self, failed_before: int, done: int, failures_path: Path):
        super().__init__(f"nothing sent: {failed_before} prompt(s) failed in an earlier run and are sent again only "
                         f"with --retry-failed ({done} done; each failure's reason is in {failures_path}). Fix the "
                         f"server or --endpoint, then rerun with --retry-failed")
        self.failed_before, self.done = failed_before, done


def _close_after_failure(store: CompletionStore) -> None:
    """Flush what can be flushed; on a full disk the queued lines stay unwritten (the store's index
    never names them, so a resume sends those prompts again) and the first error is the one raised."""
    from launcher_core.diskfull import disk_full_of

    try:
        store.close()
    except Exception as error:
        if disk_full_of(error, store.output_path) is None:
            raise


def _drive(profile: Profile, paths: RunPaths, store: CompletionStore, selected: list[PromptRecord],
           summary: GenerateSummary, endpoints: Sequence[str], progress: bool,
           fallback_key: tuple[str, str]) -> None:
    """Start the server (unless endpoints are given), run the async workers, stop the server.
    `fallback_key`: the key (and its source) of the endpoints whose URL carries none."""
    settings = profile.generate
    supervisor, urls, backend, model_label = _backend(profile, paths, endpoints)
    started = time.monotonic()
    try:
        if supervisor is not None:
            supervisor.start()
            started = time.monotonic()  # rates are about generating, not loading the model
        pool = EndpointPool.from_urls(urls, fallback_key if endpoints else ("", ""))
        engine = GenerationRun(store=store, pool=pool, run_dir=paths.run_dir,
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
    from dflash.target_model import resolve_model_path

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
