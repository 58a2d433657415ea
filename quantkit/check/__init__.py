"""`quantkit check`: a packed checkpoint's structure read from its shards (structure), then every packed linear's
outputs on real inputs (inputs) against an independent dequantization, the W4A16 kernels and, given the original,
its float linears (compare); checkpoint.check_checkpoint runs them and reports per layer."""
