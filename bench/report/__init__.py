"""Markdown rendering of a results document (docs/benchmarks.md in full mode)."""
