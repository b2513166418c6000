"""Benchmarks: `atom bench throughput` (offline engine) and `atom bench serve` (any OpenAI server).

`datasets` builds the requests, `metrics` holds the arithmetic, `cli.add_parser` registers both.
"""
