"""N-gram prompt lookup on hand-built token lists."""
from engine.speculative.proposers.ngram import ngram_propose


def test_longest_suffix_most_recent_occurrence():
    toks = [1, 2, 3, 4, 9, 2, 3, 4]
    assert ngram_propose(toks, 3, 1, 3) == [9, 2, 3]
    assert ngram_propose(toks, 10, 1, 3) == [9, 2, 3, 4]  # runs to the end of the list


def test_prefers_longer_ngrams_over_more_recent_short_ones():
    toks = [5, 6, 7, 8, 1, 7, 2, 5, 6, 7]
    assert ngram_propose(toks, 2, 1, 3) == [8, 1]  # "5 6 7" at 0 beats "7" at 5
    assert ngram_propose(toks, 2, 1, 1) == [2, 5]  # n = 1 only: the latest "7"


def test_no_match_and_short_inputs():
    assert ngram_propose([1, 2, 3], 4, 1, 3) == []
    assert ngram_propose([7], 4, 1, 3) == []
    assert ngram_propose([], 4, 1, 3) == []
    assert ngram_propose([4, 4], 3, 1, 2) == [4]
    assert ngram_propose([1, 2, 1, 2], 3, 2, 2) == [1, 2]


def test_match_reports_the_matched_length_as_confidence():
    from engine.speculative.proposers.ngram import ngram_match

    toks = [5, 6, 7, 8, 1, 7, 2, 5, 6, 7]
    assert ngram_match(toks, 2, 1, 3) == (3, [8, 1])
    assert ngram_match(toks, 2, 1, 1) == (1, [2, 5])
    assert ngram_match([1, 2, 3], 2, 1, 3) == (0, [])
