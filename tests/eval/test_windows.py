"""The window arithmetic shared by the lm-eval backend and perplexity."""

import pytest

from quantkit.eval.windows import batches_by_length, disjoint_windows, score_window


def test_score_window_fits_without_truncation():
    w = score_window([1, 2, 3], [4, 5], max_length=8)
    assert w.inp == (1, 2, 3, 4)  # the last continuation token is predicted, never fed
    assert w.cont == (4, 5)
    assert not w.truncated


def test_score_window_truncates_from_the_left_like_lm_eval_hf():
    ctx, cont = list(range(10)), [10, 11]
    w = score_window(ctx, cont, max_length=5)
    assert w.inp == tuple((ctx + cont)[-6:][:-1]) == (6, 7, 8, 9, 10)
    assert w.truncated
    # exactly max_length + 1 tokens still fits: nothing is cut
    assert not score_window(list(range(4)), [4, 5], max_length=5).truncated


def test_score_window_rejects_empty_and_oversized():
    with pytest.raises(ValueError):
        score_window([], [1], 4)
    with pytest.raises(ValueError):
        score_window([1], [1, 2, 3, 4, 5], 4)


def test_batches_longest_first():
    inputs = [(1,), (1, 2, 3), (1, 2), (4, 5, 6)]
    batches = batches_by_length(inputs, 2)
    assert [len(b[0]) for b in batches] == [3, 2]
    assert sorted(t for b in batches for t in b) == sorted(inputs)


def test_disjoint_windows_drop_the_tail():
    assert disjoint_windows(10, 4) == [(0, 4), (4, 8)]
    assert disjoint_windows(3, 4) == []
    with pytest.raises(ValueError):
        disjoint_windows(10, 1)
