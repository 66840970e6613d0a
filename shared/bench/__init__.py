"""Benchmarks: `deltaspec bench` runs them side by side (`shared.bench.suite`); some sections also run alone."""
