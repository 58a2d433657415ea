"""PromptRows: which rows of a step's flat batch are prompt tokens, from its chunks in order."""

from __future__ import annotations

from quantkit.model.prompt_rows import PromptRows, current, prompt_rows


def test_no_prompt_chunk_names_no_rows():
    assert PromptRows.of_spans([(1, False), (1, False)]) is None
    assert PromptRows.of_spans([]) is None
    assert PromptRows.of_spans([(0, True), (1, False)]) is None


def test_all_prompt_rows_need_no_indices():
    rows = PromptRows.of_spans([(5, True), (3, True)])
    assert rows.every and rows.total == 8 and rows.prompt is None and rows.others is None


def test_mixed_steps_index_both_kinds_in_order():
    rows = PromptRows.of_spans([(1, False), (3, True), (2, False), (2, True)])
    assert not rows.every and rows.total == 8
    assert rows.prompt.tolist() == [1, 2, 3, 6, 7] and rows.others.tolist() == [0, 4, 5]


def test_the_context_holds_for_its_block_only():
    assert current() is None
    rows = PromptRows(4)
    with prompt_rows(rows):
        assert current() is rows
        with prompt_rows(None):
            assert current() is None
        assert current() is rows
    assert current() is None
