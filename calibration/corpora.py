"""Named calibration corpora: the hub corpora the GPTQ and AWQ papers calibrated on, as data.

Provenance: GPTQ (Frantar et al.) calibrates on random 2048-token windows of C4 (and reports
WikiText-2); AWQ (Lin et al.) on the Pile validation set (mit-han-lab/pile-val-backup).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Corpus:
    name: str
    dataset: str  # hub dataset id
    config: str | None
    split: str
    text_field: str = "text"
    data_files: str | None = None
    shuffle_documents: bool = False  # draw documents at random (big corpora) instead of reading in order
    note: str = ""


CORPORA: dict[str, Corpus] = {
    r.name: r
    for r in (
        Corpus("wikitext2", "wikitext", "wikitext-2-raw-v1", "train",
               note="WikiText-2 raw, train split (GPTQ's WikiText-2 setting)"),
        Corpus("c4", "allenai/c4", None, "train", data_files="en/c4-train.00000-of-01024.json.gz",
               shuffle_documents=True, note="C4 en, first train shard (GPTQ's calibration set)"),
        Corpus("pileval", "mit-han-lab/pile-val-backup", None, "validation", shuffle_documents=True,
               note="Pile validation (AWQ's calibration set)"),
    )
}
