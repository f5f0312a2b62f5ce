"""Which transformers versions the workload supports, and what differs between them.

The GPU requirement files pin transformers 5.3.0 (requirements-cu128.txt) and 5.12.1
(requirements-cu130.txt, before it 5.6.0); the CPU requirements pin 5.24.0. All run the drafter, the online
extraction and speculative decoding (`tests/compat` runs those tests under the GPU pins in
scratch venvs). What differs, and where the code adapts (`dflash.eval.target_cache`):

* the cache keyword of a model's forward: `past_key_values` up to 5.2x, `cache` in 5.24 (which
  still accepts `past_key_values` as a deprecated alias until 5.40);
* linear-attention (Gated DeltaNet) layers continue their recurrent and conv state across a
  MULTI-token cached forward only from 5.7.0 on; 5.3-5.6 restart the state from zero for any
  forward of more than one token (a verify block), so their linear layers are fed one token at
  a time there;
* the hybrid cache's layout: 5.3 `Qwen3_5DynamicCache` (lists `conv_states`, `recurrent_states`,
  `key_cache`, `value_cache`), 5.6 `DynamicCache` layers with tensor `conv_states` /
  `recurrent_states`, 5.24 `LinearAttentionLayer`s with per-state dicts; 5.24's `crop` raises on
  linear layers, 5.6's silently keeps their state, 5.3's cache has no `crop`.

Older than 5.3.0 is refused with a message naming the installed version.
"""
from __future__ import annotations

import re
from typing import Optional

from launcher_core.errors import ConfigError

MIN_TRANSFORMERS = (5, 3, 0)
TESTED_TRANSFORMERS = ("5.3.0", "5.6.0", "5.12.1", "5.24.0")
LINEAR_STATE_CONTINUES_SINCE = (5, 7, 0)   # multi-token cached forwards continue linear-attention state


def version_tuple(text: str) -> tuple[int, ...]:
    """`5.6.0` -> (5, 6, 0); `5.7.0.dev0` -> (5, 7, 0); missing parts count as 0."""
    numbers = [int(part) for part in re.findall(r"\d+", text.split("+", 1)[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def check_transformers(version: Optional[str] = None) -> str:
    """The installed transformers version, or a ConfigError naming it when it is too old."""
    version = version or transformers_version()
    if version_tuple(version) < MIN_TRANSFORMERS:
        floor = ".".join(map(str, MIN_TRANSFORMERS))
        raise ConfigError(
            f"transformers {version} is not supported: the drafter, extraction and speculative decoding need "
            f"transformers >= {floor} (tested: {', '.join(TESTED_TRANSFORMERS)}); install the pins of the "
            f"profile's requirements file (pip install -r requirements-cu128.txt, requirements-cu130.txt or "
            f"requirements-cpu.txt)")
    return version


def linear_state_continues(version: Optional[str] = None) -> bool:
    """Does a multi-token cached forward continue the linear-attention state in this transformers?"""
    return version_tuple(version or transformers_version()) >= LINEAR_STATE_CONTINUES_SINCE
