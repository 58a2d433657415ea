"""Benchmarks: ours and a baseline in the same process, printing the ratio."""
