"""Run one vLLM engine (one process) on a local model and report what happened, as JSON.

``python vllm_job.py SPEC.json OUT.json``; SPEC is ``{"phases": [...]}``, each phase one engine,
started after the previous one was shut down, with ``model``, ``connector`` (null, "kvstrata" or
"example"), ``extra_config`` (kv_connector_extra_config) and ``rounds``: lists of requests
``{"prompt_token_ids": [...], "max_tokens": n, "cache_salt": optional}``, each round one
``generate`` call (so a round's saves are done before the next round is scheduled). OUT gets, per
phase and request, the greedy output token ids and vLLM's ``num_cached_tokens``, plus the kvstrata
connector's event log of that phase. Nothing is fetched from any hub (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if spec.get("connector") == "kvstrata":
        kv_transfer = KVTransferConfig(
            kv_connector="KVStrataConnector",
            kv_connector_module_path="kvstrata.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec.get("extra_config", {}),
        )
    elif spec.get("connector") == "example":
        kv_transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_path"]},
        )
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=spec.get("max_model_len", 4096),
        seed=0,
        kv_transfer_config=kv_transfer,
    )


def shutdown(llm) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def run_phase(spec: dict) -> dict:
    from vllm import SamplingParams

    from kvstrata.integrations.vllm.events import EVENTS

    EVENTS.reset()  # a fresh log per phase
    started = time.perf_counter()
    llm = make_llm(spec)
    result: dict = {"start_s": time.perf_counter() - started, "rounds": []}
    for round_requests in spec["rounds"]:
        prompts, params = [], []
        for req in round_requests:
            prompt = {"prompt_token_ids": req["prompt_token_ids"]}
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            prompts.append(prompt)
            max_tokens = req.get("max_tokens", 8)
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["rounds"].append(
            [
                {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                for o in outputs
            ]
        )
    shutdown(llm)  # closes the kvstrata store: queued L3/L4 writes are flushed
    del llm
    gc.collect()
    result["events"] = EVENTS.snapshot()
    return result


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = [run_phase(phase) for phase in spec["phases"]]
    with open(sys.argv[2], "w") as f:
        json.dump({"phases": results}, f)


if __name__ == "__main__":
    main()
