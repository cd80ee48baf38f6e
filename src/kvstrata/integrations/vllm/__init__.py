"""kvstrata as a vLLM KV connector (``KVStrataConnector``); see docs/vllm.md.

``vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStrataConnector",
"kv_connector_module_path": "kvstrata.integrations.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"store_dir": "/var/lib/kvstrata"}}'``

Importing this package imports vLLM; :mod:`kvstrata.integrations.vllm.config` does not.
"""

from kvstrata.integrations.vllm.connector import KVStrataConnector

__all__ = ["KVStrataConnector"]
