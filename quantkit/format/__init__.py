"""The checkpoint vocabulary, the lowest floor of the package: bit layouts and packing
(`packing`), architecture specs (`arch`), and the integer quantization scheme and primitives
(`primitives`). Everything else (kernels, model, quant, engine, eval, check) builds on it."""
