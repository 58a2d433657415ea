"""Kernel sources as a git revision had them (quantkit.bench.kernel_revision), for A/B benchmarks in one process."""

import pytest

from quantkit.bench import kernel_revision as kr

pytestmark = pytest.mark.skipif(not (kr.REPO / ".git").exists(), reason="not a git checkout")


def test_a_revision_is_resolved_to_its_commit():
    assert len(kr.commit_of("HEAD")) == 40
    assert kr.commit_of(kr.commit_of("HEAD")[:12]) == kr.commit_of("HEAD")


def test_a_name_that_is_no_commit_is_refused_in_one_line():
    with pytest.raises(kr.RevisionError, match=r"'no-such-revision' names no commit") as exc:
        kr.commit_of("no-such-revision")
    assert "\n" not in str(exc.value)


def test_the_sources_are_git_s_at_that_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path))
    commit = kr.commit_of("HEAD")
    tree = kr.csrc_tree(commit)
    src = kr.sources_at(tree)
    assert src.parent == tmp_path and (src / ".complete").read_text() == tree
    at_commit = kr._git("show", f"{commit}:kernels/csrc/paged_attention_cpu.cpp")
    assert (src / "paged_attention_cpu.cpp").read_bytes() == at_commit
    assert {p.name for p in src.iterdir()} >= {"paged_attention_cpu.cpp", "attention_avx512.h", "vec_avx512.h"}
