"""Benchmarks: `deltaspec bench` runs them side by side (`deltaspec.shared.bench.suite`); some sections also run
alone."""
