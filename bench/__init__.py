"""Benchmarks and the crash harness: tools an engineer runs by hand (`make crash`, `make bench`)."""
