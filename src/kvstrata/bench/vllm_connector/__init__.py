"""Time to first token of vLLM's OpenAI server with kvstrata's connector against vLLM without it.
Not a ``kvstrata bench`` suite: it runs in vLLM's own virtual environment
(``python -m kvstrata.bench.vllm_connector``); see :mod:`.runner`."""
