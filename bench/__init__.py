"""Benchmarks of the whole request path (latency, throughput), run as `python -m bench.<name>`."""
