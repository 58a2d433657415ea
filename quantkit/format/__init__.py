"""The checkpoint vocabulary, the lowest floor of the package: bit layouts and packing
(`packing`), architecture specs (`arch`), the integer quantization scheme and primitives
(`primitives`), and the AWQ plan file saved beside a checkpoint (`awq_plan`). Everything else
(kernels, model, quant, engine, eval, check) builds on it."""
