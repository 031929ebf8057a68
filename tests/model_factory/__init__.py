"""Builders of small test models (written as Triton model directories) shared by tests, benchmarks and examples."""
