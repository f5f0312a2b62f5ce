"""The CUDA caching allocator's configuration the training ranks get: expandable segments on by default
(profile `memory.expandable_segments`), the user's own allocator variables respected.

Variable-length batches fragment the caching allocator's fixed-size segments (SpecForge's "58.3 GiB
reserved, 34 MiB free"); expandable segments map one growing segment per stream instead, so the
reserve stays close to what tensors hold (docs/plan.md, "The allocator's reserve").

Which variable torch reads (read in c10 at the pinned versions): torch 2.9 reads `PYTORCH_ALLOC_CONF`
first and falls back to `PYTORCH_CUDA_ALLOC_CONF` with a deprecation warning; torch 2.13 reads
`PYTORCH_CUDA_ALLOC_CONF` (then `PYTORCH_HIP_ALLOC_CONF`) first and falls back to `PYTORCH_ALLOC_CONF`,
without a warning. Each reads ONE of them, the first set: a setting added to a variable the user did not
set could be ignored. So the user's variables are completed in place (expandable_segments added where it
is absent, an explicit `expandable_segments:False` kept), and without any, the launcher sets
`PYTORCH_ALLOC_CONF`, which both versions read. Pure functions of (profile switch, environment).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional

NEW_VARIABLE = "PYTORCH_ALLOC_CONF"
ALLOC_CONF_VARIABLES = (NEW_VARIABLE, "PYTORCH_CUDA_ALLOC_CONF")   # both pinned torch versions read either
EXPANDABLE_KEY = "expandable_segments"
ASYNC_BACKEND = "backend:cudaMallocAsync"                         # CUDA's own allocator: no segments to expand


@dataclass(frozen=True)
class AllocatorSetting:
    """What the ranks' allocator runs with, where that comes from, and the variables that say it."""

    expandable: bool
    source: str                              # the profile key or the user's variable that decided
    env: dict[str, str] = field(default_factory=dict)   # the allocator variables the ranks get
    conflict: str = ""                       # the user's two variables disagree (torch versions differ on which wins)

    def require(self) -> "AllocatorSetting":
        """This setting; ConfigError when the user's two allocator variables disagree."""
        if self.conflict:
            from launcher_core.errors import ConfigError

            raise ConfigError(f"the CUDA allocator's variables: {self.conflict}")
        return self

    def describe(self) -> str:
        state = "with expandable segments" if self.expandable else "without expandable segments"
        shown = ", ".join(f"{name}={value}" for name, value in self.env.items()) or "no allocator variable"
        return f"ranks run {state} ({self.source}; {shown})"


def explicit_expandable(config: str) -> Optional[bool]:
    """The value an allocator config string gives expandable_segments (None: it does not say)."""
    for item in config.split(","):
        key, _, value = item.partition(":")
        if key.strip() == EXPANDABLE_KEY:
            return value.strip() == "True"
    return None


def with_expandable(config: str) -> str:
    """The config with expandable_segments:True appended where it says nothing of it."""
    if explicit_expandable(config) is not None or ASYNC_BACKEND in config.replace(" ", ""):
        return config
    return f"{config.rstrip(',')},{EXPANDABLE_KEY}:True" if config.strip() else f"{EXPANDABLE_KEY}:True"


def user_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables the user set (non-empty), in the order the module docstring names."""
    return {name: env[name] for name in ALLOC_CONF_VARIABLES if env.get(name, "").strip()}


def allocator_setting(enabled: bool, env: Mapping[str, str]) -> AllocatorSetting:
    """The ranks' allocator variables under the profile switch `enabled` (memory.expandable_segments)."""
    user = user_variables(env)
    if not user:
        if not enabled:
            return AllocatorSetting(False, "memory.expandable_segments = false")
        return AllocatorSetting(True, "memory.expandable_segments = true (default)", {NEW_VARIABLE: f"{EXPANDABLE_KEY}:True"})
    ranks = {name: with_expandable(value) if enabled else value for name, value in user.items()}
    return _from_user(user, ranks, enabled)


def _from_user(user: dict[str, str], ranks: dict[str, str], enabled: bool) -> AllocatorSetting:
    said = {name: explicit_expandable(value) for name, value in user.items()}
    values = {name: bool(explicit_expandable(value)) for name, value in ranks.items()}
    conflict = "" if len(set(values.values())) <= 1 else (
        f"{' and '.join(values)} disagree on {EXPANDABLE_KEY} (torch 2.9 reads {NEW_VARIABLE} first, 2.13 "
        f"PYTORCH_CUDA_ALLOC_CONF); unset one or make them agree")
    deciding = next((name for name, value in said.items() if value is not None), None)
    if deciding is not None:
        source = f"{deciding} set by the user says {EXPANDABLE_KEY}:{said[deciding]}"
    elif any(ASYNC_BACKEND in value.replace(" ", "") for value in user.values()):
        source = f"the user's {', '.join(user)} selects cudaMallocAsync, which has no expandable segments"
    else:
        source = (f"memory.expandable_segments = {str(enabled).lower()}, "
                  f"{'added to' if enabled else 'not added to'} the user's {', '.join(user)}")
    return AllocatorSetting(any(values.values()), source, ranks, conflict)


def apply_allocator_env(setting: AllocatorSetting, env: MutableMapping[str, str]) -> None:
    """The setting's variables into `env` (a rank's environment, or this process's before it allocates CUDA
    memory); a set-but-empty allocator variable is dropped: torch reads it first and nothing from the other."""
    env.update(setting.env)
    for name in ALLOC_CONF_VARIABLES:
        if name in env and not env[name].strip():
            del env[name]
