"""Bridges between kvstrata and inference frameworks (transformers, vLLM)."""
