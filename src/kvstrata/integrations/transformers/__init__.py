"""kvstrata for Hugging Face transformers: model loading, the tiered cache, the attention hook.

Import the submodules directly; this package imports nothing so that it stays cheap to import.
"""
