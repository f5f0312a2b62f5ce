"""What `generate --dry-run` prints: paths, the server command (secrets redacted), one request body."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from launcher_core.redact import REDACTED, redact_argv, redact_env, redact_url
from launcher_core.schema import Profile


def generation_plan(profile: Profile, input_path: str | None, output_path: str | None,
                    endpoints: Sequence[str], run_dir: str | None, api_key: str | None = None) -> dict[str, object]:
    """The resolved plan of a generate run; starts nothing and loads no model. `api_key`: `--api-key`."""
    from dflash.generate.completions import SamplingParams, build_request_body
    from dflash.generate.generation_run import resolve_paths
    from dflash.generate.prompt_files import load_prompts

    paths = resolve_paths(profile, input_path, output_path, run_dir)
    backend = "endpoint" if endpoints else profile.generate.backend
    plan: dict[str, object] = {"backend": backend, "prompts": str(paths.prompts), "output": str(paths.output),
                            "state_dir": str(paths.state_dir), "concurrency": profile.generate.concurrency}
    if endpoints:
        plan["endpoints"] = [redact_url(url) for url in endpoints]
        plan["authorization"] = _authorization(endpoints, api_key)
    elif backend != "endpoint":
        plan["server"] = _server_plan(profile, paths.state_dir / "server.log")
    first = load_prompts(paths.prompts)[0]
    sampling = SamplingParams.from_section(profile.generate)
    plan["first_request"] = json.loads(build_request_body(first, sampling, backend, None))
    return plan


def _authorization(endpoints: Sequence[str], api_key: str | None) -> list[str]:
    """Per endpoint, the header its key goes in and where the key comes from; never the key."""
    import os

    from dflash.generate.client import api_key_fallback, parse_endpoint

    fallback = api_key_fallback(api_key, os.environ)
    parsed = [parse_endpoint(url, fallback) for url in endpoints]      # refused here as the run would refuse it
    return [f"Bearer {REDACTED} (key from {e.key_source})" if e.api_key else "none" for e in parsed]


def _server_plan(profile: Profile, log_path: Path) -> dict[str, object]:
    from dflash.generate.servers import server_command_for

    target = profile.model.target
    model_path = Path(target) if not target.startswith("builtin:") else Path(f"<{target}>")
    command = server_command_for(profile, model_path)
    return {"argv": redact_argv(command.argv), "env": redact_env(command.env), "base_url": command.base_url,
            "log": str(log_path)}
