"""`quantkit quantize --method awq` end to end: real stories260K-hf and tiny random Llama / Qwen2 / Qwen3.

AWQ's perplexity must be below RTN's with the same scheme (4-bit, asymmetric, same group size),
`--format awq` and `--format gptq` of the same plan must give the same logits, and a saved plan
must reproduce the checkpoint bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow



pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cli():
    from typer.testing import CliRunner

    from quantkit.cli import build_app

    app, runner = build_app(), CliRunner()

    def run(*args: str, ok: bool = True):
        result = runner.invoke(app, [str(a) for a in args])
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return run


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    """The project's generated stories: one file to calibrate on, another (other seed) to score."""
    from quantkit.calibration.synthetic import make_corpus

    root = tmp_path_factory.mktemp("awq-text")
    out = {}
    for name, seed, n in (("calib", 1, 400), ("eval", 2, 200)):
        out[name] = root / f"{name}.txt"
        out[name].write_text("\n\n".join(make_corpus(n, seed=seed)))
    return out


def calib_args(texts) -> list[str]:
    return ["--calib", str(texts["calib"]), "--nsamples", "8", "--seqlen", "128"]


def load(path: Path):
    from quantkit.model.loader import load_model

    model, _ = load_model(path)
    return model.eval()


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over windows ids [B, T]."""
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
    return math.exp(float(-logp.gather(-1, ids[:, 1:, None]).mean()))


def text_windows(model_dir: Path, text_file: Path, seqlen: int = 128, windows: int = 16) -> torch.Tensor:
    from quantkit.model.loader import load_tokenizer

    ids = load_tokenizer(model_dir)(text_file.read_text(), return_tensors="pt").input_ids[0]
    n = min(windows, len(ids) // seqlen)
    return ids[: n * seqlen].view(n, seqlen)


# ---- stories260K-hf: a real trained model ------------------------------------------------------


@pytest.fixture(scope="module")
def stories_runs(stories_dir, texts, cli, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stories-awq")
    runs = {"awq": root / "awq", "rtn": root / "rtn", "gptq_fmt": root / "awq-gptq", "again": root / "again"}
    common = ["--group-size", "64", *calib_args(texts)]
    cli("quantize", stories_dir, "--method", "awq", "--out", runs["awq"], *common)
    cli("quantize", stories_dir, "--method", "rtn", "--no-sym", "--out", runs["rtn"], *common)
    plan = runs["awq"] / "awq_plan.safetensors"
    cli("quantize", stories_dir, "--method", "awq", "--format", "gptq", "--load-plan", plan,
        "--out", runs["gptq_fmt"], *common)
    cli("quantize", stories_dir, "--method", "awq", "--load-plan", plan, "--out", runs["again"], *common)
    return runs


def test_stories_awq_perplexity_below_rtn(stories_dir, stories_runs, texts):
    ids = text_windows(stories_dir, texts["eval"])
    ppl = {name: perplexity(load(stories_runs[name]), ids) for name in ("awq", "rtn")}
    ppl["float"] = perplexity(load(stories_dir), ids)
    assert ppl["awq"] < ppl["rtn"], ppl
    assert ppl["awq"] < ppl["float"] * 1.05, ppl  # 4-bit group-64 attention costs AWQ under 5%


def test_stories_awq_checkpoint_layout_and_metadata(stories_runs):
    from safetensors import safe_open

    out = stories_runs["awq"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q = "model.layers.0.self_attn.q_proj"
        assert f.get_tensor(f"{q}.qweight").dtype == torch.int32 and f.get_tensor(f"{q}.qweight").shape == (64, 8)
        assert f.get_tensor(f"{q}.qzeros").shape == (1, 8) and f.get_tensor(f"{q}.scales").dtype == torch.float16
        assert f"{q}.g_idx" not in keys
        assert "model.layers.0.mlp.down_proj.weight" in keys  # intermediate 172: left float
    index = json.loads((out / "model.safetensors.index.json").read_text())  # loaders that glob *.safetensors
    assert set(index["weight_map"].values()) == {"model.safetensors"}  # must not take awq_plan for weights
    meta = json.loads((out / "quantkit_meta.json").read_text())
    stats = meta["layers"][0]["stats"]
    assert "o" not in stats["skipped_groups"]  # GQA 8/4: v -> o scaled, tied over the query heads of a kv head
    assert set(stats["groups"]) == {"qkv", "o"} and stats["loss_awq"] < stats["loss_rtn"]


def test_stories_awq_and_gptq_formats_give_the_same_logits(stories_dir, stories_runs, texts):
    qc = json.loads((stories_runs["gptq_fmt"] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq"
    ids = text_windows(stories_dir, texts["eval"], windows=4)
    with torch.no_grad():
        a = load(stories_runs["awq"])(ids).logits
        g = load(stories_runs["gptq_fmt"])(ids).logits
    assert torch.equal(a, g)


def test_stories_saved_plan_reproduces_checkpoint_bit_for_bit(stories_runs):
    for name in ("model.safetensors", "awq_plan.safetensors"):
        assert (stories_runs["awq"] / name).read_bytes() == (stories_runs["again"] / name).read_bytes(), name


def test_plan_for_another_model_is_one_line_error(stories_runs, tiny_llama, texts, cli, tmp_path):
    result = cli("quantize", tiny_llama, "--method", "awq", "--group-size", "64", *calib_args(texts),
                 "--load-plan", stories_runs["awq"] / "awq_plan.safetensors", "--out", tmp_path / "x", ok=False)
    assert result.exit_code == 2
    assert "--load-plan" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,message", [
    (["--method", "awq", "--desc-act"], "desc-act"),
    (["--method", "gptq", "--desc-act", "--format", "awq"], "AWQ format"),
    (["--method", "awq", "--group-size", "128"], "group size"),  # stories: K = 64 < 128
])
def test_awq_bad_options_are_one_line_errors(stories_dir, cli, tmp_path, args, message):
    result = cli("quantize", stories_dir, *args, "--out", tmp_path / "x", ok=False)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


# ---- tiny random models with planted outlier channels ----------------------------------------


def with_outlier_channels(src: Path, dst: Path, factor: float = 8.0, channels: int = 4) -> Path:
    """A random model has no salient input channels, so AWQ would have nothing to protect; real
    LLMs do (a few hidden channels carry far larger activations). Plant them: multiply a few
    channels of every RMSNorm weight that feeds linears by `factor`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(norm.weight.numel(), generator=g)[:channels]] *= factor
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(dst)
    return dst


@torch.no_grad()
def sample_ids(model, n: int = 8, seqlen: int = 128, seed: int = 0) -> torch.Tensor:
    """Token windows [n, seqlen] sampled from the float model itself: a random model's own text is
    the text it models well, so the perplexity gap to float measures what quantization lost."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.ones(n, 1, dtype=torch.long)  # BOS
    for _ in range(seqlen - 1):
        probs = torch.softmax(model(ids).logits[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_awq_perplexity_below_rtn(family, texts, cli, tmp_path):
    from tests_support.tiny_models import make_tiny_model

    src = with_outlier_channels(make_tiny_model(tmp_path / "base", family=family), tmp_path / "model")
    common = ["--group-size", "64", *calib_args(texts)]
    cli("quantize", src, "--method", "awq", "--out", tmp_path / "awq", *common)
    cli("quantize", src, "--method", "rtn", "--no-sym", "--out", tmp_path / "rtn", *common)
    ids = sample_ids(load(src))
    ppl = {name: perplexity(load(tmp_path / name), ids) for name in ("awq", "rtn")}
    ppl["float"] = perplexity(load(src), ids)
    assert ppl["float"] < ppl["awq"] < ppl["rtn"], ppl
