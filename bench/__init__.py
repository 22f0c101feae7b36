"""Benchmarks: scripts that print figures (never pass/fail tests)."""
