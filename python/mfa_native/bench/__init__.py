"""Benchmarks: each module has main(argv) -> int and prints a table."""
