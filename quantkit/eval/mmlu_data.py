"""Reading a local MMLU folder (`test/` and `dev/` CSVs) into lm-eval's `cais/mmlu` document schema.

Two layouts are accepted, per file:
- hendrycks original: no header, `question,A,B,C,D,answer` with a letter answer (A..D);
- header layout (as in ../shared/data/mmlu): `question,choice0,choice1,choice2,choice3,answer`
  with a 0-based answer (0..3).
Either way a document is `{"question", "subject", "choices": [4 str], "answer": int 0..3}`,
exactly what lm-eval's built-in `mmlu` task reads from the hub, so its own prompt applies unchanged.
A malformed file fails with one line naming the file and the row.
"""

from __future__ import annotations

import csv
from pathlib import Path

from quantkit.errors import QuantkitError

HEADER = ("question", "choice0", "choice1", "choice2", "choice3", "answer")
LETTERS = ("A", "B", "C", "D")
SPLITS = ("test", "dev")


def parse_answer(raw: str, header_layout: bool, where: str) -> int:
    value = raw.strip()
    if header_layout:
        if value not in ("0", "1", "2", "3"):
            raise QuantkitError(f"{where}: answer {raw!r} is not a 0-based choice index (0..3)")
        return int(value)
    if value.upper() not in LETTERS:
        raise QuantkitError(f"{where}: answer {raw!r} is not one of A, B, C, D")
    return LETTERS.index(value.upper())


def read_subject_csv(path: Path, subject: str) -> list[dict]:
    """Documents of one CSV file, validated row by row (rows are numbered as lines of the file)."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise QuantkitError(f"{path}: unreadable MMLU file ({exc})") from exc
    header_layout = bool(rows) and tuple(c.strip().lower() for c in rows[0]) == HEADER
    start = 1 if header_layout else 0
    docs = []
    for number, row in enumerate(rows[start:], start=start + 1):
        where = f"{path}: row {number}"
        if len(row) != 6:
            raise QuantkitError(f"{where}: expected 6 columns (question, 4 choices, answer), got {len(row)}")
        docs.append({"question": row[0], "subject": subject, "choices": list(row[1:5]),
                     "answer": parse_answer(row[5], header_layout, where)})
    if not docs:
        raise QuantkitError(f"{path}: no questions in this file")
    return docs


def subject_file(mmlu_dir: Path, split: str, subject: str) -> Path:
    return mmlu_dir / split / f"{subject}_{split}.csv"


def local_subjects(mmlu_dir: Path) -> list[str]:
    """Subjects that have a test file; each must also have a dev file (the few-shot source)."""
    if not mmlu_dir.is_dir():
        raise QuantkitError(f"{mmlu_dir}: no such MMLU folder (expected test/ and dev/ inside)")
    for split in SPLITS:
        if not (mmlu_dir / split).is_dir():
            raise QuantkitError(f"{mmlu_dir}: missing the {split}/ folder (an MMLU folder holds test/ and dev/)")
    subjects = sorted(p.name[: -len("_test.csv")] for p in (mmlu_dir / "test").glob("*_test.csv"))
    if not subjects:
        raise QuantkitError(f"{mmlu_dir / 'test'}: no <subject>_test.csv files")
    for subject in subjects:
        if not subject_file(mmlu_dir, "dev", subject).is_file():
            raise QuantkitError(f"{subject_file(mmlu_dir, 'dev', subject)}: missing (few-shot examples come from dev)")
    return subjects


def read_local_subject(mmlu_dir: Path, subject: str) -> dict[str, list[dict]]:
    """{"test": docs, "dev": docs} of one subject."""
    return {split: read_subject_csv(subject_file(mmlu_dir, split, subject), subject) for split in SPLITS}
