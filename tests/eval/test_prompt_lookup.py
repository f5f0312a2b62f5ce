"""Prompt-lookup drafting: the longest suffix n-gram's most recent earlier continuation."""
from __future__ import annotations

from dflash.eval.prompt_lookup import PromptLookupDrafter, lookup_continuation


def test_longest_ngram_wins_over_shorter_matches():
    # suffix [7, 8]: the bigram occurs at 0 (-> 1, 2); the unigram 8 also occurs later (-> 5).
    tokens = [7, 8, 1, 2, 3, 8, 5, 7, 8]
    assert lookup_continuation(tokens, 2, max_ngram=2) == [1, 2]


def test_most_recent_occurrence_is_used():
    tokens = [4, 1, 4, 2, 4]
    assert lookup_continuation(tokens, 1, max_ngram=1) == [2]


def test_continuation_is_cut_at_k_and_at_the_end():
    tokens = [1, 2, 3, 4, 1, 2]
    assert lookup_continuation(tokens, 3, max_ngram=2) == [3, 4, 1]
    assert lookup_continuation([5, 6, 5], 4, max_ngram=1) == [6, 5]


def test_no_match_proposes_nothing():
    assert lookup_continuation([1, 2, 3], 4) == []
    assert lookup_continuation([9], 4) == []
    assert PromptLookupDrafter().propose([1, 2, 3], None, 4, 0.0).tokens == []
