"""Secrets in URLs and argv (issue row "generate --endpoint 'http://user:TOKEN@host/v1?api_key=KEY'"):
a real generate run against a real `transformers serve`, with credentials and query keys planted in
its endpoints and a token in its environment, then a crash of the same command line: no planted
secret appears in what it printed or in any file the run or the crash handler wrote."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher_core.redact import REDACTED, redact_argv, redact_text, redact_url

TOKEN, KEY, PASSWORD, ENV_TOKEN = "tok3nS3cr3tAAA", "k3yS3cr3tBBB", "pa55w0rdCCC", "hf_envS3cr3tDDD"
PLANTED = (TOKEN, KEY, PASSWORD, ENV_TOKEN)


def files_holding(root: Path, secrets: tuple[str, ...]) -> dict[str, list[str]]:
    """Every file under `root` that holds one of `secrets` (bytes, so binary files are read too)."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        hits = [s for s in secrets if s.encode() in data]
        if hits:
            found[str(path)] = hits
    return found


@pytest.mark.parametrize("url, shown", [
    ("http://user:TOKEN@host/v1?api_key=KEY", f"http://{REDACTED}@host/v1?api_key={REDACTED}"),
    ("https://TOKEN@host:8443/v1/chat/completions?model=m&token=KEY&x=1",
     f"https://{REDACTED}@host:8443/v1/chat/completions?model=m&token={REDACTED}&x=1"),
    ("http://host/v1?access_token=KEY&signature=S&max_tokens=5", f"http://host/v1?access_token={REDACTED}&signature={REDACTED}&max_tokens=5"),
    ("http://host/v1#access_token=KEY&state=s", f"http://host/v1#access_token={REDACTED}&state=s"),   # a fragment too
    ("http://host/v1?api_key=", "http://host/v1?api_key="),                  # an empty value holds no secret
    ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000/v1"),              # the control: nothing to mask
])
def test_urls_lose_their_credentials_and_secret_query_keys(url, shown):
    assert redact_url(url) == shown
    assert redact_text(f"no endpoint answered ({url}); retry") == f"no endpoint answered ({shown}); retry"


def test_argv_loses_secret_flags_assignments_and_url_credentials():
    argv = ["generate", "--endpoint", "http://u:TOKEN@h/v1?key=KEY", "--api-key", "S1", "--hf-token=S2",
            "HF_TOKEN=S3", "--max-tokens", "5", "--tokenizer", "tok", "--profile", "p"]
    assert redact_argv(argv) == ["generate", "--endpoint", f"http://{REDACTED}@h/v1?key={REDACTED}", "--api-key",
                                 REDACTED, f"--hf-token={REDACTED}", f"HF_TOKEN={REDACTED}", "--max-tokens", "5",
                                 "--tokenizer", "tok", "--profile", "p"]


def test_a_generate_run_and_its_crash_write_no_planted_secret(tmp_path, served_tiny_model, tiny_qwen3_target, cli,
                                                              monkeypatch, private_cache):
    from tests.generate.gen_helpers import launcher_env, write_prompts
    from tests.generate.gen_helpers import write_profile as write_generate_profile
    from tests.safety.runs import REPO

    write_prompts(tmp_path / "prompts.jsonl", 4)
    run_dir = tmp_path / "run"
    profile = write_generate_profile(tmp_path / "p.toml", tiny_qwen3_target, run_dir, tmp_path / "prompts.jsonl",
                                     request_timeout_s=5.0, retries=0)
    host = served_tiny_model.removeprefix("http://")
    endpoints = [f"http://user:{TOKEN}@{host}/v1", f"http://admin:{PASSWORD}@{host}", f"http://{host}/v1?api_key={KEY}"]
    argv = ["generate", "--profile", str(profile), "--run-dir", str(run_dir), "--skip-preflight", "--no-progress",
            *(item for url in endpoints for item in ("--endpoint", url))]
    env = {**launcher_env(), "DFLASH_CACHE": str(private_cache), "HF_TOKEN": ENV_TOKEN}
    dry = subprocess.run([sys.executable, str(REPO / "launcher.py"), *argv, "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=300)
    ran = subprocess.run([sys.executable, str(REPO / "launcher.py"), *argv], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=600)
    assert dry.returncode == 0 and REDACTED in dry.stdout, dry.stderr
    assert (run_dir / "manifest.json").exists() and (run_dir / "completions.jsonl").exists(), ran.stderr
    printed = dry.stdout + dry.stderr + ran.stdout + ran.stderr
    assert [s for s in PLANTED if s in printed] == []
    import dflash.commands.generate as command

    def crash(args):                  # an unexpected error whose message holds the endpoint and a flag
        raise RuntimeError(f"lost {args.endpoint[0]} while sending --api-key {KEY} (HF_TOKEN {ENV_TOKEN})")

    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    monkeypatch.setattr(command, "run", crash)
    crashed = cli(*argv)
    assert crashed.code == 70 and [s for s in PLANTED if s in crashed.out + crashed.err] == []
    reports = list((private_cache / "crashes").glob("generate-*.txt"))
    assert len(reports) == 1 and "in crash" in reports[0].read_text() and REDACTED in reports[0].read_text()
    assert files_holding(run_dir, PLANTED) == {} and files_holding(private_cache, PLANTED) == {}
    assert files_holding(tmp_path, PLANTED) == {}            # the control: planting works, the grep finds them
    (tmp_path / "planted.txt").write_text("\n".join(endpoints))
    assert files_holding(tmp_path, PLANTED) == {str(tmp_path / "planted.txt"): [TOKEN, KEY, PASSWORD]}
