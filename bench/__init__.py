"""Benchmarks: side-by-side ratios against reference implementations and the machine limits."""
