"""An endpoint's key, without a server: where it comes from (`?api_key=`, `--api-key`, DFLASH_API_KEY), that it
leaves the URL for the bearer header, what `--dry-run` shows of it (never the key), and the early-stop rule.
The key against real servers: test_gen_serve.py (a gateway) and test_gen_vllm.py (vLLM's --api-key)."""
from __future__ import annotations

import json

import pytest
from gen_helpers import write_profile, write_prompts

from dflash.generate.client import EndpointPool, api_key_fallback, parse_endpoint
from dflash.generate.workers import EARLY_STOP_AFTER, early_stop, early_stop_bound

KEY = "s3cret-Key-0042"


def test_the_urls_key_leaves_the_query_for_the_bearer_header():
    endpoint = parse_endpoint(f"http://10.0.0.5:30000/v1?tenant=a&api_key={KEY}&b=2")
    assert (endpoint.base_url, endpoint.query) == ("http://10.0.0.5:30000", "tenant=a&b=2")
    assert endpoint.headers == {"Authorization": f"Bearer {KEY}"} and endpoint.key_source == "?api_key="
    assert KEY not in endpoint.chat_url + endpoint.label + repr(endpoint)
    assert parse_endpoint("http://h:1/v1?api_key=a%2Bb%3D").api_key == "a+b="       # percent-encoded in the URL
    assert parse_endpoint("http://h:1/v1?api_key=").headers == {}                    # an empty one is none


def test_the_urls_key_wins_then_the_flag_then_the_environment():
    assert api_key_fallback("flag-key", {"DFLASH_API_KEY": "env-key"}) == ("flag-key", "--api-key")
    assert api_key_fallback(None, {"DFLASH_API_KEY": "env-key"}) == ("env-key", "DFLASH_API_KEY")
    assert api_key_fallback(None, {"DFLASH_API_KEY": ""}) == ("", "")
    pool = EndpointPool.from_urls([f"http://a:1/v1?api_key={KEY}", "http://b:1/v1"], ("env-key", "DFLASH_API_KEY"))
    assert [(e.api_key, e.key_source) for e in pool.endpoints] == [(KEY, "?api_key="), ("env-key", "DFLASH_API_KEY")]
    assert pool.api_keys() == [KEY, "env-key"]


def test_url_credentials_and_a_key_are_refused_together():
    """user:password@ (Basic) and a key (Bearer) would both be the one Authorization header: exit 2, masked."""
    from launcher_core.errors import ConfigError

    for url, fallback in ((f"http://u:pw-1234@h:1/v1?api_key={KEY}", ("", "")), ("http://u:pw-1234@h:1/v1", (KEY, "--api-key"))):
        with pytest.raises(ConfigError, match="one Authorization header") as refused:
            parse_endpoint(url, fallback)
        assert KEY not in str(refused.value) and "pw-1234" not in str(refused.value)
    assert parse_endpoint("http://u:pw-1234@h:1/v1").headers == {}          # alone, the URL's credentials stay


def test_dry_run_says_where_each_key_comes_from_and_never_shows_it(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", KEY)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 1)
    profile = write_profile(tmp_path / "p.toml", tmp_path / "model", tmp_path / "run", prompts)
    dry = cli("generate", "--profile", profile, "--dry-run", "--endpoint", "http://a:1/v1?api_key=url-key-1234",
              "--endpoint", "http://b:1/v1")
    assert dry.code == 0, dry.err
    plan = json.loads(dry.out)
    assert plan["authorization"] == ["Bearer <redacted> (key from ?api_key=)",
                                     "Bearer <redacted> (key from DFLASH_API_KEY)"]
    assert KEY not in dry.out and "url-key-1234" not in dry.out


def test_api_key_without_an_endpoint_is_refused(tmp_path, cli):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 1)
    profile = write_profile(tmp_path / "p.toml", tmp_path / "model", tmp_path / "run", prompts)
    result = cli("generate", "--profile", profile, "--skip-preflight", "--api-key", KEY)
    assert result.code == 2 and "error: an API key (--api-key) is for the server of an --endpoint;" in result.err
    assert KEY not in result.out + result.err and not (tmp_path / "run").exists()


def test_early_stop_needs_the_same_failure_every_time_and_prompts_left():
    bound = early_stop_bound(1)
    assert bound == 3 and early_stop_bound(2) == 6 and early_stop_bound(5) == EARLY_STOP_AFTER
    same = ["HTTP 404: not found"] * bound
    assert early_stop(same, bound, 10, "F") is not None
    assert early_stop(same[:-1], bound, 10, "F") is None                      # not yet
    assert early_stop(same[:-1] + [None], bound, 10, "F") is None             # a completion among them
    assert early_stop(same[:-1] + ["HTTP 500: x"], bound, 10, "F") is None    # another reason
    assert early_stop(same, bound, bound, "F") is None                        # nothing left to spare
