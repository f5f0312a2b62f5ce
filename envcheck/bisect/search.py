"""The binary search, as pure functions of what is known so far.

Candidate k is GOOD plus the first k groups' changes: k = 0 is GOOD itself (probed first: it is
the baseline the others are judged against), k = n is BAD (assumed bad, as `git bisect` assumes
of the commit it is told is bad; `verify_bad` probes it). Each outcome is `good`, `bad` or
`skip` (inconsistent set, or the probe could not test). The culprit is the first group whose
addition turns good into bad: groups lo+1 .. hi when the search ends. Because the next
candidate is computed from the outcomes alone, a resumed bisect continues exactly where the
interrupted one stopped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

Outcome = Literal["good", "bad", "skip"]


@dataclass(frozen=True)
class SearchState:
    lo: int          # largest k known good (below hi)
    hi: int          # smallest k known (or assumed) bad

    @property
    def culprit_range(self) -> tuple[int, int]:
        """1-based group indexes (inclusive) that may hold the culprit."""
        return self.lo + 1, self.hi


def search_state(groups: int, outcomes: dict[int, Outcome]) -> SearchState:
    hi = min((k for k, outcome in outcomes.items() if outcome == "bad"), default=groups)
    lo = max((k for k, outcome in outcomes.items() if outcome == "good" and k < hi), default=0)
    return SearchState(lo, hi)


def next_candidate(groups: int, outcomes: dict[int, Outcome], verify_bad: bool = False) -> Optional[int]:
    """The next k to try, or None when the search is over (or GOOD itself is not good)."""
    if 0 not in outcomes:
        return 0
    if outcomes[0] != "good":
        return None
    if verify_bad and groups not in outcomes:
        return groups
    state = search_state(groups, outcomes)
    untried = [k for k in range(state.lo + 1, state.hi) if k not in outcomes]
    if not untried:
        return None
    middle = (state.lo + state.hi) // 2
    return min(untried, key=lambda k: (abs(k - middle), k))


def probe_bound(groups: int) -> int:
    """Probes a bisect needs without skips: GOOD, then ceil(log2(groups))."""
    return math.ceil(math.log2(max(groups, 1))) + 1
