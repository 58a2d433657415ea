"""MMLU through lm-eval: the built-in `mmlu_<subject>` tasks, from the hub or from a local folder.

The task configs are lm-eval's own YAML files (description line, `doc_to_text` template,
`first_n` few-shot sampler over `dev`, " " target delimiter, choices A-D, acc metric). A
local folder only swaps the dataset: the same config gets a `custom_dataset` holding the
local CSVs in the hub schema, so prompts, few-shot examples and scoring are lm-eval's.
The category of a subject (stem, humanities, social_sciences, other) comes from the
`tag` in that same YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

CATEGORIES = ("stem", "humanities", "social_sciences", "other")


def lm_eval_mmlu_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "mmlu" / "default"


def builtin_subjects() -> list[str]:
    return sorted(p.stem[len("mmlu_"):] for p in lm_eval_mmlu_dir().glob("mmlu_*.yaml"))


def subject_config(subject: str) -> dict:
    """lm-eval's own task config for one subject, includes resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = lm_eval_mmlu_dir() / f"mmlu_{subject}.yaml"
    if not path.is_file():
        raise QuantkitError(f"unknown MMLU subject {subject!r} (lm-eval's mmlu has: {', '.join(builtin_subjects())})")
    return load_yaml(path, resolve_func=True)


def category_of(config: dict) -> str:
    tag = config.get("tag", "")
    tag = tag[0] if isinstance(tag, list) else tag
    category = tag.removeprefix("mmlu_").removesuffix("_tasks")
    if category not in CATEGORIES:
        raise QuantkitError(f"lm-eval's mmlu config {config.get('task')} has an unexpected tag {tag!r}")
    return category


def build_task(subject: str, local_docs: dict[str, list[dict]] | None, source: str):
    """A ConfigurableTask for `mmlu_<subject>`: lm-eval's config, optionally over local documents."""
    from lm_eval.api.task import ConfigurableTask

    cfg = dict(subject_config(subject))
    for key in ("tag", "group", "task_list"):
        cfg.pop(key, None)
    if local_docs is not None:
        import datasets

        dataset = datasets.DatasetDict({split: datasets.Dataset.from_list(docs) for split, docs in local_docs.items()})
        cfg["dataset_path"] = source
        cfg["custom_dataset"] = lambda **_: dataset
    return ConfigurableTask(config=cfg)


@dataclass
class SubjectResult:
    category: str
    correct: list[bool]  # per question, in file order
    choices: list[int]  # the chosen answer index (0..3) per question

    @property
    def n(self) -> int:
        return len(self.correct)


@dataclass
class MmluResult:
    subjects: dict[str, SubjectResult]
    num_fewshot: int
    truncated: int = 0  # contexts cut from the left to fit the model's window

    def correct(self, category: str | None = None) -> list[bool]:
        return [c for s in self.subjects.values() if category in (None, s.category) for c in s.correct]

    def to_dict(self) -> dict:
        return {"num_fewshot": self.num_fewshot, "truncated": self.truncated,
                "subjects": {k: {"category": v.category, "correct": v.correct, "choices": v.choices}
                             for k, v in self.subjects.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> MmluResult:
        subjects = {k: SubjectResult(v["category"], list(v["correct"]), list(v["choices"]))
                    for k, v in d["subjects"].items()}
        return cls(subjects, int(d["num_fewshot"]), int(d["truncated"]))


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std with n-1, as lm-eval's acc_stderr)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def collect_samples(samples: list[dict], category: str) -> SubjectResult:
    """lm-eval's logged samples of one task -> per-question correctness and choice, in doc order."""
    ordered = sorted(samples, key=lambda s: s["doc_id"])
    choices = []
    for s in ordered:
        lls = [float(r[0]) for r in s["filtered_resps"]]
        choices.append(max(range(len(lls)), key=lls.__getitem__))
    return SubjectResult(category, [bool(s["acc"]) for s in ordered], choices)


def evaluate_tasks(lm, tasks: dict, num_fewshot: int, limit: int | None) -> dict:
    """lm-eval's `evaluate` on ready Task objects, with the settings `simple_evaluate` would apply.

    `simple_evaluate` first indexes every task lm-eval ships (tens of seconds); our tasks are
    already built, so the same per-task settings are applied here and `evaluate` runs directly.
    """
    from lm_eval.defaults import DEFAULT_OTHER_SEED
    from lm_eval.evaluator import evaluate

    for task in tasks.values():
        task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return evaluate(lm, {"tasks": tasks, "groups": {}}, limit=limit, bootstrap_iters=0, log_samples=True)


def run_mmlu(lm, subjects: list[str], mmlu_dir: Path | None, num_fewshot: int, limit: int | None) -> MmluResult:
    """Evaluate `lm` (any lm-eval LM) on the chosen subjects with lm-eval's evaluator."""
    from quantkit.eval.mmlu_data import read_local_subject

    tasks, configs, categories = [], [], {}
    for subject in subjects:
        docs = read_local_subject(mmlu_dir, subject) if mmlu_dir is not None else None
        config = subject_config(subject)
        configs.append(config)
        categories[config["task"]] = category_of(config)
        tasks.append(build_task(subject, docs, str(mmlu_dir) if mmlu_dir is not None else ""))
    out = evaluate_tasks(lm, {config["task"]: task for config, task in zip(configs, tasks)}, num_fewshot, limit)
    results = {name.removeprefix("mmlu_"): collect_samples(out["samples"][name], categories[name])
               for name in categories}
    return MmluResult(results, num_fewshot, len(getattr(lm, "truncated_contexts", ())))
