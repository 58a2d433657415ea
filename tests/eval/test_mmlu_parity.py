"""The local MMLU task agrees with lm-eval's own `hf` model, and its prompt is lm-eval's mmlu prompt.

Both backends score the same lm-eval Task objects (lm-eval's mmlu_<subject> YAML over the
local CSVs); they must pick the same answer on every question, with the same accuracy and
log-likelihoods equal to float32 rounding.
"""

import pytest

from quantkit.eval.lm_backend import QuantkitLM
from quantkit.eval.mmlu import build_task, evaluate_tasks, run_mmlu, subject_config
from quantkit.eval.mmlu_data import read_local_subject

SUBJECTS = ["abstract_algebra", "marketing", "high_school_geography"]


def hf_lm(path):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), dtype="float32", batch_size=4, device="cpu")


def lls_by_question(out: dict) -> dict:
    return {(name, s["doc_id"]): [float(r[0]) for r in s["filtered_resps"]]
            for name, samples in out["samples"].items() for s in samples}


def tasks_for(mmlu_dir, subjects):
    return {f"mmlu_{s}": build_task(s, read_local_subject(mmlu_dir, s), str(mmlu_dir)) for s in subjects}


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture, shots", [("tiny_llama", 1), ("stories_dir", 5)])
def test_local_mmlu_matches_lm_eval_hf(request, mmlu_dir, model_fixture, shots):
    path = request.getfixturevalue(model_fixture)
    ours = QuantkitLM(pretrained=str(path), batch_size=5)
    ours_result = run_mmlu(ours, SUBJECTS, mmlu_dir, shots, limit=4)
    hf_result = run_mmlu(hf_lm(path), SUBJECTS, mmlu_dir, shots, limit=4)
    for subject in SUBJECTS:
        assert ours_result.subjects[subject].choices == hf_result.subjects[subject].choices, subject
        assert ours_result.subjects[subject].correct == hf_result.subjects[subject].correct, subject
    assert ours_result.correct() == hf_result.correct()
    assert len(ours_result.correct()) == 4 * len(SUBJECTS)
    if model_fixture == "stories_dir":
        # 5-shot MMLU prompts run past stories260K's 512-token window: they are cut from the left, and counted
        assert ours_result.truncated > 0


@pytest.mark.slow
def test_loglikelihoods_equal_lm_eval_hf(tiny_llama, mmlu_dir):
    ours = lls_by_question(evaluate_tasks(QuantkitLM(pretrained=str(tiny_llama), batch_size=3),
                                          tasks_for(mmlu_dir, SUBJECTS[:2]), 2, 3))
    theirs = lls_by_question(evaluate_tasks(hf_lm(tiny_llama), tasks_for(mmlu_dir, SUBJECTS[:2]), 2, 3))
    assert ours.keys() == theirs.keys() and len(ours) == 6
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-4), key


class RecordingLM(QuantkitLM):
    def loglikelihood(self, requests, disable_tqdm=False):
        self.seen = [req.args for req in requests]
        return super().loglikelihood(requests, disable_tqdm=True)


def render(doc: dict) -> str:
    """lm-eval's mmlu template, written out by hand from its documented format."""
    c = doc["choices"]
    return f"{doc['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def test_prompt_is_lm_eval_mmlu_with_first_dev_examples(tiny_llama, mmlu_dir):
    lm = RecordingLM(pretrained=str(tiny_llama))
    docs = read_local_subject(mmlu_dir, "abstract_algebra")
    evaluate_tasks(lm, tasks_for(mmlu_dir, ["abstract_algebra"]), num_fewshot=2, limit=1)
    shots = "".join(f"{render(d)} {'ABCD'[d['answer']]}\n\n" for d in docs["dev"][:2])
    expected = ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
                + shots + render(docs["test"][0]))
    assert sorted(lm.seen) == [(expected, f" {letter}") for letter in "ABCD"]
    assert subject_config("abstract_algebra")["description"].startswith("The following are multiple choice")
