"""A checkpoint quantized with --quantize-lm-head, loaded by the engine: lm_head runs packed, and greedy
decoding equals the dequantized reference (every packed linear, lm_head included, as a float nn.Linear in
transformers). A bf16 checkpoint's embedding table is read in place and its float lm_head stays bf16 in an fp32
engine, losslessly. And `cpu_int8_lm_head` holds a float head in int8, tied or not."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("cpu_level")  # every test at each CPU level this machine runs (conftest.py)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lm_head_dir(tiny_llama, tmp_path_factory):
    from tests_support.cli import run_cli

    out = tmp_path_factory.mktemp("lmhead") / "ckpt"
    code, output = run_cli("quantize", tiny_llama, "--out", out, "--method", "rtn", "--group-size", "64",
                           "--quantize-lm-head")
    assert code == 0, output
    return out


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [[1] + torch.randint(3, 512, (1 + (11 * i) % 40,), generator=g).tolist() for i in range(12)]


def _dequantized_reference(ckpt):
    """The checkpoint in transformers with every QuantLinear replaced by a float nn.Linear of its weight."""
    from quantkit.format.arch import get_submodule
    from quantkit.format.packing import dequantize
    from quantkit.model.loader import load_model
    from quantkit.model.quant_linear import QuantLinear

    hf, _ = load_model(ckpt, torch.float32)
    for name, m in [(n, m) for n, m in hf.named_modules() if isinstance(m, QuantLinear)]:
        linear = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        linear.weight.data = dequantize(m.packed(), torch.float32)
        if m.bias is not None:
            linear.bias.data = m.bias.float()
        parent, _, attr = name.rpartition(".")
        setattr(get_submodule(hf, parent) if parent else hf, attr, linear)
    return hf


def _greedy_hf(hf, prompts):
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                   do_sample=False)[0, len(p):].tolist())
    return out


def test_quantized_lm_head_round_trip(lm_head_dir):
    from quantkit.engine.weights import WeightMemory
    from quantkit.model.quant_linear import QuantLinear

    qc = json.loads((lm_head_dir / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True and qc["quant_method"] == "gptq"
    llm = LLM(str(lm_head_dir), dtype="float32", max_model_len=256, max_num_seqs=12, cpu_int8_prefill=False)
    model = llm.engine.model
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.cpu_path.startswith("int4")
    memory = WeightMemory.of(model)
    assert memory.lm_head == model.lm_head.weight_bytes() and "lm_head" in memory.parts and "packed" in memory.parts
    # a decode token reads every module's weights but the embedding table's (one row of it): the packed lm_head too
    def own_bytes(m):  # a module's own tensors, not its children's; a packed linear's packed form
        if isinstance(m, QuantLinear):
            return m.weight_bytes()
        return sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])

    read = sum(own_bytes(m) for n, m in model.named_modules() if not n.endswith("embed_tokens"))
    assert memory.read_per_token == read > memory.lm_head > 0
    prompts = _prompts()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    assert got == _greedy_hf(_dequantized_reference(lm_head_dir), prompts)


def test_bf16_embedding_table_stays_bf16_and_is_lossless(tiny_llama, tmp_path):
    from quantkit.engine.weights import MappedEmbedding, WeightMemory
    from quantkit.kernels.bf16_cpu import Bf16Linear, unavailable
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    for f in tiny_llama.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, max_num_seqs=12)
    model = llm.engine.model
    assert isinstance(model.model.embed_tokens, MappedEmbedding)  # the untied table, read in place
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.float32
    memory = WeightMemory.of(model)
    assert memory.embedding == 0 and "embedding memory-mapped from the checkpoint (0.1 MiB bfloat16" in memory.parts
    # the mapped table is counted in the bf16 size the ratio is taken against, and nowhere in the resident bytes
    assert memory.bf16_equivalent >= 2 * (model.model.embed_tokens.weight.numel() + sum(p.numel() for p in model.parameters()))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = _prompts()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data.float()  # the fp32 table
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if unavailable() is None:  # the float lm_head of a bf16 checkpoint runs bf16 through the kernel
        assert isinstance(model.lm_head, Bf16Linear) and model.lm_head.weight.dtype == torch.bfloat16
        assert "lm_head 0.1 MiB bfloat16" in memory.parts
        fp32 = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        fp32.weight.data = model.lm_head.weight.float()
        model.lm_head = fp32  # the fp32 reference: same greedy tokens
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _bf16_copy(src, dst, tie: bool):
    """The checkpoint at `src` saved in bf16 at `dst` (its tokenizer beside), with lm_head tied to the embedding
    or its own copy."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    if tie:
        hf.config.tie_word_embeddings = True
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (dst / f.name).write_bytes(f.read_bytes())
    return hf


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tie", [False, True])
def test_int8_lm_head(tiny_llama, tmp_path, tie, dtype):
    from quantkit.engine.weights import MappedEmbedding, WeightMemory
    from quantkit.kernels.int8_cpu import Int8Linear, int8_head_unavailable, pack_int8

    compute = getattr(torch, dtype)
    if (why := int8_head_unavailable(torch.device("cpu"), compute)) is not None:
        pytest.skip(why)
    hf = _bf16_copy(tiny_llama, tmp_path, tie)
    head = hf.lm_head.weight.detach()
    llm = LLM(str(tmp_path), dtype=dtype, max_model_len=256, max_num_seqs=12, cpu_int8_lm_head=True)
    model = llm.engine.model
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.embed_tokens, MappedEmbedding)
    # the head is the checkpoint's, rounded to int8 per row and group of 128 columns
    expected = pack_int8(head, 128)
    head8 = model.lm_head
    assert torch.equal(head8.packed, expected.packed) and torch.equal(head8.scales, expected.scales)
    assert torch.equal(head8.wsum, expected.wsum) and head8.group_size == 128
    memory = WeightMemory.of(model)
    assert memory.lm_head == model.lm_head.weight_bytes() and "int8" in memory.parts and memory.embedding == 0
    assert memory.read_per_token == memory.resident  # the mapped table is not resident, the int8 head read whole
    if compute == torch.bfloat16:
        assert memory.resident < memory.bf16_equivalent - 2 * head.numel() - head.numel() // 2
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    # against the float head on hidden states of the final norm's scale: each logit moves by at most
    # sum_k |h_k| * s_k / 2, and the int8 head's greedy token is the float argmax or within 0.1 of it
    h = torch.randn(64, head.shape[1], generator=torch.Generator().manual_seed(0)).to(compute)
    got, want = model.lm_head(h), h.float() @ head.float().T
    assert got.dtype == torch.float32 and model.lm_head.fp32_out  # the logits as the kernel sums them, unrounded
    scales = expected.scales.permute(0, 2, 1).reshape(-1, head.shape[1] // 128)[: head.shape[0]]  # [N, G]
    bound = (h.float().abs().reshape(64, -1, 128).sum(-1) @ scales.T) / 2  # [64, N]
    rounding = want.abs() / 2 ** 15  # x's 16 bits
    assert bool(((got - want).abs() <= bound + rounding + 1e-3).all())
    picked = want.gather(1, got.float().argmax(1, keepdim=True)).squeeze(1)
    assert bool((picked >= want.max(1).values - 0.1).all())


@pytest.fixture(scope="module")
def rtn_dir(tiny_llama, tmp_path_factory):
    from tests_support.cli import run_cli

    out = tmp_path_factory.mktemp("rtn") / "ckpt"
    code, output = run_cli("quantize", tiny_llama, "--out", out, "--method", "rtn", "--group-size", "64")
    assert code == 0, output
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_quantized_checkpoints_float_head_is_int8_by_default(rtn_dir, tiny_llama, tmp_path, dtype):
    from quantkit.engine.weights import WeightMemory
    from quantkit.kernels.int8_cpu import Int8Linear, int8_head_unavailable

    if (why := int8_head_unavailable(torch.device("cpu"), getattr(torch, dtype))) is not None:
        pytest.skip(why)
    default = LLM(str(rtn_dir), dtype=dtype, max_model_len=256, max_num_seqs=4).engine.model
    kept = LLM(str(rtn_dir), dtype=dtype, max_model_len=256, max_num_seqs=4, cpu_int8_lm_head=False).engine.model
    assert isinstance(default.lm_head, Int8Linear) and not isinstance(kept.lm_head, Int8Linear)
    assert WeightMemory.of(default).resident < WeightMemory.of(kept).resident
    _bf16_copy(tiny_llama, tmp_path, tie=False)  # a float checkpoint keeps its float head unless asked
    assert not isinstance(LLM(str(tmp_path), dtype=dtype, max_model_len=256).engine.model.lm_head, Int8Linear)


def test_int8_head_wanted_where_asked_or_by_default_for_quantized_checkpoints(caplog):
    from quantkit.engine.weights import int8_head_wanted
    from quantkit.kernels.int8_cpu import int8_head_unavailable

    cpu, gpu, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    here = int8_head_unavailable(cpu, bf16, 64) is None
    assert int8_head_wanted(None, True, cpu, bf16, 64) is here and int8_head_wanted(True, False, cpu, bf16, 64) is here
    assert not int8_head_wanted(None, False, cpu, bf16, 64) and not int8_head_wanted(False, True, cpu, bf16, 64)
    caplog.clear()  # asking for it where it cannot run (above, at a level without the kernel) warns; the default not
    with caplog.at_level("WARNING", logger="quantkit.engine"):
        assert not int8_head_wanted(None, True, gpu, bf16, 64)
        assert caplog.text == ""  # the default is silent where the kernel cannot run
        assert not int8_head_wanted(True, True, gpu, bf16, 64)
    assert "lm_head: kept in float (the int8 lm_head runs on CPU in bfloat16 or float32" in caplog.text


def test_int8_prefill_wanted_where_asked_or_by_default_without_amx(caplog):
    """EngineConfig.cpu_int8_prefill: None follows the CPU (linear_choice.prompt_q8_not_default: bf16 without AMX
    tiles, fp32 wherever the AVX2 W4A8 kernel builds), True asks (and warns where it cannot be), False and W4A8
    throughout leave nothing to split, a float checkpoint neither."""
    from quantkit.engine.weights import int8_prefill_wanted
    from quantkit.kernels import int4_cpu
    from quantkit.kernels.linear_choice import prompt_q8_not_default, prompt_q8_unavailable

    bf16, fp32 = torch.bfloat16, torch.float32
    for dtype in (bf16, fp32):
        assert int8_prefill_wanted(None, False, True, dtype) is (prompt_q8_not_default(dtype) is None)
        assert int8_prefill_wanted(True, False, True, dtype) is (prompt_q8_unavailable(dtype) is None)
        assert not int8_prefill_wanted(False, False, True, dtype) and not int8_prefill_wanted(True, True, True, dtype)
    assert (prompt_q8_unavailable(fp32) is None) == (int4_cpu.unavailable() is None)  # fp32: every level
    assert "no int8-activation kernel takes float16" in prompt_q8_unavailable(torch.float16)
    caplog.clear()
    with caplog.at_level("WARNING", logger="quantkit.engine"):
        assert not int8_prefill_wanted(None, False, False, bf16) and not int8_prefill_wanted(None, False, True,
                                                                                               torch.float16)
        assert caplog.text == ""  # the default is silent where it does not apply
        assert not int8_prefill_wanted(True, False, True, torch.float16)
        assert not int8_prefill_wanted(True, False, False, bf16)
    assert "no int8-activation kernel takes float16" in caplog.text and "no quantized linears" in caplog.text
