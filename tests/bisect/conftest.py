"""The bisect tests' shared fixture: the CLI run in process (the safety tests' helper)."""
from __future__ import annotations

from tests.safety.conftest import cli, private_cache  # noqa: F401  (pytest fixtures)
