"""Real-shape random checkpoints (quantkit.bench.real_shapes): the published parameter counts, a toy shape written in
several shards and read back by transformers and by the engine, and the bandwidth measure."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.bench import real_shapes as rs

TOY = rs.RealShape("toy", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=4500, tied=False,
                   max_position=512)


def test_the_shapes_have_the_published_parameter_counts():
    assert round(rs.num_parameters(rs.SHAPES["llama-3.2-1b"]) / 1e9, 2) == 1.24  # Llama 3.2 1B: 1.24 B, tied
    assert round(rs.num_parameters(rs.SHAPES["llama-3.1-8b"]) / 1e9, 2) == 8.03  # Llama 3.1 8B: 8.03 B


def test_a_toy_shape_is_written_in_shards_and_loads_in_transformers_and_the_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit.engine import LLM, SamplingParams

    out = rs.build(TOY, tmp_path / "toy", shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert set(index["weight_map"]) == {name for name, _ in rs.tensor_shapes(TOY)}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200, 4000]])).logits[0, -1]
    assert logits.shape == (TOY.vocab,) and 0.1 < float(logits.std()) < 5  # far from flat
    outs = LLM(str(out), max_model_len=64, dtype="float32").generate([[1, 5, 9, 200, 4000]],
                                                                      SamplingParams(temperature=0, max_tokens=4))
    assert outs[0].outputs[0].token_ids[0] == int(logits.argmax())
    assert rs.build(TOY, out) == out  # reused, not rewritten
    assert not list(tmp_path.glob(".toy.tmp-*"))


def test_the_8b_shape_cut_to_2_layers_keeps_its_embeddings_and_layer_shapes():
    full, cut = rs.SHAPES["llama-3.1-8b"], rs.with_layers(rs.SHAPES["llama-3.1-8b"], 2)
    assert cut.name == "llama-3.1-8b-2layers" and rs.hf_config(cut)["num_hidden_layers"] == 2
    tensors = dict(rs.tensor_shapes(cut))
    assert {n.split(".")[2] for n in tensors if n.startswith("model.layers.")} == {"0", "1"}
    assert tensors["lm_head.weight"] == tensors["model.embed_tokens.weight"] == (128256, 4096)
    assert tensors["model.layers.1.mlp.down_proj.weight"] == (4096, 14336)
    per_layer = (rs.num_parameters(full) - rs.num_parameters(rs.with_layers(full, 1))) / 31
    assert rs.num_parameters(cut) == rs.num_parameters(full) - 30 * per_layer  # 2 of the full shape's 32 layers
    assert rs.with_layers(full, None) is full


@pytest.mark.parametrize("layers", [0, 33])
def test_a_layer_count_the_shape_does_not_have_is_refused_in_one_line(layers):
    with pytest.raises(SystemExit, match="has 1 to 32 decoder layers"):
        rs.with_layers(rs.SHAPES["llama-3.1-8b"], layers)


def test_a_cut_toy_shape_is_written_to_its_own_folder_with_that_many_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    cut = rs.with_layers(TOY, 1)
    out = rs.build(cut, tmp_path / cut.name)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert out.name == "toy-1layers" and model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if n.startswith("model.layers.1.")]


def test_the_tokenizer_covers_the_vocabulary():
    tok = rs.padded_tokenizer(4500)
    assert len(tok) == 4500 and tok.eos_token_id == 2


def test_bandwidth_is_a_plausible_rate():
    assert 1e8 < rs.read_bandwidth(threads=1, gib=0.25, repeats=2, loop="sum") < 1e13


def test_the_bandwidth_command_prints_each_loop_and_the_kernels_distances(capsys):
    from quantkit.kernels import stream_read

    rs.main(["bandwidth", "--threads", "1", "--gib", "0.125", "--repeats", "1"])
    from quantkit.engine.huge_pages import thp_unavailable

    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all("4 KiB pages" in x for x in out[:2]) and all("huge pages" in x for x in out[2:])
    assert "torch's fp32 sum: " in out[1] and out[1].endswith("GB/s")
    assert out[3].endswith("GB/s") if thp_unavailable() is None else thp_unavailable() in out[3]
    for line in (out[0], out[2]):
        if stream_read.unavailable() is not None or ("huge" in line and thp_unavailable() is not None):
            assert "not measured" in line
        else:
            assert "prefetch none " in line and "4 KiB ahead " in line and "8 KiB ahead " in line


@pytest.mark.slow
def test_the_4_bit_path_is_greedy_exact_at_the_1b_shape(tmp_path):
    """Llama-3.2-1B's shape (hidden 2048, 32/8 heads, intermediate 8192, vocab 128256, tied, Llama 3.1 RoPE) cut to
    2 layers, quantized to 4 bits (RTN g128, GPTQ layout): the engine's greedy tokens are those of the same checkpoint
    through QuantLinear in transformers (the reference), in fp32 with the float head; with the int8 lm_head (the
    default, fp32 or bf16) the first token agrees for all but near-ties."""
    import dataclasses

    from quantkit.bench.engine_vs_vllm import make_gptq
    from quantkit.engine import LLM, SamplingParams
    from quantkit.model.loader import load_model

    shape = dataclasses.replace(rs.SHAPES["llama-3.2-1b"], name="1b-2-layers", layers=2)
    gptq = make_gptq(rs.build(shape, tmp_path / "float"), tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, shape.vocab, (n,), generator=g).tolist() for n in (7, 33, 64, 100)]
    hf, info = load_model(gptq, torch.float32)
    assert info is not None and info.layout == "gptq"
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=8, do_sample=False)[0, len(p):].tolist() for p in prompts]
    del hf
    params = SamplingParams(temperature=0, max_tokens=8)
    got = LLM(str(gptq), dtype="float32", max_model_len=128, max_num_seqs=4, cpu_int8_lm_head=False
              ).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    int8_head = LLM(str(gptq), dtype="float32", max_model_len=128, max_num_seqs=4).generate(prompts, params)
    assert sum(o.outputs[0].token_ids[0] == w[0] for o, w in zip(int8_head, want)) >= 3  # the default: int8 lm_head
    bf16 = LLM(str(gptq), dtype="bfloat16", max_model_len=128, max_num_seqs=4).generate(prompts, params)
    assert sum(o.outputs[0].token_ids[0] == w[0] for o, w in zip(bf16, want)) >= 3
