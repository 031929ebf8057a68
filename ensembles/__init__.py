"""Ensemble scheduling: pipelines whose steps are other models."""
