"""Local MMLU folders: both CSV layouts, and one clear line for each malformed input."""

import csv
from pathlib import Path

import pytest

from quantkit.errors import QuantkitError
from quantkit.eval.mmlu_data import local_subjects, read_local_subject, read_subject_csv

ROWS = [["What is 1+1?", "1", "2", "3", "4"], ["Capital of France?", "Rome", "Paris", "Oslo", "Bern"]]
ANSWERS = [1, 1]


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    return path


def make_folder(root: Path, layout: str, subject: str = "anatomy") -> Path:
    for split in ("test", "dev"):
        if layout == "header":
            rows = [["question", "choice0", "choice1", "choice2", "choice3", "answer"]]
            rows += [r + [str(a)] for r, a in zip(ROWS, ANSWERS)]
        else:
            rows = [r + ["ABCD"[a]] for r, a in zip(ROWS, ANSWERS)]
        write_csv(root / split / f"{subject}_{split}.csv", rows)
    return root


def test_both_layouts_give_the_same_documents(tmp_path):
    header = read_local_subject(make_folder(tmp_path / "h", "header"), "anatomy")
    hendrycks = read_local_subject(make_folder(tmp_path / "o", "hendrycks"), "anatomy")
    assert header == hendrycks
    assert header["test"][0] == {"question": "What is 1+1?", "subject": "anatomy", "choices": ["1", "2", "3", "4"],
                                 "answer": 1}


def test_shared_folder_reads(mmlu_dir):
    subjects = local_subjects(mmlu_dir)
    assert len(subjects) == 38
    docs = read_local_subject(mmlu_dir, "abstract_algebra")
    assert len(docs["dev"]) == 5
    assert docs["test"][0]["question"].startswith("Find the degree for the given field extension")
    assert docs["test"][0]["answer"] == 1


@pytest.mark.parametrize("row, message", [
    (["q", "a", "b", "c", "1"], "row 2: expected 6 columns"),
    (["q", "a", "b", "c", "d", "4"], "row 2: answer '4' is not a 0-based choice index"),
])
def test_malformed_header_rows_name_file_and_row(tmp_path, row, message):
    path = write_csv(tmp_path / "x_test.csv", [["question", "choice0", "choice1", "choice2", "choice3", "answer"], row])
    with pytest.raises(QuantkitError, match=message) as info:
        read_subject_csv(path, "x")
    assert str(path) in str(info.value)


def test_letter_answer_out_of_range(tmp_path):
    path = write_csv(tmp_path / "x_test.csv", [["q", "a", "b", "c", "d", "B"], ["q", "a", "b", "c", "d", "E"]])
    with pytest.raises(QuantkitError, match="row 2: answer 'E' is not one of A, B, C, D"):
        read_subject_csv(path, "x")


def test_folder_problems(tmp_path):
    with pytest.raises(QuantkitError, match="no such MMLU folder"):
        local_subjects(tmp_path / "nope")
    (tmp_path / "m" / "test").mkdir(parents=True)
    with pytest.raises(QuantkitError, match="missing the dev/ folder"):
        local_subjects(tmp_path / "m")
    make_folder(tmp_path / "m", "header")
    (tmp_path / "m" / "dev" / "anatomy_dev.csv").unlink()
    with pytest.raises(QuantkitError, match="anatomy_dev.csv: missing"):
        local_subjects(tmp_path / "m")
    empty = write_csv(tmp_path / "e_test.csv", [])
    with pytest.raises(QuantkitError, match="no questions"):
        read_subject_csv(empty, "e")
