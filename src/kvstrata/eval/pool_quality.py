"""What holding an agent's blocks encoded in device memory costs in model quality (issue 33).

A context of ``context_tokens`` tokens of public-domain text is prefilled once, exactly, with the
importance tracker attached (each block's attention mass per query that could see it). Then, per
scheme, a request's cache is built as the pool would hold the agent: every full block out of the
recent window encoded as the scheme's grades say (``policy/grades.py``), its pages in the cache's
arena and attended where they lie, the sequence's first 4 tokens (attention sinks), the
``recent_blocks`` newest full blocks and the tail exact. The continuation is teacher-forced one
token at a time for ``eval_tokens`` steps through the transformers path (``PagedLayer``: one
layer's pages dequantized at a time; the decode kernel computes the same within float rounding,
``tests/engine/test_decode_kernel_pages.py``); each block that leaves the window during the run
is encoded then, at the middle grade (the run tracks no attention of its own). Each step's
next-token distribution is compared with the same loop over the exact cache: perplexity change,
mean KL (exact || scheme), top-1 agreement.

Sizes: ``ratio_vs_fp16`` is the encoded blocks' fp16 bytes over the bytes the scheme holds them
in (their pages, and their sink tokens exact in the model's dtype); ``context_ratio_vs_fp16``
counts the whole context, the exact window included; ``ratio_vs_model`` is against the model's
own KV dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstrata.codecs import get_codec
from kvstrata.codecs.arena import PageArena
from kvstrata.errors import ConfigError
from kvstrata.eval.codec_quality import StepCallback, _mean_kl, _perplexity, _StepStats, _top1_agreement
from kvstrata.eval.eviction import block_scores
from kvstrata.integrations.transformers.cache import SINK_TOKENS, KVStrataCache
from kvstrata.integrations.transformers.importance import ImportanceTracker
from kvstrata.integrations.transformers.model import LoadedModel, layout_for_config
from kvstrata.layout import KVLayout
from kvstrata.policy.grades import Grade, GradedCodecs, grade_blocks

DEFAULT_CONTEXT_TOKENS = 2048
DEFAULT_EVAL_TOKENS = 512
SCHEMES: dict[str, GradedCodecs] = {
    "int8s": GradedCodecs("int8s", "int8s", "int8s", 0.0, 0.0),
    "kivi4": GradedCodecs("kivi4", "kivi4", "kivi4", 0.0, 0.0),
    "kivi2": GradedCodecs("kivi2", "kivi2", "kivi2", 0.0, 0.0),
    "kvmix": GradedCodecs("kvmix", "kvmix", "kvmix", 0.0, 0.0),
    "graded": GradedCodecs(),
}
"""The schemes ``kvstrata eval pool`` knows by name: one codec for every block out of the window
(int8s: the interactive class's L1 rung; kivi4: the background class's; kvmix: the graded rung's
middle and bottom), or graded by importance."""
_FP16_ITEMSIZE = 2


@dataclass(frozen=True, slots=True)
class PoolQuality:
    scheme: str
    ppl: float
    ppl_reference: float
    ppl_delta_pct: float
    kl: float
    top1: float
    ratio_vs_fp16: float
    ratio_vs_model: float
    context_ratio_vs_fp16: float
    blocks: dict[str, int] = field(default_factory=dict)
    """Blocks of the final cache per codec ("exact" for the window and anything not encoded)."""

    def summary(self) -> dict[str, object]:
        return {
            "scheme": self.scheme,
            "ppl_delta_pct": self.ppl_delta_pct,
            "kl": self.kl,
            "top1": self.top1,
            "ratio_vs_fp16": self.ratio_vs_fp16,
            "ratio_vs_model": self.ratio_vs_model,
            "context_ratio_vs_fp16": self.context_ratio_vs_fp16,
            "blocks": self.blocks,
        }


def evaluate_pool(
    loaded_model: LoadedModel,
    token_ids: Sequence[int],
    schemes: Sequence[str],
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
    *,
    block_tokens: int = 64,
    recent_blocks: int = 1,
    graded: dict[str, GradedCodecs] | None = None,
    on_step: StepCallback | None = None,
) -> list[PoolQuality]:
    """One row per scheme of ``schemes`` (names of :data:`SCHEMES` or of ``graded``)."""
    known = {**SCHEMES, **(graded or {})}
    unknown = [name for name in schemes if name not in known]
    if unknown:
        raise ConfigError(f"unknown pool schemes {unknown}; known: {', '.join(known)}")
    if context_tokens < (recent_blocks + 1) * block_tokens or eval_tokens < 1:
        raise ConfigError("the context must hold a block out of the recent window, and eval_tokens >= 1")
    needed = context_tokens + eval_tokens + 1
    if len(token_ids) < needed:
        raise ConfigError(f"the text has {len(token_ids)} tokens; {needed} are needed")
    model = loaded_model.model
    layout = layout_for_config(model.config, model.dtype, block_tokens=block_tokens)
    device = next(model.parameters()).device
    ids = torch.tensor(list(token_ids[:needed]), dtype=torch.long, device=device)
    context_kv, scores = _prefill_tracked(model, ids[:context_tokens], layout)
    reference = _teacher_force(
        model, context_kv, None, ids, context_tokens, eval_tokens, layout, recent_blocks, scores, on_step
    )[0]
    results = []
    for name in schemes:
        stats, cache = _teacher_force(
            model,
            context_kv,
            known[name],
            ids,
            context_tokens,
            eval_tokens,
            layout,
            recent_blocks,
            scores,
            on_step,
        )
        ppl, ref_ppl = _perplexity(stats), _perplexity(reference)
        results.append(
            PoolQuality(
                scheme=name,
                ppl=ppl,
                ppl_reference=ref_ppl,
                ppl_delta_pct=(ppl / ref_ppl - 1.0) * 100.0,
                kl=_mean_kl(reference, stats),
                top1=_top1_agreement(reference, stats),
                **_sizes(cache, layout),
            )
        )
    return results


@torch.inference_mode()
def _prefill_tracked(
    model: torch.nn.Module, context: torch.Tensor, layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's KV ``(2, L, H, T, D)`` and each full block's importance score."""
    tracker = ImportanceTracker(layout.block_tokens)
    cache = KVStrataCache.empty_for(model)
    with tracker.attached(model):
        model(input_ids=context.unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
    blocks = context.numel() // layout.block_tokens
    return cache.new_kv(0), block_scores(tracker, blocks, layout.block_tokens, context.numel())


@torch.inference_mode()
def _teacher_force(
    model: torch.nn.Module,
    context_kv: torch.Tensor,
    codecs: GradedCodecs | None,
    ids: torch.Tensor,
    context_tokens: int,
    eval_tokens: int,
    layout: KVLayout,
    recent_blocks: int,
    scores: torch.Tensor,
    on_step: StepCallback | None,
) -> tuple[_StepStats, KVStrataCache]:
    """Feed tokens ``context_tokens ..`` one at a time over the context held as ``codecs`` say
    (None: exact); returns the per-step log-probabilities and the final cache."""
    bt = layout.block_tokens
    pages = PageArena(layout) if codecs is not None else None
    cache = KVStrataCache.from_kv(context_kv, model=model, extra_tokens=eval_tokens + 1, pages=pages)
    if codecs is not None:
        full = context_tokens // bt
        grades = grade_blocks(
            scores.tolist(),
            recent_from=full - recent_blocks,
            top_share=codecs.top_share,
            bottom_share=codecs.bottom_share,
        )
        for block, grade in enumerate(grades):
            name = codecs.codec_for(grade)
            if name is not None:
                cache.encode_block(block * bt, bt, get_codec(name))
    label = "exact" if codecs is None else "pool"
    logprobs = []
    for step in range(eval_tokens):
        pos = context_tokens + step
        out = model(
            input_ids=ids[pos : pos + 1].unsqueeze(0),
            position_ids=torch.tensor([[pos]], device=ids.device),
            cache=cache,
            use_cache=True,
        )
        logprobs.append(torch.log_softmax(out.logits[0, -1].double(), dim=-1))
        cached = pos + 1
        leaving = cached // bt - 1 - recent_blocks
        if codecs is not None and cached % bt == 0 and leaving >= context_tokens // bt - recent_blocks:
            name = codecs.codec_for(Grade.MIDDLE)
            if name is not None:
                cache.encode_block(leaving * bt, bt, get_codec(name))
        if on_step is not None:
            on_step(label, step + 1)
    per_step = torch.stack(logprobs)
    targets = ids[context_tokens + 1 : context_tokens + eval_tokens + 1]
    return _StepStats(per_step, per_step.gather(-1, targets.unsqueeze(-1)).squeeze(-1)), cache


def _sizes(cache: KVStrataCache, layout: KVLayout) -> dict[str, object]:
    assert cache.pages is not None
    pages = cache.pages
    per_token_fp16 = layout.bytes_per_token // layout.itemsize * _FP16_ITEMSIZE
    sinks = SINK_TOKENS if any(start <= SINK_TOKENS for start, _ in pages.covered()) else 0
    encoded_tokens = pages.tokens + sinks
    encoded_bytes = pages.nbytes + sinks * layout.bytes_per_token
    total = cache.get_seq_length()
    exact_bytes = (total - pages.tokens) * layout.bytes_per_token
    blocks: dict[str, int] = {}
    for spec in pages.specs:
        blocks[spec.codec.name.lower()] = blocks.get(spec.codec.name.lower(), 0) + 1
    blocks["exact"] = math.ceil((total - pages.tokens) / layout.block_tokens)
    return {
        "ratio_vs_fp16": encoded_tokens * per_token_fp16 / encoded_bytes if encoded_bytes else 1.0,
        "ratio_vs_model": encoded_tokens * layout.bytes_per_token / encoded_bytes if encoded_bytes else 1.0,
        "context_ratio_vs_fp16": total * per_token_fp16 / (pages.nbytes + exact_bytes),
        "blocks": blocks,
    }
