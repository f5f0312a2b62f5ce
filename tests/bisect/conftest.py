"""Every bisect test writes its crash reports and baselines to a per-test cache, not the user's."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_cache_for_every_test(private_cache: Path) -> Path:
    return private_cache
