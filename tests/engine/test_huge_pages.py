"""The engine's weights moved into transparent huge pages (quantkit.engine.huge_pages): the arena's layout, the THP
mode read from sysfs, every tensor on a moved storage re-pointed (views too) with its values unchanged, the kernel's
own record of the advice (/proc/self/smaps VmFlags "hg"), and an engine decoding the same tokens either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.engine import huge_pages as hp


def _mapping_flags(ptr: int) -> list[str]:
    """VmFlags of the mapping of this process that holds address `ptr` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_storages_lie_end_to_end_at_cache_lines_in_whole_huge_pages():
    offsets, length = hp.arena_offsets([100, 64, 1, 3 * hp.HUGE_PAGE])
    assert offsets == [0, 128, 192, 256]
    assert length == 4 * hp.HUGE_PAGE  # 256 + 3 huge pages, rounded up
    assert hp.arena_offsets([]) == ([], 0)


@pytest.mark.parametrize("text,why", [("always [madvise] never\n", None), ("[always] madvise never\n", None),
                                      ("always madvise [never]\n", "off (mode never)")])
def test_the_thp_mode_is_read_from_sysfs(tmp_path, text, why):
    f = tmp_path / "enabled"
    f.write_text(text)
    got = hp.thp_unavailable(f)
    assert got is None if why is None else why in got
    assert "unreadable" in hp.thp_unavailable(tmp_path / "missing")


@dataclasses.dataclass
class _Packed:  # as a repacked weight: a dataclass of tensors held in a module's attribute
    codes: torch.Tensor
    rows: list


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(512, 512), requires_grad=False)  # 1 MiB
        self.register_buffer("small", torch.arange(10.0))
        stacked = torch.randint(0, 255, (4, 256, 1024), dtype=torch.uint8)  # 1 MiB, viewed per expert
        self.packed = _Packed(stacked, [stacked[e] for e in range(4)])


def test_moved_storages_keep_values_views_and_sharing():
    m = _Holder()
    before = {n: t.clone() for n, t in (("weight", m.weight), ("stacked", m.packed.codes), ("e2", m.packed.rows[2]))}
    small_ptr = m.small.data_ptr()
    got = hp.move_to_huge_pages(m, min_bytes=1 << 19)
    if got.skipped:  # a machine without THP: nothing moved, said why
        assert got.moved_bytes == 0 and m.small.data_ptr() == small_ptr
        pytest.skip(got.skipped)
    assert got.storages == 2 and got.moved_bytes == 2 * 1024**2
    assert torch.equal(m.weight, before["weight"]) and isinstance(m.weight, torch.nn.Parameter)
    assert torch.equal(m.packed.codes, before["stacked"]) and torch.equal(m.packed.rows[2], before["e2"])
    # the views still view their base: one storage, the expert's rows at its offset
    base = m.packed.codes.untyped_storage().data_ptr()
    assert all(r.untyped_storage().data_ptr() == base for r in m.packed.rows)
    assert m.packed.rows[2].data_ptr() == m.packed.codes.data_ptr() + 2 * 256 * 1024
    assert m.small.data_ptr() == small_ptr  # under min_bytes: left where it was
    assert "hg" in _mapping_flags(m.weight.data_ptr())  # the kernel holds the advice for the arena
    m.packed.rows[1].add_(1)  # writes through a view reach the base: shared, not copied apart
    assert torch.equal(m.packed.codes[1], before["stacked"][1] + 1)


def test_storages_of_skipped_modules_stay_even_when_shared():
    class Table(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = w

    w = torch.randn(1024, 512)  # 2 MiB
    outer = torch.nn.Module()
    outer.table, outer.head = Table(w), torch.nn.Linear(512, 1024, bias=False)
    outer.head.weight = torch.nn.Parameter(w, requires_grad=False)  # tied to the skipped table
    ptr = w.data_ptr()
    got = hp.move_to_huge_pages(outer, skip=(Table,))
    assert outer.head.weight.data_ptr() == ptr and outer.table.weight.data_ptr() == ptr
    assert got.moved_bytes == 0


def test_an_engine_with_its_weights_in_huge_pages_decodes_the_same(tmp_path):
    """A 4-bit checkpoint (the repacked int4 weights are plain tensors; oneDNN's prepacked float ones are opaque and
    stay): greedy tokens equal with and without, and every large storage the engine holds and its KV cache in an
    advised mapping."""
    from quantkit.engine import LLM, SamplingParams
    from quantkit.engine.weights import MappedEmbedding
    from tests_support.cli import run_cli
    from tests_support.tiny_models import make_tiny_model

    dense = make_tiny_model(tmp_path / "m", hidden=1024, intermediate=4096, heads=8, kv_heads=4)
    model = tmp_path / "q"
    code, output = run_cli("quantize", dense, "--out", model, "--method", "rtn", "--group-size", "128")
    assert code == 0, output
    prompts = [[5, 17, 300, 400], [9, 9, 80]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = LLM(str(model), dtype="float32", max_model_len=128, max_num_seqs=4, cpu_huge_pages=on)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        moved = llm.engine.huge_pages
        if not on:
            assert moved.skipped == "--no-cpu-huge-pages"
        elif moved.skipped is None:
            kept = {t.data_ptr() for t in hp.weight_tensors(llm.engine.model, skip=(MappedEmbedding,))}
            large = [t for t in hp.weight_tensors(llm.engine.model)
                     if t.untyped_storage().nbytes() >= hp.MIN_BYTES and t.data_ptr() not in kept]
            assert large and moved.moved_bytes >= 2 * 4096 * 1024 // 2  # gate|up of a layer, 4 bits a weight
            assert all("hg" in _mapping_flags(t.data_ptr()) for t in large)
            assert kept and not any("hg" in _mapping_flags(p) for p in kept)  # the mapped table: the file's pages
            assert all("hg" in _mapping_flags(t.data_ptr()) for kv in llm.engine.runner.kv_caches for t in kv)
        else:
            assert hp.thp_unavailable() is not None and moved.moved_bytes == 0
    assert outs[True] == outs[False]


def test_a_bandwidth_buffer_in_huge_pages():
    if (why := hp.thp_unavailable()) is not None:
        with pytest.raises(RuntimeError, match="huge pages|MADV_HUGEPAGE"):
            hp.huge_page_buffer(1 << 20)
        pytest.skip(why)
    buf = hp.huge_page_buffer(3 * hp.HUGE_PAGE + 64)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * hp.HUGE_PAGE + 64 and int(buf.sum()) == 0
    assert "hg" in _mapping_flags(buf.data_ptr())


def test_kv_cache_tensors_in_huge_pages_are_zeroed_apart_and_writable():
    from quantkit.engine.model_runner import kv_tensors

    shape = (40, 16, 2, 64)  # 80 KiB of bf16 each: several to a huge page
    cpu = torch.device("cpu")
    plain = kv_tensors(shape, torch.bfloat16, cpu, 6, huge_pages=False)  # torch's own (its heap may be advised too)
    assert len({t.data_ptr() for t in plain}) == 6 and not any(t.any() for t in plain)
    if (why := hp.thp_unavailable()) is not None:
        pytest.skip(why)
    caches = kv_tensors(shape, torch.bfloat16, cpu, 6, huge_pages=True)
    assert len(caches) == 6 and all(t.shape == shape and t.dtype == torch.bfloat16 for t in caches)
    assert all(t.is_contiguous() and t.data_ptr() % hp.ALIGN == 0 and not t.any() for t in caches)
    assert all("hg" in _mapping_flags(t.data_ptr()) for t in caches)
    for i, t in enumerate(caches):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(caches))  # no two overlap
