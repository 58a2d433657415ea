"""The alternating rounds' order and summary (quantkit.bench.rounds)."""

from __future__ import annotations

from quantkit.bench.rounds import alternate, median_row, per_round, rotated_order, round_order, table_head


def test_rounds_reverse_the_order_every_other_time():
    runs = ["float", "4-bit", "4-bit + head"]
    assert [round_order(runs, r) for r in range(3)] == [runs, runs[::-1], runs]
    assert round_order((1, 2), 1) == [2, 1]


def test_per_round_ratios_give_their_median_and_quartiles():
    assert per_round([2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 2.0, 2.0]) == "2.25x, quartiles 2.00-2.88x"  # ratios 2, 3, 2, 2.5
    assert per_round([3.0, 4.0], [2.0, 2.0]) == "1.75x"  # too few rounds for quartiles


def test_alternate_runs_each_variant_once_a_round_in_round_order():
    calls = []
    runs = {name: (lambda name=name: calls.append(name) or float(len(calls))) for name in ("a", "b")}
    assert alternate(runs, 3) == {"a": [1.0, 4.0, 5.0], "b": [2.0, 3.0, 6.0]}
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_rotated_rounds_put_each_variant_in_every_place_and_keep_its_own_results():
    assert [rotated_order("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert rotated_order([], 3) == []
    calls = []
    # each call returns its place in the whole run (1, 2, ...): a result kept under the wrong name shows
    runs = {name: (lambda name=name: calls.append(name) or float(len(calls))) for name in ("a", "b", "c")}
    times = alternate(runs, 3, order=rotated_order)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [1.0, 6.0, 8.0], "b": [2.0, 4.0, 9.0], "c": [3.0, 5.0, 7.0]}


def test_table_rows_give_each_variants_median_and_the_median_of_its_round_ratios():
    assert table_head(["M", "a ms", "b / a"]) == "| M | a ms | b / a |\n|---|---|---|"
    times = {"a": [1.0, 2.0, 4.0], "b": [3.0, 2.0, 10.0]}  # b / a per round: 3, 1, 2.5 (median 2.5, not 4 / 2)
    assert median_row(8, times, [("b", "a")]) == "| 8 | 2.00 | 3.00 | 2.50x |"
    assert median_row("x", times, [("a", "b")], digits=1) == "| x | 2.0 | 3.0 | 0.40x |"
