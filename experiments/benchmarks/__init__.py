"""Benchmark scripts: speed numbers live here (JSON + markdown), never in timed tests."""
