"""LLM backends: engines with their own continuous batching, adapted to the backend API."""
