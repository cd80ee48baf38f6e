"""What the engine's store worker does for a request: open its row, and commit it at the end.

**Open** (before the request's first step): take the session's lease (held until the commit, so
another process sharing the store gets ``SessionBusyError`` meanwhile), find and load the
longest stored prefix of the prompt (:mod:`kvstrata.engine.prefix`), and build the request's
batch row: a :class:`KVStrataCache` holding that prefix, with room for the rest of the prompt
and the answer, and the position offset of a pruned prefix.

**Incremental checkpoints** (while the request runs): once half of ``checkpoint_every_tokens`` (the
store's setting, 256 by default) computed tokens are unsaved, up to the last full block, the step
thread asks for one (:meth:`SessionJobs.due`) and goes on decoding (the other half is the room
the tokens computed while it is saved have); the store worker appends the KV of those
tokens to the session and checkpoints it (:meth:`SessionJobs.save_running`), through the store's
group commit. A ``kill -9`` then loses at most ``checkpoint_every_tokens`` tokens (those since the
last checkpoint, and those of one still being saved), not the whole request (the prompt's KV
included). The step thread only ever appends past the tokens a
checkpoint reads, so the worker copies them out of the row while the batch decodes on.

**Commit** (when the request left the batch, finished or cancelled): append the KV of every token
the row computed that no incremental checkpoint saved (the prompt after the prefix and the
generated tokens but the last, whose KV was never computed; for a request cancelled mid-prefill,
the prompt tokens computed so far) and checkpoint, so the session's tokens are exactly the tokens
whose KV is stored; then the per-session signals for the policy: residency in L1, attention mass
per block (importance), the gap between requests, the system prompt's extent. A failed request
commits nothing more: the lease's release drops what it changed in memory, and the session stays
at its last checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from kvstrata.engine.batch import BatchRow
from kvstrata.engine.computing import ComputingPrefixes
from kvstrata.engine.inflight import InFlight
from kvstrata.engine.prefix import Prefix, PrefixLoader, common_prefix
from kvstrata.engine.requests import GenerationRequest, Response
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices
from kvstrata.integrations.transformers.model import LoadedModel
from kvstrata.keys import LINEAGE_BYTES
from kvstrata.policy.memory import MemoryMode, MemoryModeKind
from kvstrata.priority import Priority
from kvstrata.store import KVStore
from kvstrata.store.sessions import Session

log = logging.getLogger(__name__)

SIGNALS_KEPT = 4096
"""Sessions whose request gap the engine remembers (the most recently served ones)."""


class SessionJobs:
    def __init__(
        self,
        model: LoadedModel,
        store: KVStore,
        *,
        l1_resident_sessions: int,
        track_importance: bool,
        memory_modes: Mapping[Priority, MemoryMode],
        spare_buffers: int = 2,
        reopen: Callable[[InFlight], None] | None = None,
    ) -> None:
        """``reopen(inflight)``: open a request again that waited for prompt blocks a running
        request computes (in-flight prefix sharing, :mod:`kvstrata.engine.computing`; None: off,
        every request computes what the store does not hold)."""
        if l1_resident_sessions < 1:
            raise ConfigError("l1_resident_sessions must be >= 1")
        for mode in memory_modes.values():
            mode.budget_blocks(store.layout.block_tokens)  # raises on a budget too small
            if mode.kind is MemoryModeKind.IMPORTANCE and not track_importance:
                raise ConfigError("the importance memory mode needs track_importance=True")
        self.model = model
        self.store = store
        self.l1_resident_sessions = l1_resident_sessions
        self.track_importance = track_importance
        self.memory_modes = memory_modes
        self.prefixes = PrefixLoader(store, spare_buffers=spare_buffers)
        self.computing = None
        self._reopen = reopen
        if reopen is not None:
            bt = store.layout.block_tokens
            self.computing = ComputingPrefixes(
                store.block_key_chain, store.blocks.contains, bt, self._lend_and_reopen, self._lend
            )
        self._devices = layer_devices(model.model)
        self._resident: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._last_request: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._gaps: dict[tuple[str, str], float] = {}

    # -- open ------------------------------------------------------------------------------------
    def ended(self, inflight: InFlight) -> None:
        """The request left the batch: what it registered as computing is released (to waiters)."""
        if self.computing is not None:
            if inflight.row is not None:
                inflight.published = inflight.row.length
            self.computing.ended(inflight)

    def wait_for_prefix(self, inflight: InFlight) -> bool:
        """Put the request's open off while a running request computes blocks of its prompt
        (True: it is opened again once they are saved; :mod:`kvstrata.engine.computing`)."""
        owner = self.computing.blocking(inflight) if self.computing is not None else None
        if owner is None:
            return False
        self.computing.wait(inflight, owner)  # type: ignore[union-attr]
        return True

    def open(self, inflight: InFlight) -> None:
        """Restore the request's prefix and build its row (on the inflight); raises on failure
        (the lease, if taken, stays on ``inflight.lease`` for the commit to release)."""
        request, prompt_ids = inflight.request, inflight.prompt_ids
        max_new_tokens = request.params.max_tokens
        session = None
        with torch.inference_mode():
            if request.use_cache:
                inflight.lease.enter_context(self.store.leased(request.session_id, request.namespace))
                session = self.store.create_session(
                    request.session_id,
                    request.namespace,
                    priority=request.priority,
                    ttl_s=request.ttl_s,
                    exist_ok=True,
                    transient=request.transient,
                )
                if Priority.parse(request.priority).rank < Priority.parse(session.priority).rank:
                    # its class rose (a background agent asked for realtime): its lossy blocks are
                    # made exact from L3's exact copies before its prefix is restored
                    self.store.set_priority(session, request.priority)
                mode = self.memory_modes.get(session.priority)
                capacity = len(prompt_ids) + max_new_tokens
                prefix = self.prefixes.load(session, prompt_ids, capacity, mode)
            else:
                prefix = Prefix.none()
            start, slots = prefix.num_tokens, prefix.slots
            total_new = len(prompt_ids) - start + max_new_tokens
            if prefix.source is not None:  # adopts the store's buffer when it has room
                cache = KVStrataCache.from_loaded(
                    prefix.source, slots, devices=self._devices, extra_tokens=total_new
                )
            else:
                cache = KVStrataCache.from_kv(
                    prefix.kv[:, :, :, :slots] if prefix.kv is not None else None,
                    len(self._devices),
                    devices=self._devices,
                    extra_tokens=total_new,
                )
            lent, inflight.lent = inflight.lent, None
            borrowed = self._borrow(lent, cache, start) if prefix.kept_blocks is None else 0
        inflight.session, inflight.prefix, inflight.prefill = session, prefix, prompt_ids[start + borrowed :]
        inflight.borrowed = borrowed
        inflight.row = BatchRow(cache, position_offset=start - slots, track_attention=self.track_importance)
        if self.computing is not None and not inflight.request.idle:  # nobody waits for an idle one
            self.computing.register(inflight)

    def _lend_and_reopen(self, waiter: InFlight) -> None:
        """Reopen ``waiter`` (its blocks are saved, or their computing request ended), lending it
        what the row it waited for computed past them (:meth:`_lend`)."""
        assert self._reopen is not None
        self._lend(waiter)
        self._reopen(waiter)

    def _lend(self, waiter: InFlight) -> None:
        """Lend ``waiter`` a copy of the KV of its prompt tokens past the blocks the store gives it
        that the row it waited for computed (:meth:`ComputingPrefixes.lendable`). Copied now, on
        the store worker, from positions the step thread writes no more: the waiter gets them
        however late its open runs, even after that request committed and freed its row."""
        assert self.computing is not None
        waiter.lent = None
        try:
            found = self.computing.lendable(waiter)
            if found is not None:
                owner, begin, end = found
                assert owner.row is not None
                with torch.inference_mode():
                    waiter.lent = (begin, owner.row.cache.new_kv(begin, end))
        except Exception:  # a bug here must neither fail the lender's checkpoint nor strand the waiter
            log.exception("lending KV to %s failed: it computes those tokens itself", waiter.request_id)

    @staticmethod
    def _borrow(lent: tuple[int, torch.Tensor] | None, cache: KVStrataCache, start: int) -> int:
        """Put into ``cache`` the KV of the request's prompt tokens from ``start`` on that it was
        ``lent`` (:meth:`_lend`); how many."""
        if lent is None:
            return 0
        begin, kv = lent
        end = begin + kv.shape[3]
        if not begin <= start < end:
            return 0  # the store gave it other blocks than those the lender saved
        kv = kv[:, :, :, start - begin :]
        for layer in range(kv.shape[1]):
            cache.update(kv[0, layer].unsqueeze(0), kv[1, layer].unsqueeze(0), layer)
        return end - start

    # -- commit ----------------------------------------------------------------------------------
    def due(self, inflight: InFlight) -> int | None:
        """Step thread: the computed tokens (past the prefix) an incremental checkpoint of the
        running request would hold now, up to its last full block; None while none is due (fewer
        than ``checkpoint_every_tokens`` new ones, or one is still being saved)."""
        session, prefix, row = inflight.session, inflight.prefix, inflight.row
        if inflight.saving or inflight.save_error is not None:
            return None
        if session is None or prefix is None or row is None:
            return None
        bt = self.store.layout.block_tokens
        start = prefix.num_tokens
        upto = (start + row.length - prefix.slots) // bt * bt - start
        # posted once half the interval is unsaved: one checkpoint is in flight at a time, and the
        # tokens computed while it is saved must stay within the bound a kill -9 may lose
        if upto - inflight.saved >= max(bt, self.store.config.checkpoint_every_tokens // 2):
            return upto
        if inflight.awaited and (upto > inflight.saved or row.length > inflight.published):
            # another request waits for these blocks, or for the row's tokens past them (then it
            # only publishes them: a prefix that ends inside a block gives an ``upto`` below what
            # is saved, negative before the row crosses the block's end, and it took that many
            # tokens off the ids, failing the request; seen once in 27,617 soak requests)
            return max(upto, inflight.saved)
        return None

    def take_due(self, running: list[InFlight]) -> list[tuple[InFlight, int, list[int]]]:
        """Step thread: the incremental checkpoints due among ``running`` (each marked as saving),
        with the ids of the tokens they save."""
        due = []
        for inflight in running:
            upto = self.due(inflight)
            if upto is not None:
                inflight.saving = True
                inflight.published = inflight.row.length  # type: ignore[union-attr]  # due() saw it
                due.append((inflight, upto, inflight.computed_ids(inflight.saved, upto)))
        return due

    def save_running(self, due: list[tuple[InFlight, int, list[int]]]) -> None:
        """Store worker: append each running request's computed tokens up to its ``upto`` (with
        their ids, taken on the step thread) and checkpoint the sessions. Every append goes first,
        so one group commit of the store's writer holds all their blocks."""
        appended: list[InFlight] = []
        for inflight, upto, ids in due:
            try:
                if not inflight.closed:
                    self._append(inflight, upto, ids)
                    appended.append(inflight)
                    if self.computing is not None and inflight.session is not None:
                        self.computing.saved(inflight, inflight.session.num_tokens)
            except Exception as exc:  # the commit raises it: the request fails at its end
                inflight.save_error = exc
                inflight.saving = False
        for inflight in appended:
            session = inflight.session
            assert session is not None
            try:
                if session.checkpointed_tokens != session.num_tokens:
                    self.store.checkpoint(session)
            except Exception as exc:  # the commit checkpoints again (its failure fails the request)
                log.warning("incremental checkpoint of %s/%s failed: %s", session.namespace, session.id, exc)
            finally:
                inflight.saving = False

    def _append(self, inflight: InFlight, upto: int, ids: list[int]) -> None:
        """Append the KV of the computed tokens ``inflight.saved:upto`` (ids ``ids``) to the session."""
        session, prefix, row = inflight.session, inflight.prefix, inflight.row
        assert session is not None and prefix is not None and row is not None
        begin = inflight.saved
        assert len(ids) == upto - begin
        if not ids:
            return
        start, slots = prefix.num_tokens, prefix.slots
        with torch.inference_mode():
            if prefix.kept_blocks is not None and not session.pruned:
                # From here on the session's KV is computed over a pruned context: its blocks
                # get keys of their own lineage, apart from exact blocks of the same tokens.
                session.lineage, session.lineage_from = os.urandom(LINEAGE_BYTES), start
            self.store.append(session, ids, row.cache.new_kv(slots + begin, slots + upto))
        inflight.saved = upto

    def commit(self, inflight: InFlight) -> None:
        """Persist what the request's row computed, and record the session's signals."""
        session, prefix, row = inflight.session, inflight.prefix, inflight.row
        if session is None or prefix is None or row is None:
            return
        if inflight.save_error is not None:
            raise inflight.save_error
        start = prefix.num_tokens
        # The last generated token was never fed to the model, so it has no KV: the session
        # stops before it, and the next turn prefills it (as part of its prompt).
        computed = row.length - prefix.slots
        bt = self.store.layout.block_tokens
        self._append(inflight, computed, inflight.computed_ids(inflight.saved, computed))
        with torch.inference_mode():
            self.store.checkpoint(session)
        self.keep_resident(session)
        self._record_importance(session, row, prefix.kept_blocks)
        self.prefixes.recycle(prefix, row.cache)
        if prefix.kept_blocks is not None:  # blocks the session no longer attends to
            kept = set(prefix.kept_blocks)
            self.store.blocks.demote_from_l1(
                k for i, k in enumerate(session.block_keys) if i not in kept and i * bt < start
            )
        self._record_signals(inflight.request, session, inflight.prompt_ids)

    def response(self, inflight: InFlight, reason: str, ended: float) -> Response:
        request, decoder = inflight.request, inflight.decoder
        prefix = inflight.prefix or Prefix.none()
        prompt_tokens = len(inflight.prompt_ids)
        finish = decoder.finish_reason or ("cancelled" if reason == "cancelled" else "length")
        return Response(
            session_id=request.session_id,
            namespace=request.namespace,
            text=decoder.text,
            token_ids=list(decoder.token_ids),
            prompt_tokens=prompt_tokens,
            cached_tokens=prefix.num_tokens + inflight.borrowed,
            cached_by_tier=prefix.by_tier,
            prefill_tokens=prompt_tokens - prefix.num_tokens - inflight.borrowed,
            completion_tokens=len(decoder.token_ids),
            finish_reason=finish,
            recomputed_reason="; ".join(prefix.reasons) or None,
            diverged_at=prefix.diverged_at,
            attended_tokens=prefix.slots if prefix.kept_blocks is not None else None,
            stop_reason=decoder.stop_reason,
            logprobs=decoder.logprobs if request.params.logprobs else None,
            request_id=inflight.request_id,
            **inflight.timings(ended),  # type: ignore[arg-type]
        )

    # -- per-session signals ---------------------------------------------------------------------
    def forget(self, session_id: str, namespace: str) -> None:
        key = (namespace, session_id)
        self._resident.pop(key, None)
        self._last_request.pop(key, None)
        self._gaps.pop(key, None)

    def keep_resident(self, session: Session) -> None:
        """Mark ``session`` most recently served; demote sessions beyond the residency limit
        from L1 (in the background), except blocks a resident session shares with them."""
        key = (session.namespace, session.id)
        self._resident.pop(key, None)
        self._resident[key] = session
        evicted = []
        while len(self._resident) > self.l1_resident_sessions:
            # the least recently served session of the lowest class leaves first: a burst of
            # background agents does not push the interactive and realtime ones out of L1
            victim = min(
                self._resident, key=lambda k: -self._resident[k].priority.rank
            )  # min() keeps the first (least recently served) of equal rank
            evicted.append(self._resident.pop(victim))
        if evicted:
            keep = {k for s in self._resident.values() for k in s.all_keys()}
            self.store.blocks.demote_from_l1(k for s in evicted for k in s.all_keys() if k not in keep)

    def request_rate(self, session_id: str, namespace: str) -> float:
        gap = self._gaps.get((namespace, session_id))
        return 1.0 / gap if gap else 0.0

    def _record_signals(self, request: GenerationRequest, session: Session, prompt_ids: list[int]) -> None:
        """Per-session signals for the policy: the moving-average gap between requests (which
        becomes the expected time to the next use of the session's blocks) and the extent of the
        system prompt (whose blocks are protected from demotion like the attention sinks)."""
        key = (session.namespace, session.id)
        now = time.monotonic()
        last = self._last_request.pop(key, None)
        self._last_request[key] = now  # the most recent last
        while len(self._last_request) > SIGNALS_KEPT:  # the sessions not served for longest go
            old, _ = self._last_request.popitem(last=False)
            self._gaps.pop(old, None)
        if last is not None:
            gap = now - last
            previous = self._gaps.get(key)
            self._gaps[key] = gap if previous is None else 0.7 * previous + 0.3 * gap
        keys = session.all_keys()
        if key in self._gaps:
            self.store.blocks.set_next_use(keys, self._gaps[key])
        messages = request.messages or []
        if messages and messages[0].get("role") == "system":
            system_ids = self.model.tokenizer.apply_chat_template([messages[0]], tokenize=True)
            system_ids = system_ids["input_ids"] if hasattr(system_ids, "keys") else system_ids
            # the blocks that lie wholly inside the rendered system message
            full = (
                min(common_prefix(list(system_ids), prompt_ids), session.num_tokens)
                // self.store.layout.block_tokens
            )
            self.store.blocks.protect(session.block_keys[:full])

    def _record_importance(self, session: Session, row: BatchRow, kept_blocks: list[int] | None) -> None:
        """Credit each of the session's blocks with the attention mass it received this request.

        With a pruned prefix the cache's first blocks were the kept full blocks: only those are
        credited (the slots after them do not line up with the session's blocks)."""
        if row.attention_mass is None:
            return
        keys = session.all_keys() if kept_blocks is None else [session.block_keys[i] for i in kept_blocks]
        mass = row.block_mass(self.store.layout.block_tokens, len(keys))
        total = mass.sum()
        shares = mass / total if total > 0 else mass
        self.store.blocks.add_importance(zip(keys, shares.tolist(), strict=True))
