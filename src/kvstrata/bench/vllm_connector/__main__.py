"""``python -m kvstrata.bench.vllm_connector``: run the suite (see :mod:`.runner`)."""

from kvstrata.bench.vllm_connector.runner import main

main()
