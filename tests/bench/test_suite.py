"""The accuracy suite's table (quantkit.bench.suite) covers the shapes issue 38 asks for, and its specs are checked."""

import json
from dataclasses import asdict, replace

import pytest

from quantkit.bench.suite import SUITE, select
from quantkit.bench.train_tiny import TinySpec, cached_model


def test_suite_covers_the_shapes():
    trained = [m.spec for m in SUITE if m.spec is not None]
    assert len(trained) >= 6
    assert {s.heads // s.kv_heads for s in trained} >= {1, 2, 4, 8}
    assert {s.tie for s in trained} == {True, False}
    assert min(s.layers for s in trained) <= 4 and max(s.layers for s in trained) >= 12
    assert min(s.hidden for s in trained) <= 64 and max(s.hidden for s in trained) >= 512
    assert len({(s.tokenizer, s.vocab) for s in trained}) >= 2
    assert not any(s.bf16 for s in trained), "suite models train in fp32, so their weights do not depend on the CPU"
    assert any(m.checkpoint == "stories260K-hf" for m in SUITE)


def test_every_group_divides_the_packed_widths():
    for m in SUITE:
        if m.spec is not None:
            assert m.spec.hidden % m.group == 0 and m.spec.intermediate % m.group == 0, m.name


def test_select_names_ci_and_unknown():
    assert [m.name for m in select("ci")] == [m.name for m in SUITE if m.ci]
    assert len(select("all")) == len(SUITE)
    with pytest.raises(SystemExit, match="unknown suite model"):
        select("nope")


def test_spec_checks_its_tokenizer_and_heads():
    with pytest.raises(ValueError, match="512 tokens"):
        TinySpec(tokenizer="stories", vocab=1024)
    with pytest.raises(ValueError, match="tokenizer"):
        TinySpec(tokenizer="gpt2")
    with pytest.raises(ValueError, match="kv_heads"):
        TinySpec(heads=8, kv_heads=3)


def test_cache_from_before_new_settings_stays_valid(tmp_path):
    """A model cached before `tie` and `tokenizer` existed is reused for the spec that means the same."""
    old = {k: v for k, v in asdict(TinySpec()).items() if k not in ("tie", "tokenizer")}
    (tmp_path / "train_meta.json").write_text(json.dumps({"spec": old}))
    assert cached_model(tmp_path, TinySpec()) == tmp_path
    assert cached_model(tmp_path, replace(TinySpec(), tie=True)) is None


def test_every_model_the_tests_can_build_has_floors():
    """Every CI-trained model and shipped checkpoint has a [suite_NAME] table with the four floored methods."""
    import tomllib
    from pathlib import Path

    tables = tomllib.loads((Path(__file__).resolve().parents[2] / "configs" / "accuracy_floors.toml").read_text())
    for m in SUITE:
        if m.ci or m.spec is None:
            floors = tables[f"suite_{m.name}"]["max_ppl_ratio"]
            assert {"rtn", "rtn-mse", "gptq", "awq"} <= set(floors), m.name
            assert all(1.0 < f < 1.1 for f in floors.values()), (m.name, floors)
