"""The binary search as pure functions: probe counts, skips, resumption."""
from __future__ import annotations

import pytest

from envcheck.bisect.search import next_candidate, probe_bound, search_state


def simulate(groups: int, culprit: int, inconsistent: frozenset[int] = frozenset(),
             start: dict | None = None) -> tuple[dict, list[int]]:
    """Run the search against a world where candidate k is bad iff k >= culprit."""
    outcomes = dict(start or {})
    probed = []
    while (k := next_candidate(groups, outcomes)) is not None:
        if k in inconsistent:
            outcomes[k] = "skip"
            continue
        probed.append(k)
        outcomes[k] = "bad" if k >= culprit else "good"
    return outcomes, probed


@pytest.mark.parametrize("groups", list(range(1, 34)))
def test_finds_every_culprit_within_the_bound(groups):
    for culprit in range(1, groups + 1):
        outcomes, probed = simulate(groups, culprit)
        assert search_state(groups, outcomes).culprit_range == (culprit, culprit)
        assert len(probed) <= probe_bound(groups), (groups, culprit, probed)
        assert probed[0] == 0, "GOOD must be probed first: it is the baseline"


def test_bound_is_log2_plus_one():
    assert [probe_bound(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 3, 3, 4, 4, 5, 5, 6]


def test_inconsistent_candidate_is_skipped_not_blamed():
    outcomes, _ = simulate(8, culprit=6, inconsistent=frozenset({4}))
    assert outcomes[4] == "skip"
    assert search_state(8, outcomes).culprit_range == (6, 6)


def test_untestable_neighbours_leave_a_range_instead_of_a_wrong_answer():
    outcomes, _ = simulate(8, culprit=5, inconsistent=frozenset({3, 4}))
    first, last = search_state(8, outcomes).culprit_range
    assert first <= 5 <= last and (first, last) != (5, 5)
    assert {3, 4} <= {k for k, outcome in outcomes.items() if outcome == "skip"}


def test_resuming_from_partial_outcomes_continues_the_same_search():
    full, probed = simulate(13, culprit=9)
    partial = {k: full[k] for k in probed[:2]}
    resumed, reprobed = simulate(13, culprit=9, start=partial)
    assert resumed == full
    assert reprobed == probed[2:]


def test_a_bad_good_set_stops_the_search():
    assert next_candidate(5, {}) == 0
    assert next_candidate(5, {0: "bad"}) is None


def test_verify_bad_probes_bad_right_after_good():
    assert next_candidate(6, {0: "good"}, verify_bad=True) == 6
    assert next_candidate(6, {0: "good"}) == 3
