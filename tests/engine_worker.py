"""An engine process for multi-process tests: one JSON request a line on stdin, one JSON
response a line on stdout. Usage: engine_worker.py MODEL_DIR STORE_DIR [REDIS_URL PREFIX]."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import load_model
from kvstrata.store.tiers.remote import RemoteConfig


def main() -> None:
    model_dir, store_dir = sys.argv[1], sys.argv[2]
    remote = RemoteConfig(sys.argv[3], prefix=sys.argv[4], timeout_s=0.3) if len(sys.argv) > 4 else None
    loaded = load_model(model_dir, progress=False)
    store = KVStore(
        store_dir, loaded.layout(16), model_fingerprint=loaded.fingerprint, config=StoreConfig(remote=remote)
    )
    engine = Engine(loaded, store)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        response = engine.chat(
            request["session"],
            request["messages"],
            max_new_tokens=request["max_new_tokens"],
            priority=request.get("priority", "realtime"),
            use_cache=request.get("use_cache", True),
        )
        print(json.dumps(asdict(response)), flush=True)


if __name__ == "__main__":
    main()
