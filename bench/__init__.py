"""Benchmarks, run as ``.venv/bin/python bench/<name>.py``; results in docs/benchmarks.md."""
