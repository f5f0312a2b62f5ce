"""Generation against a real `transformers serve` on 127.0.0.1 serving a tiny Qwen3.

Covers: a normal managed run; the client SIGKILLed and resumed; the server SIGKILLed and
restarted; faults (500s, truncated JSON, timeouts) retried or recorded; `--retry-failed`; several
endpoints sharing load with a dead one taken out of rotation; a key in an endpoint's query string
sent as a bearer header, a refused one exit 2 before any prompt; a run whose every request failed is
exit 5, and one whose first requests fail the same way stops early; malformed endpoints exit 2.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
from gen_helpers import REPO_ROOT, free_port, launcher_env, read_output_ids, run_launcher, write_profile, write_prompts

from dflash.generate import generate_from_profile
from dflash.generate.generation_run import NothingSent
from launcher_core.manifest import read_manifest
from launcher_core.profile import load_profile

pytestmark = pytest.mark.slow


def start_launcher(profile_path, *extra):
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), "generate", "--profile", str(profile_path),
            "--skip-preflight", "--no-progress", *extra]
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_lines(path, count, process, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if path.exists() and path.read_text().count("\n") >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} never reached {count} lines")


def server_children(pid):
    return [child for child in psutil.Process(pid).children(recursive=True)
            if "serve" in " ".join(child.cmdline())]


def port_open(port):
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_managed_server_run_writes_one_complete_record_per_prompt(tmp_path, tiny_qwen3_target):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 6)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts)
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), "generate", "--profile", str(profile_path), "--force"]
    process = subprocess.run(argv, cwd=REPO_ROOT, env=launcher_env(), capture_output=True, text=True, timeout=180)
    out, err = process.stdout, process.stderr
    assert process.returncode == 0, err
    assert "completed 6, failed 0" in out
    assert "preflight audit" in err  # the audit ran first and was recorded
    assert read_manifest(tmp_path / "run")["stages"]["audit"]["forced"] is True
    output = tmp_path / "run" / "completions.jsonl"
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ids
    for record in records:
        assert record["messages"][-1]["role"] == "assistant" and isinstance(record["messages"][-1]["content"], str)
        assert record["completion_tokens"] == 6 and record["finish_reason"] == "length"
        assert record["prompt_tokens"] > 5 and record["sampling"]["max_tokens"] == 6
        assert record["started_at"] <= record["finished_at"]
    assert "tools" in records[0] and "tools" not in records[1]
    stage = read_manifest(tmp_path / "run")["stages"]["generate"]
    assert stage["state"] == "done" and stage["completed"] == 6 and stage["output_tokens"] == 36
    assert "Uvicorn running" in (tmp_path / "run" / "generate" / "server.log").read_text()
    assert not port_open(load_profile(str(profile_path)).generate.port)  # the server was stopped
    assert "generate:" in err and "req/s" in err  # the progress bar

    from dflash.data import tokenize_completions

    dataset = tokenize_completions(load_profile(str(profile_path)), input_path=output, output_path=tmp_path / "ds",
                                   workers=1, allow_degenerate=True, progress=False)
    assert dataset.records == 6 and dataset.samples == 6 and dataset.rejected == 0
    assert dataset.loss_tokens >= 6 * 6  # every assistant token (and its end marker) is trained on


def test_client_sigkilled_mid_run_resumes_with_exactly_one_completion_per_id(tmp_path, tiny_qwen3_target):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 14)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts,
                                 max_tokens=10)
    output = tmp_path / "run" / "completions.jsonl"
    process = start_launcher(profile_path)
    wait_for_lines(output, 4, process)
    server = server_children(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait()
    psutil.wait_procs(server, timeout=30)  # the server goes with its launcher
    done_before = read_output_ids(output)
    assert 4 <= len(done_before) < 14
    process = start_launcher(profile_path)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    final = read_output_ids(output)
    assert Counter(final) == Counter(ids)  # no gaps, no duplicates
    assert final[: len(done_before)] == done_before
    assert f"{len(done_before)} already done" in out


def test_server_killed_mid_run_is_restarted_and_the_run_completes(tmp_path, tiny_qwen3_target):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 12)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts,
                                 max_tokens=10, max_server_restarts=2)
    output = tmp_path / "run" / "completions.jsonl"
    process = start_launcher(profile_path)
    wait_for_lines(output, 2, process)
    (server,) = server_children(process.pid)
    server.kill()
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    assert "restart 1/2" in err
    assert Counter(read_output_ids(output)) == Counter(ids)
    stage = read_manifest(tmp_path / "run")["stages"]["generate"]
    assert stage["server_restarts"] == 1 and stage["failed"] == 0
    assert (tmp_path / "run" / "generate" / "server.log").read_text().count("starting:") == 2


def test_faults_are_retried_or_recorded_and_retry_failed_runs_just_those(tmp_path, tiny_qwen3_target,
                                                                          served_tiny_model, fault_proxy_factory):
    proxy = fault_proxy_factory(served_tiny_model, slow_s=9.0)
    prompts = tmp_path / "prompts.jsonl"
    markers = {1: "[500]", 2: "[trunc]", 3: "[slow]", 4: "[poison]", 6: "[500]", 7: "[poison]"}
    ids = write_prompts(prompts, 10, markers)
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts,
                                             request_timeout_s=6.0, retries=2, concurrency=3)))
    summary = generate_from_profile(profile, endpoints=[proxy.url], progress=False)
    assert proxy.injected == {"500": 2 + 2 * 3, "trunc": 1, "slow": 1}
    assert (summary.completed, summary.failed) == (8, 2)
    assert summary.retried >= 4 + 2 * 2  # four one-off faults + two poisoned prompts retried twice each
    output = tmp_path / "run" / "completions.jsonl"
    assert sorted(read_output_ids(output)) == [i for i in ids if i not in ("q004", "q007")]
    failures = [json.loads(line) for line in (tmp_path / "run" / "generate" / "failures.jsonl").read_text().splitlines()]
    assert {f["id"] for f in failures} == {"q004", "q007"}
    assert all(f["reason"].startswith("HTTP 500") and f["attempts"] == 3 for f in failures)

    with pytest.raises(NothingSent) as nothing_sent:  # a plain rerun does not resend recorded failures: exit 5
        generate_from_profile(profile, endpoints=[proxy.url], progress=False)
    assert "--retry-failed" in str(nothing_sent.value) and "2 prompt(s) failed" in str(nothing_sent.value)
    retried = generate_from_profile(profile, endpoints=[served_tiny_model], retry_failed=True, progress=False)
    assert (retried.selected, retried.completed, retried.failed) == (2, 2, 0)
    assert Counter(read_output_ids(output)) == Counter(ids)
    assert (tmp_path / "run" / "generate" / "failures.jsonl").read_text() == ""


def test_endpoints_share_the_load_and_a_dead_one_leaves_rotation(tmp_path, tiny_qwen3_target,
                                                                 served_tiny_model, fault_proxy_factory):
    first, second = fault_proxy_factory(served_tiny_model), fault_proxy_factory(served_tiny_model)
    dead = f"http://127.0.0.1:{free_port()}"
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 12)
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts,
                                             concurrency=4, retries=0)))
    summary = generate_from_profile(profile, endpoints=[first.url, dead, second.url], progress=False)
    assert (summary.completed, summary.failed, summary.retried) == (12, 0, 0)
    assert first.forwarded >= 3 and second.forwarded >= 3 and first.forwarded + second.forwarded == 12
    assert Counter(read_output_ids(tmp_path / "run" / "completions.jsonl")) == Counter(ids)


def test_continuous_batching_server_serves_only_the_first_max_prompts(tmp_path, tiny_qwen3_target):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 5)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts,
                                 max_prompts=3, continuous_batching=True, concurrency=3)
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), "generate", "--profile", str(profile_path),
            "--skip-preflight", "--no-progress"]
    process = subprocess.run(argv, cwd=REPO_ROOT, env=launcher_env(), capture_output=True, text=True, timeout=420)   # CB server start on a loaded 2-core machine: ~130 s
    assert process.returncode == 0, process.stderr
    assert "completed 3, failed 0" in process.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ids[:3]
    assert all(r["completion_tokens"] == 6 for r in records)
    assert "--continuous-batching" in (tmp_path / "run" / "generate" / "server.log").read_text()


KEY = "k3yInTheUrl0123"


def test_a_key_in_the_endpoint_query_goes_as_a_bearer_header(tmp_path, tiny_qwen3_target, served_tiny_model,
                                                              fault_proxy_factory):
    """`--endpoint http://HOST:PORT/v1?api_key=KEY` against a gateway that reads `Authorization: Bearer KEY` (as
    vLLM's and SGLang's --api-key do) and answers 404 off its paths: the key leaves the URL for the header, the
    rest of the query stays on every request; the key is printed and written nowhere."""
    gateway = fault_proxy_factory(served_tiny_model, key=KEY)
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 4)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts, retries=0)
    done = run_launcher(profile_path, "--endpoint", f"{gateway.url}/v1?api_key={KEY}&tenant=a")
    assert done.returncode == 0, done.stderr
    assert "completed 4, failed 0" in done.stdout
    assert (gateway.forwarded, gateway.refused, gateway.keys_in_url) == (4, 0, 0)
    assert sorted(read_output_ids(tmp_path / "run" / "completions.jsonl")) == ids
    assert KEY not in done.stdout + done.stderr
    assert all(KEY not in path.read_text() for path in (tmp_path / "run").rglob("*") if path.is_file())


def test_a_refused_key_is_exit_2_before_any_prompt_is_sent(tmp_path, tiny_qwen3_target, served_tiny_model,
                                                          fault_proxy_factory):
    """A wrong key: the gateway answers 401 to the start-up probe of /v1/models. Exit 2 with one line naming the
    endpoint (the key masked) and where the key came from; no chat request reaches the gateway, no record is
    written; with the right key the same command completes them all."""
    gateway = fault_proxy_factory(served_tiny_model, key=KEY)
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 3)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts, retries=1)
    wrong = "wr0ngK3yValue99"
    failed = run_launcher(profile_path, "--endpoint", f"{gateway.url}/v1?api_key={wrong}")
    assert failed.returncode == 2, failed.stderr
    assert (f"error: --endpoint {gateway.url}: the server refused the API key from ?api_key= (HTTP 401 on "
            "/v1/models); no prompt was sent.") in failed.stderr
    assert "Traceback" not in failed.stderr and wrong not in failed.stdout + failed.stderr
    assert (gateway.chat_requests, gateway.refused) == (0, 1)
    output = tmp_path / "run" / "completions.jsonl"
    assert not output.exists() or output.read_text() == ""
    assert not (tmp_path / "run" / "generate" / "failures.jsonl").exists()
    assert read_manifest(tmp_path / "run")["stages"]["generate"]["state"] == "failed"
    again = run_launcher(profile_path, "--endpoint", f"{gateway.url}/v1?api_key={KEY}")
    assert again.returncode == 0, again.stderr
    assert sorted(read_output_ids(output)) == ids


def test_every_request_failing_is_exit_5_not_a_quiet_success(tmp_path, tiny_qwen3_target, served_tiny_model,
                                                            fault_proxy_factory):
    """A server that answers HTTP 500 to every prompt (3 of them: fewer than the early stop's bound): the run ends
    with exit 5 naming the first failure and the failures file, and the manifest says failed."""
    gateway = fault_proxy_factory(served_tiny_model)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3, markers={i: "[poison]" for i in range(3)})
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts, retries=1)
    failed = run_launcher(profile_path, "--endpoint", gateway.url)
    assert failed.returncode == 5, failed.stderr
    failures = tmp_path / "run" / "generate" / "failures.jsonl"
    assert (f"error: every request failed: 3 of 3 prompt(s) sent, no completion (the first failure: HTTP 500: "
            f"injected internal error); each prompt's reason is in {failures}") in failed.stderr
    assert "rerun with --retry-failed" in failed.stderr and "Traceback" not in failed.stderr
    stage = read_manifest(tmp_path / "run")["stages"]["generate"]
    assert stage["state"] == "failed" and stage["failed"] == 3 and "every request failed" in stage["error"]
    assert len(failures.read_text().splitlines()) == 3
    # a plain rerun sends nothing while those prompts failed: exit 5 naming them and --retry-failed, no request sent,
    # against the same server and a dead endpoint alike; --retry-failed sends them again
    sent = gateway.chat_requests
    for endpoint in (gateway.url, f"http://127.0.0.1:{free_port()}/v1"):
        rerun = run_launcher(profile_path, "--endpoint", endpoint)
        assert rerun.returncode == 5, rerun.stdout + rerun.stderr
        assert rerun.stderr.strip() == (f"error: nothing sent: 3 prompt(s) failed in an earlier run and are sent again "
                                        f"only with --retry-failed (0 done; each failure's reason is in {failures}). "
                                        f"Fix the server or --endpoint, then rerun with --retry-failed")
    assert gateway.chat_requests == sent and len(failures.read_text().splitlines()) == 3
    retried = run_launcher(profile_path, "--endpoint", gateway.url, "--retry-failed")
    assert retried.returncode == 5 and gateway.chat_requests > sent, retried.stderr


def test_the_first_requests_failing_the_same_way_stop_the_run(tmp_path, tiny_qwen3_target, served_tiny_model,
                                                             fault_proxy_factory):
    """20 prompts a server answers with the same HTTP 500: with one endpoint the run stops once the first 3 have
    failed for good (exit 5, naming the error); the other 17 are not recorded as failed, a rerun sends them.
    With two endpoints (two gateways to the server) it takes 6: one bad endpoint of several must not stop a run."""
    from dflash.generate.workers import early_stop_bound

    gateways = [fault_proxy_factory(served_tiny_model), fault_proxy_factory(served_tiny_model)]
    for endpoints in ([gateways[0].url], [gateway.url for gateway in gateways]):
        bound = early_stop_bound(len(endpoints))
        run_dir = tmp_path / f"run{len(endpoints)}"
        prompts = tmp_path / "prompts.jsonl"
        write_prompts(prompts, 20, markers={i: "[poison]" for i in range(20)})
        profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, run_dir, prompts, retries=0,
                                     concurrency=2)
        sent_before = sum(gateway.chat_requests for gateway in gateways)
        failed = run_launcher(profile_path, *[arg for url in endpoints for arg in ("--endpoint", url)])
        assert failed.returncode == 5, failed.stderr
        failures = run_dir / "generate" / "failures.jsonl"
        assert (f"error: stopped early: the first {bound} requests all failed the same way (HTTP 500: injected "
                f"internal error); the other {20 - bound} prompt(s) are left for a rerun, the failed ones are in "
                f"{failures}.") in failed.stderr
        assert len(failures.read_text().splitlines()) == bound == 3 * len(endpoints)
        sent = sum(gateway.chat_requests for gateway in gateways) - sent_before
        assert bound <= sent < bound + 2      # at most one more was in flight
        assert read_manifest(run_dir)["stages"]["generate"]["state"] == "failed"


@pytest.mark.parametrize("endpoint, shown", [
    ("{url}/v1#api_key={key}", "{url}/v1#<redacted>"),
    ("{url}/v1?api_key={key}#frag", "{url}/v1?api_key=<redacted>#<redacted>"),
    ("ftp://127.0.0.1:1/v1?api_key={key}", "ftp://127.0.0.1:1/v1?api_key=<redacted>"),
    ("http://127.0.0.1:port/v1?api_key={key}", "http://127.0.0.1:port/v1?api_key=<redacted>"),
])
def test_a_malformed_endpoint_is_exit_2_with_its_key_masked(tmp_path, tiny_qwen3_target, cli, endpoint, shown):
    """A fragment (never sent: it can carry no key), a scheme that is not http(s), a port that is not a
    number: exit 2 before anything is read or written, naming the endpoint with its secrets masked."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 2)
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", prompts)
    url = f"http://127.0.0.1:{free_port()}"
    result = cli("generate", "--profile", profile_path, "--skip-preflight", "--no-progress",
                 "--endpoint", endpoint.format(url=url, key=KEY))
    assert result.code == 2, result.err
    assert f"error: --endpoint {shown.format(url=url)}: " in result.err
    assert KEY not in result.out + result.err and not (tmp_path / "run").exists()
    dry = cli("generate", "--profile", profile_path, "--dry-run", "--endpoint", endpoint.format(url=url, key=KEY))
    assert dry.code == 2 and KEY not in dry.out + dry.err
