"""In-flight prefix sharing: a prompt's blocks that a running request is computing right now.

The store shares a block once it is written; agents that arrive together (eight of them with one
system prompt) would each compute the shared blocks before any is written. So each running
request registers the full blocks of its prompt that it computes itself (their chained keys: a
block's key is the content of its whole prefix), and a request whose prompt needs one of them,
when its row is about to be opened, waits for it instead: its open is put off until the running
request has saved those blocks (its incremental checkpoints append them as soon as they are
computed while someone waits: :meth:`SessionJobs.due <kvstrata.engine.session_jobs.SessionJobs.due>`),
and then it loads them from the store like any stored prefix, takes the KV of the shared tokens
past the last full block that the running request's row computed (a system prompt rarely ends on
a block boundary; no stored block can give them) and computes only the rest. Those tokens are
copied out of the row when the waiter is reopened (:meth:`ComputingPrefixes.lendable`), from
positions the step thread writes no more, so a waiter gets them whatever the threads' timing;
while that request has not computed them yet (another request stored the shared blocks first),
the waiter waits for it again (it lends them at its next step). A request that arrives once the
shared blocks are stored, or whose open runs late, takes those tokens from any running row that
computed them (:meth:`ComputingPrefixes._tail`).
A request that ends (finished, cancelled or failed) releases what it registered, and its waiters
look again (computing themselves what nobody computes any more). A request never waits for one
of a less demanding class (the step scheduler may put that one's prefill after its own).
Requests share only within a namespace (the keys are chained from the namespace's root) and only
exact KV (no pruned or encoded rows).

Runs on the engine's store worker only (opens, checkpoints and commits all do), so it needs no
lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstrata.engine.inflight import InFlight
from kvstrata.engine.prefix import common_prefix
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority

KeyChain = Callable[[str, Sequence[int]], list[BlockKey]]
"""``(namespace, token_ids)`` -> the keys of the full blocks of ``token_ids``."""


@dataclass(slots=True)
class _Computing:
    inflight: InFlight
    """The request computing them."""
    blocks: list[tuple[int, BlockKey]]
    """(end position, key) of the prompt's full blocks the request computes, in order."""
    waiters: list[InFlight] = field(default_factory=list)
    reopened: list[InFlight] = field(default_factory=list)
    """Waiters reopened whose open may not have run yet (the store worker runs it later, after
    a checkpoint or commit of higher rank): each is lent again what the row computed since."""


class ComputingPrefixes:
    def __init__(
        self,
        key_chain: KeyChain,
        holds: Callable[[BlockKey], bool],
        block_tokens: int,
        reopen: Callable[[InFlight], None],
        lend: Callable[[InFlight], None],
    ) -> None:
        """``key_chain``: the store's chained block keys; ``holds(key)``: whether a tier of the
        store holds the block; ``lend(inflight)``: copy onto a waiting request what the row it
        waited for computed of its prompt (:meth:`lendable`); ``reopen(inflight)``: lend, then
        open its row again (the engine queues the open)."""
        self.key_chain = key_chain
        self.holds = holds
        self.block_tokens = block_tokens
        self.reopen = reopen
        self.lend = lend
        self._owner: dict[BlockKey, InFlight] = {}
        self._by_request: dict[str, _Computing] = {}

    def blocking(self, inflight: InFlight) -> InFlight | None:
        """The running request computing the first block of ``inflight``'s prompt that the store
        does not hold, when ``inflight`` should wait for it; None when it computes that block
        itself: nobody computes it, or only a request of a less demanding class (a realtime
        request never waits behind an interactive one's prefill, which the step scheduler may
        put after its own). Past the blocks the store holds, the request ``inflight`` waited for
        before is waited for again while it computes more of ``inflight``'s prompt than it lent
        so far (:meth:`_tail`)."""
        if not self._by_request or not inflight.request.use_cache:
            return None
        rank = Priority(inflight.request.priority).rank
        usable = inflight.prompt_ids[: len(inflight.prompt_ids) - 1]  # the last token is computed
        held = 0
        for key in self.key_chain(inflight.request.namespace, usable):
            if self.holds(key):
                held += 1
                continue
            owner = self._owner.get(key)
            if owner is None:
                break
            if owner is inflight or Priority(owner.request.priority).rank > rank:
                return None
            return owner
        return self._tail(inflight, held * self.block_tokens, rank)

    def _tail(self, inflight: InFlight, start: int, rank: int) -> InFlight | None:
        """Past the ``start`` tokens the store holds, the tokens of ``inflight``'s prompt that a
        running request computed (a block's part past the shared full blocks: a system prompt
        rarely ends on a block boundary, and no stored block gives them): the request
        ``inflight`` waited for is asked first, then any other running one whose prompt shares
        more (the request that stored those blocks first may be another one, or may have ended).
        When the lender's row holds them already, they are lent now and None is returned (the
        request opens at once); when it has not computed them yet, the lender is returned and the
        request waits for it (only for one of a class at least as demanding), to be lent them at
        its next step's checkpoint or its end rather than compute them. None when nobody runs
        that computes more of the prompt than ``inflight`` was lent."""
        mine = inflight.prompt_ids[: len(inflight.prompt_ids) - 1]  # the last token is computed
        lent = start
        if inflight.lent is not None:
            begin, kv = inflight.lent
            if begin <= start < begin + kv.shape[3]:
                lent = begin + kv.shape[3]
        waited = inflight.waited_on
        lenders = [waited] if waited is not None and waited.request_id in self._by_request else []
        lenders += [c.inflight for c in self._by_request.values() if c.inflight not in (waited, inflight)]
        namespace = inflight.request.namespace
        for owner in lenders:
            if owner.closed or owner.failure is not None or owner.row is None or not _lends(owner):
                continue
            if owner.request.namespace != namespace or owner.prompt_ids[:start] != mine[:start]:
                continue  # another tenant's row is never lent (nor one of another prefix)
            shared = common_prefix(mine, owner.prompt_ids)
            if shared <= lent or shared // self.block_tokens * self.block_tokens > start:
                continue  # nothing more, or a full block past ``start`` that nobody computes now
            if owner.published >= shared:
                inflight.waited_on = owner
                self.lend(inflight)
                return None
            if Priority(owner.request.priority).rank <= rank:
                return owner
        return None

    def wait(self, inflight: InFlight, owner: InFlight) -> None:
        """``inflight`` waits for ``owner``'s blocks; ``owner`` saves them as soon as it computes them."""
        self._by_request[owner.request_id].waiters.append(inflight)
        owner.awaited = True
        inflight.waited_on = owner

    def register(self, inflight: InFlight) -> None:
        """The opened ``inflight`` computes its prompt past its prefix: its full blocks there."""
        session, prefix = inflight.session, inflight.prefix
        if session is None or prefix is None or prefix.kept_blocks is not None or session.pruned:
            return  # no session to save them, or keys of a lineage of their own
        bt = self.block_tokens
        chain = self.key_chain(inflight.request.namespace, inflight.prompt_ids)
        blocks = [((i + 1) * bt, key) for i, key in enumerate(chain) if (i + 1) * bt > prefix.num_tokens]
        if not blocks:
            return
        self._by_request[inflight.request_id] = _Computing(inflight, blocks)
        for _, key in blocks:
            self._owner.setdefault(key, inflight)

    def saved(self, inflight: InFlight, num_tokens: int) -> None:
        """``inflight``'s session holds its first ``num_tokens`` tokens now: the blocks up to there
        are in the store; its waiters look again."""
        computing = self._by_request.get(inflight.request_id)
        if computing is None:
            return
        done = [key for end, key in computing.blocks if end <= num_tokens]
        computing.blocks = [(end, key) for end, key in computing.blocks if end > num_tokens]
        self._release(inflight, done)
        self._lend_again(inflight, computing)
        waiters, computing.waiters = computing.waiters, []
        inflight.awaited = False  # until a waiter that still needs a block waits again
        for waiter in waiters:
            self.reopen(waiter)
        computing.reopened.extend(waiters)

    def ended(self, inflight: InFlight) -> None:
        """``inflight`` left (committed or failed): nothing of it is computing any more."""
        computing = self._by_request.pop(inflight.request_id, None)
        if computing is None:
            return
        self._release(inflight, [key for _, key in computing.blocks])
        self._lend_again(inflight, computing)
        for waiter in computing.waiters:
            self.reopen(waiter)

    def _lend_again(self, owner: InFlight, computing: _Computing) -> None:
        """The waiters of ``owner`` reopened earlier whose open has not run yet are lent what its
        row computed since (the tokens past the shared full blocks, when they were not computed at
        that reopen): an open queued behind ``owner``'s commit finds its row freed and would
        compute them itself."""
        pending = []
        for waiter in computing.reopened:
            if waiter.row is not None or waiter.closed or waiter.failure is not None:
                continue  # opened (or ended) meanwhile
            if waiter.waited_on is not owner or waiter in computing.waiters:
                continue  # waits again (for this request: it is reopened below, or for another)
            self.lend(waiter)
            pending.append(waiter)
        computing.reopened = pending

    def lendable(self, waiter: InFlight) -> tuple[InFlight, int, int] | None:
        """The row of the request ``waiter`` waited for, and the positions ``begin:end`` of
        ``waiter``'s own prompt tokens past the full blocks the store gives it that this row
        computed (the part of a block that no stored block can give: a shared system prompt
        rarely ends on a block boundary); None when there is nothing to take. Positions are its
        cache slots: such a row has no pruned prefix. Asked while the store worker reopens
        ``waiter``: the row's positions before ``published`` are never written again, so they are
        read while the batch decodes on, as an incremental checkpoint reads them."""
        owner = waiter.waited_on
        if owner is None or owner.row is None or owner.failure is not None or not _lends(owner):
            return None
        mine, theirs = waiter.prompt_ids, owner.prompt_ids
        end = min(owner.published, len(mine) - 1, len(theirs))  # leave one prompt token to compute
        shared = common_prefix(mine[:end], theirs[:end])
        begin = shared // self.block_tokens * self.block_tokens  # the owner saved the blocks before
        return (owner, begin, shared) if shared > begin else None

    def _release(self, inflight: InFlight, keys: list[BlockKey]) -> None:
        for key in keys:
            if self._owner.get(key) is inflight:
                del self._owner[key]


def _lends(owner: InFlight) -> bool:
    """Whether ``owner``'s row holds exact KV at its positions' slots (no pruned prefix, no blocks
    held encoded, which come first), so that a waiter can take a part of it."""
    if owner.prefix is None or owner.prefix.kept_blocks is not None:
        return False
    if owner.session is None or owner.session.pruned:
        return False
    return owner.row is None or owner.row.cache.pages is None
