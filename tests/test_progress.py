"""The progress bar's handle: advancing, and naming the part of a long step under way."""

from quantkit.progress import Bar, progress_bar


def test_bar_advances_and_names_the_part_under_way():
    with progress_bar("Measuring", 3) as bar:
        bar()
        bar(2)
        bar.describe("round 2 of 3")
        (task,) = bar._progress.tasks
        assert task.completed == 3 and task.total == 3 and task.description == "round 2 of 3"


def test_a_disabled_bar_does_nothing():
    with progress_bar("Measuring", 3, enabled=False) as bar:
        bar()
        bar.describe("anything")
        assert bar._progress is None
    Bar()(5)
    Bar().describe("nothing to show")
