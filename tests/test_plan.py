"""`quantkit plan`: the arithmetic against real checkpoints and against the engine's own KV plan."""

import json

import pytest
import torch

from quantkit.engine.config import EngineConfig
from quantkit.engine.kv_sizing import plan_kv
from quantkit.engine.model_runner import kv_block_bytes
from quantkit.errors import QuantkitError
from quantkit.model.checkpoint import ShardReader, read_config
from quantkit.plan import (GiB, ModelShape, kv_bytes_per_token, layer_linear_bytes, make_plan, parse_bytes,
                           weight_bytes)
from tests_support.cli import run_cli


def test_fp16_weight_bytes_count_every_parameter(tiny_llama, tiny_qwen2, stories_dir):
    for path in (tiny_llama, tiny_qwen2, stories_dir):
        reader = ShardReader(path)
        params = sum(torch.Size(reader.shape_of(k)).numel() for k in reader.keys())
        assert weight_bytes(ModelShape.from_config(read_config(path)), None) == 2 * params, path


@pytest.mark.parametrize("group_size", [64, -1])
def test_int4_linear_bytes_match_a_packed_awq_layer(tiny_llama, group_size):
    """codes + scales + zeros of one layer, as quantkit packs it in the AWQ layout (no g_idx)."""
    from quantkit.format.packing import pack
    from quantkit.format.primitives import QuantScheme, rtn_quantize

    reader = ShardReader(tiny_llama)
    packed = 0
    for key in [k for k in reader.keys() if k.startswith("model.layers.0.") and k.endswith("proj.weight")]:
        p = pack(rtn_quantize(reader.get(key), QuantScheme(4, group_size, False)), "awq")
        packed += sum(t.numel() * t.element_size() for t in (p.qweight, p.qzeros, p.scales))
    assert layer_linear_bytes(ModelShape.from_config(read_config(tiny_llama)), 4, group_size) == packed


@pytest.mark.parametrize("kv_dtype,torch_dtype", [("auto", torch.float16), ("fp32", torch.float32)])
def test_agrees_with_the_engine_kv_plan(tiny_llama, monkeypatch, kv_dtype, torch_dtype):
    """Same memory, same weights resident: the engine's GPU sizing allocates the blocks the plan predicts."""
    config = read_config(tiny_llama)
    shape = ModelShape.from_config(config)
    total = 64 * 1024**2
    plan = make_plan("tiny", config, total, 0.9, 512, kv_dtype=kv_dtype)
    block = kv_block_bytes(shape.layers, 16, shape.kv_heads, shape.head_dim, torch_dtype)
    assert block == 16 * kv_bytes_per_token(shape, kv_dtype)
    for col in plan.columns:
        # the engine sees the weights as memory already taken on the device
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, c=col: (total - c.weight_bytes_per_gpu, total))
        engine = plan_kv(EngineConfig("m", gpu_memory_utilization=0.9), block, 512, torch.device("cuda"))
        assert engine.num_blocks == col.kv_blocks_per_gpu and engine.capacity_tokens == col.kv_tokens, col.label


def test_a_fixed_kv_cache_memory_ignores_the_weights(tiny_llama):
    """--kv-cache-memory (vLLM's --kv-cache-memory-bytes): the same KV tokens in both columns, whatever the weights."""
    config = read_config(tiny_llama)
    plan = make_plan("tiny", config, GiB, 0.9, 512, kv_dtype="fp32", kv_cache_memory=8 * 1024**2)
    per_block = 16 * kv_bytes_per_token(ModelShape.from_config(config), "fp32")
    for col in plan.columns:
        assert col.kv_budget_bytes_per_gpu == 8 * 1024**2 and col.kv_blocks_per_gpu == 8 * 1024**2 // per_block
    with pytest.raises(QuantkitError, match="--kv-cache-memory"):
        make_plan("tiny", config, GiB, kv_cache_memory=0)
    code, output = run_cli("plan", tiny_llama, "--kv-cache-memory", "8MiB", "--kv-dtype", "fp32")
    assert code == 0 and f"{plan.columns[0].kv_tokens:,}" in output, output


def test_tensor_parallel_splits_weights_and_kv_heads(tiny_llama):
    config = read_config(tiny_llama)  # 2 KV heads of 32, 2 layers
    one, two, four = (make_plan("t", config, GiB, tp=tp, max_model_len=512) for tp in (1, 2, 4))
    assert two.columns[0].kv_bytes_per_token_per_gpu == one.columns[0].kv_bytes_per_token_per_gpu // 2 == 2 * 2 * 32 * 2
    assert two.columns[1].weight_bytes_per_gpu == -(-one.columns[1].weight_bytes_total // 2)
    assert four.columns[0].kv_bytes_per_token_per_gpu == two.columns[0].kv_bytes_per_token_per_gpu  # replicated
    assert any("replica" in n for n in four.notes)


def test_llama_8b_figures():
    """Llama-3-8B's published shape: 8 KV heads of 128 over 32 layers = 128 KiB per token in fp16."""
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192}
    plan = make_plan("llama3-8b", config, parse_bytes("80GiB"), 0.9, 8192)
    fp16, int4 = plan.columns
    assert fp16.kv_bytes_per_token_per_gpu == 2 * 32 * 8 * 128 * 2 == 131072
    assert fp16.weight_bytes_total == 2 * 8_030_261_248  # 8.03 B parameters
    assert int4.kv_tokens > fp16.kv_tokens and int4.concurrent_sequences > fp16.concurrent_sequences


def test_parse_bytes_and_errors():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("40 GB") == 40 * 10**9 and parse_bytes("1.5g") == 1_500_000_000
    with pytest.raises(QuantkitError, match="cannot read a size"):
        parse_bytes("lots")
    with pytest.raises(QuantkitError, match="--kv-dtype"):
        make_plan("m", {}, GiB, kv_dtype="int3")


def test_cli_table_and_json(tiny_llama, tmp_path):
    out = tmp_path / "plan.json"
    code, output = run_cli("plan", tiny_llama, "--gpu-memory", "1GiB", "--max-model-len", "512", "--tp", "2",
                           "--output", out)
    assert code == 0, output
    assert "INT4 g128" in output and "KV tokens" in output
    data = json.loads(out.read_text())
    assert data["tp"] == 2 and [c["label"] for c in data["columns"]] == ["fp16", "INT4 g128"]
    code, output = run_cli("plan", "no/such-model-offline")
    assert code == 2 and "offline" in output


def test_a_length_past_the_models_positions_is_said_and_sequences_are_whole(stories_dir, tmp_path):
    """stories260K has 512 positions: --max-model-len 8192 gets a note naming that limit, and the sequences that
    fit are whole ones (kv tokens // 8192), in the table and the JSON. The plan is a result: stdout; notes: stderr."""
    from typer.testing import CliRunner

    from quantkit.cli import build_app

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(build_app(), ["plan", str(stories_dir), "--max-model-len", "8192", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["max_model_len"] == 8192
    for col in data["columns"]:
        assert col["concurrent_sequences"] == col["kv_tokens"] // 8192 and isinstance(col["concurrent_sequences"], int)
    row = next(line for line in result.stdout.splitlines() if "sequences of 8192" in line)
    assert [cell.strip() for cell in row.split("│")[2:4]] == [f"{c['concurrent_sequences']:,}" for c in data["columns"]]
    assert "." not in row
    note = next(line for line in result.stderr.splitlines() if "8192" in line)
    assert "512" in note and "max_position_embeddings" in note
    assert "KV tokens" in result.stdout and "KV tokens" not in result.stderr


@pytest.mark.parametrize("family", ["phi3", "gemma3", "mixtral", "qwen3_moe", "gpt_oss"])
def test_fp16_weight_bytes_count_every_parameter_of_the_new_families(family, tiny_family):
    """Phi-3's fused projections, Gemma's four norms and q/k norms (tied head), the MoE routers and experts, gpt-oss's
    biases and sinks."""
    path = tiny_family(family)
    reader = ShardReader(path)
    params = sum(torch.Size(reader.shape_of(k)).numel() for k in reader.keys())
    shape = ModelShape.from_config(read_config(path))
    assert weight_bytes(shape, None) == 2 * params
    plan = make_plan("m", read_config(path), 80 * GiB)
    assert (plan.moe is None) == (family in ("phi3", "gemma3"))
    if plan.moe is not None:
        assert plan.moe.total_params == params


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the fields a plan reads
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "norm_topk_prob": True,
}


def test_moe_active_and_total_parameters_of_qwen3_30b_a3b():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its model card); the experts are most of the weight."""
    plan = make_plan("Qwen3-30B-A3B", QWEN3_30B_A3B, 80 * GiB, bits=4, group_size=128)
    m = plan.moe
    assert (m.experts, m.top_k) == (128, 8)
    assert m.total_params == pytest.approx(30.5e9, rel=0.01)
    assert m.active_params == pytest.approx(3.3e9, rel=0.02)
    assert m.expert_bytes_fp16 == 48 * 128 * 3 * 2048 * 768 * 2
    assert 0.25 < m.expert_bytes_packed / m.expert_bytes_fp16 < 0.3  # 4 bits + scales and zeros per 128
    assert plan.columns[0].weight_bytes_total == 2 * m.total_params


def test_plan_cli_prints_the_moe_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B_A3B))
    code, output = run_cli("plan", config, "--gpu-memory", "80GiB")
    assert code == 0, output
    assert "MoE: 128 experts a layer, 8 per token: 3.3" in " ".join(output.split())
