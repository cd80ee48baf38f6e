"""One context length of ``kvstrata bench restore``: the session committed once, the stores opened
per path, the raw baselines' files and buffers, and one timed sample of any variant (the suite:
:mod:`.runner`)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.bench.common.hardware import (
    cold_parallel_read_s,
    cold_sequential_read_s,
    drop_page_cache,
    drop_store_page_cache,
    memcpy_s,
    overwrite_fsync,
    store_data_bytes,
    store_data_files,
    write_baseline_file,
    write_fsync_s,
)
from kvstrata.bench.common.stores import Restorer, bench_config, commit_session, open_store, room_for
from kvstrata.bench.restore.report import (
    CHECKPOINT,
    L1,
    L2,
    L3,
    L3_LOSSY,
    MEMCPY,
    PAR_READ,
    RECOMPUTE,
    SEQ_READ,
    WRITE_FSYNC,
)

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

IN_FLIGHT = 8
"""Reads in flight in the parallel cold-read baseline."""


class Context:
    """One context length's stores and baselines: the session committed once (exact, and under the
    default ladder with ``lossy``), opened per path; the raw baselines' files and buffers."""

    def __init__(
        self, loaded: LoadedModel, token_ids: list[int], kv: torch.Tensor, root: Path, *, lossy: bool
    ):
        import numpy as np
        import torch

        from kvstrata.integrations.transformers.cache import layer_devices

        self.loaded, self.kv, self.root = loaded, kv, root
        self.history, self.new_token = token_ids[:-1], token_ids[-1]
        self.nbytes = nbytes = kv.numel() * kv.element_size()
        self.roots = {L3: root / "exact", **({L3_LOSSY: root / "lossy"} if lossy else {})}
        with open_store(loaded, self.roots[L3], bench_config(room_for(nbytes))) as store:
            commit_session(store, self.history, kv)
        if lossy:
            with open_store(
                loaded, self.roots[L3_LOSSY], bench_config(room_for(nbytes), ladder="default")
            ) as store:
                commit_session(store, self.history, kv, priority="interactive")
        self.disk_bytes = {path: store_data_bytes(r) for path, r in self.roots.items()}
        configs = {
            L1: bench_config(room_for(nbytes), 0),
            L2: bench_config(0, room_for(nbytes)),
            L3: bench_config(0, 0),
            L3_LOSSY: bench_config(0, 0, ladder="default"),
        }
        self.stores = {
            path: open_store(loaded, self.roots.get(path, self.roots[L3]), configs[path], read_only=True)
            for path in (L1, L2, L3, *([L3_LOSSY] if lossy else []))
        }
        devices = layer_devices(loaded.model)
        spare: list[Any] = []  # one restore buffer, recycled from request to request (as the engine)
        self.restorers = {path: Restorer(store, devices, spare=spare) for path, store in self.stores.items()}
        self.data_files = store_data_files(self.roots[L3])
        self.baseline = write_baseline_file(root / "baseline.bin", nbytes)
        self.read_buffer = np.ones(max(nbytes, self.disk_bytes[L3]), dtype=np.uint8)  # paged in
        self.src = kv.reshape(-1).view(torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # first touch of the pages, outside the timings
        self.checks: dict[str, dict[str, Any]] = {}
        self.logits: dict[str, torch.Tensor] = {}

    def warm(self) -> None:
        """Put the blocks in the memory tiers: one load promotes them from L3."""
        for path in (L1, L2):
            restorer = self.restorers[path]
            restorer.recycle(restorer.restore(build_cache=False))

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def measure(self, variant: str, repeat: int) -> dict[str, float]:
        """One sample of ``variant``: a resumed request, a recompute, a checkpoint or a baseline."""
        import torch

        with torch.inference_mode():
            if variant in self.stores:
                if variant in (L3, L3_LOSSY):
                    drop_store_page_cache(self.roots[variant])
                return self._resumed_request(variant)
            if variant == RECOMPUTE:
                started = time.perf_counter()
                ids = torch.tensor(
                    [[*self.history, self.new_token]], dtype=torch.long, device=self.loaded.model.device
                )
                logits = (
                    self.loaded.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].float()
                )
                int(logits.argmax())
                elapsed = time.perf_counter() - started
                self.logits.setdefault(variant, logits)
                return {"ttft_s": elapsed}
            if variant in (CHECKPOINT, WRITE_FSYNC):
                self._wake_disk_writes()
            if variant == CHECKPOINT:
                path = self.root / f"checkpoint-{repeat}"
                try:
                    with open_store(self.loaded, path, bench_config(0, 0)) as store:
                        return {"seconds": commit_session(store, self.history, self.kv).checkpoint_s}
                finally:
                    shutil.rmtree(path, ignore_errors=True)
        if variant == MEMCPY:
            return {"seconds": memcpy_s(self.src, self.dst)}
        if variant == SEQ_READ:
            return {"seconds": cold_sequential_read_s(self.baseline, self.read_buffer[: self.nbytes])}
        if variant == PAR_READ:
            return {"seconds": cold_parallel_read_s(self.data_files, self.read_buffer, in_flight=IN_FLIGHT)}
        if variant == WRITE_FSYNC:
            return {"seconds": write_fsync_s(self.root / "write-fsync.bin", self.src.numpy())}
        raise AssertionError(f"unknown variant {variant}")

    def _wake_disk_writes(self) -> None:
        """Put the disk and the memory in the same state before each timed write (the checkpoint
        or its baseline): write and fsync the same bytes once, untimed, over a kept file, then
        drop that file's pages.

        The write: this VM's disk writes 3-5x slower after idling a second or two (94 MB
        write+fsync: 180-500 ms after 2 s idle, 50-60 ms back to back), so without it each sample
        fell into the slow or the fast mode at random. Over a kept file, because a file removed
        here would free its blocks in the journal commit that the timed write waits for.

        The drop: the VM hands free memory back to its host about 2 s after it is freed (free
        page reporting), and the page cache a write fills comes from free memory: memory freed
        moments before is ready, memory handed back faults page by page (a 2.9 MB record took
        5.4 ms of CPU to write instead of 0.7). In the rotation, write+fsync came right after the
        checkpoint had freed its pages and wrote into them; the checkpoint came after reads that
        had taken back what they freed, and every other record of it was slow (0.42-0.6x in
        three runs). The bytes freed here leave both the same ready memory."""
        kept = self.root / "wake-up.bin"
        overwrite_fsync(kept, self.src.numpy())
        drop_page_cache([kept])  # on each CPU: the checkpoint's writer thread runs on either

    def _resumed_request(self, path: str) -> dict[str, float]:
        """One resumed request: restore the session, forward the new token, pick the first token;
        the first one of each path also checks which tier served it and that its KV is exact."""
        import torch

        restorer = self.restorers[path]
        restored = restorer.restore()
        forward_started = time.perf_counter()
        ids = torch.tensor([[self.new_token]], dtype=torch.long, device=self.loaded.model.device)
        out = self.loaded.model(input_ids=ids, cache=restored.cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        int(logits.argmax())
        forward_s = time.perf_counter() - forward_started
        if path not in self.checks:
            kv = restored.loaded.kv
            self.checks[path] = {
                "served_by": {level.name: count for level, count in restored.loaded.tokens_by_tier.items()},
                "kv_bit_exact": bool(kv is not None and torch.equal(kv, self.kv)),
            }
            self.logits[path] = logits
        restorer.recycle(restored)
        return {
            "ttft_s": restored.restore_s + forward_s,
            "load_s": restored.load_s,
            "restore_s": restored.restore_s,
            "forward_s": forward_s,
        }
