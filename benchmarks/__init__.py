"""Reproducible measurements of distune; their results go in BENCHMARKS.md."""
