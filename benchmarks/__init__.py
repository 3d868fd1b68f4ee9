"""Benchmarks of shardfusion against PyTorch's own data-parallel wrappers (see benchmarks/README.md)."""
