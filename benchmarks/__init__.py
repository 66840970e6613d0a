"""Benchmarks: `deltaspec bench` runs them side by side (`benchmarks.suite`); some sections also run
alone."""
