"""Benchmarks and load drivers that talk to a real server over HTTP."""
