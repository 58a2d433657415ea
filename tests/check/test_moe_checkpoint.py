"""`quantkit check` on MoE checkpoints: every expert's packed linears are compared, also those of an expert the
router sends none of the check's tokens (run on every token of their block instead, and said)."""

from __future__ import annotations

from quantkit.check import checkpoint as check_module
from quantkit.model import moe


def test_an_expert_the_router_never_picks_is_still_checked(quantized_family, tiny_family, monkeypatch):
    qdir = quantized_family("mixtral", "gptq", "gptq")

    def never_expert_0(logits, top_k, renormalize):
        logits = logits.clone()
        logits[:, 0] = float("-inf")
        return route(logits, top_k, renormalize)

    route = moe.route
    monkeypatch.setattr(moe, "route", never_expert_0)
    report = check_module.check_checkpoint(qdir, original=tiny_family("mixtral"), backend="torch",
                                           show_progress=False)
    assert report.passed, [(c.name, c.problems) for c in report.failures]
    experts_0 = [c for c in report.layers if ".experts.0." in c.name]
    assert len(experts_0) == 2 * 3 and all(c.rows > 0 and c.rel_error is not None for c in experts_0)
    assert any("2 experts got no token" in n for n in report.notes)


def test_a_corrupted_expert_fails_the_check_and_only_it(quantized_family, tiny_family, tmp_path):
    """One expert's down_proj scales tripled in the shard: its output error against the float model fails it."""
    import shutil

    from safetensors.torch import load_file, save_file

    qdir = tmp_path / "bad"
    shutil.copytree(quantized_family("qwen3_moe", "gptq", "gptq"), qdir)
    shard = qdir / "model.safetensors"
    tensors = load_file(str(shard))
    key = "model.layers.1.mlp.experts.5.down_proj.scales"
    tensors[key] = tensors[key] * 3
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = check_module.check_checkpoint(qdir, original=tiny_family("qwen3_moe"), backend="torch",
                                           show_progress=False)
    assert [c.name for c in report.failures] == ["model.layers.1.mlp.experts.5.down_proj"]
    assert report.failures[0].rel_error > 1
