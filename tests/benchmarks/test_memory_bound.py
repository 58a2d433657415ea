"""The layer-by-layer bound, end to end: peak RSS of `quantkit quantize` does not grow with depth.

Two random Llamas that differ only in depth (2 and 8 layers of hidden 768, 12 MiB of bf16 per
layer) are quantized in child processes, which report their own peak RSS. Were the source pages,
the output shards or a layer's tensors kept alive, every added layer would add at least its bf16
size to the peak; the bound allows half of it (the peak of one run moves by a few MiB from run to
run, so the growth is taken over six added layers).

`quantize` runs with --low-memory (glibc's mmap threshold fixed at 1 MiB, so freed tensors go back
to the system at once; on by default only from 1 GiB of fp32 weights, so these small models pass it);
with --no-low-memory the peak also creeps with depth
through heap fragmentation (docs/BENCHMARKS.md has both).
"""

import pytest

from memory import growth_per_layer_gib, layer_params, measure
from quantkit.calibration.synthetic import make_corpus

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
             vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_number_of_layers(tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n\n".join(make_corpus(200)))
    common = ["--group-size", "128", "--calib", str(calib), "--nsamples", "2", "--seqlen", "64", "--low-memory"]
    _, runs = measure(tmp_path, [2, 8], ["rtn", "gptq"], common, threads=1, shape=SHAPE)
    one_layer_bf16_gib = 2 * layer_params(SHAPE) / 1024**3
    for method, by_depth in runs.items():
        growth = growth_per_layer_gib(by_depth)
        assert growth < 0.5 * one_layer_bf16_gib, (
            f"{method}: peak RSS grows {growth * 1024:.1f} MiB per layer "
            f"(one layer is {one_layer_bf16_gib * 1024:.1f} MiB in bf16): {by_depth}")
