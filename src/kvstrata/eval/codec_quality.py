"""The codec quality harness: what each codec costs in model quality, size and speed.

A context of ``context_tokens`` tokens is prefilled once (full precision). Then, per codec, the
continuation is teacher-forced one token at a time for ``eval_tokens`` steps while the cache's
full ``block_tokens``-token blocks hold the codec's encode-then-decode of the real KV; the newest,
partial block stays in full precision, as the store keeps a session's tail block. A block is
compressed once, when it becomes full: its KV never changes afterwards, so this equals
re-encoding the whole cache at every step. Each step's next-token distribution is compared with
the same loop run on the untouched cache (the reference): perplexity change, mean KL divergence
(reference || codec) and top-1 agreement. Size and speed are measured on the context's full
blocks: compression ratio, encode and decode throughput next to a plain tensor copy timed in the
same run, and whether decoding gives back the exact bits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources

import torch
from transformers import DynamicCache, PreTrainedModel

from kvstrata.codecs import BlockContext, Codec, get_codec
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.model import LoadedModel, layout_for_config
from kvstrata.layout import KVLayout

EVAL_TEXT_NAME = "kjv_genesis_37_43.txt"
DEFAULT_CONTEXT_TOKENS = 512
DEFAULT_EVAL_TOKENS = 128
# Copies are timed this many times and the fastest is kept: one copy of a few MB is too short for a
# single timer reading to mean much.
_MEMCPY_REPEATS = 5
_TIMING_REPEATS = 3
_FP16_ITEMSIZE = 2

# Called after each teacher-forced step with (a label for the step, steps done so far).
StepCallback = Callable[[str, int], None]


@dataclass(frozen=True, slots=True)
class CodecQuality:
    """One codec's row of the report.

    ``ratio`` is raw bytes (in the layout dtype) over encoded bytes, so 4.0 means a quarter of the
    size; ``ratio_vs_fp16`` is the same against an fp16 copy of the KV. Throughputs count raw
    bytes per second, in GB/s (1e9 bytes).
    """

    codec: str
    ratio: float
    ratio_vs_fp16: float
    ppl: float
    ppl_reference: float
    ppl_delta_pct: float
    kl: float
    top1: float
    encode_gbps: float
    decode_gbps: float
    memcpy_gbps: float
    bit_exact: bool

    def summary(self) -> dict[str, str | float | bool]:
        """The fields of ``kvstrata eval codecs --json``, exactly these."""
        return {
            "codec": self.codec,
            "ratio": self.ratio,
            "ppl_delta_pct": self.ppl_delta_pct,
            "kl": self.kl,
            "top1": self.top1,
            "encode_gbps": self.encode_gbps,
            "decode_gbps": self.decode_gbps,
            "memcpy_gbps": self.memcpy_gbps,
            "bit_exact": self.bit_exact,
        }


def eval_text() -> str:
    """The shipped public-domain evaluation text (see ``data/README`` for its source and licence)."""
    return resources.files("kvstrata.eval").joinpath("data", EVAL_TEXT_NAME).read_text(encoding="utf-8")


def eval_token_ids(loaded_model: LoadedModel) -> list[int]:
    """The evaluation text in the model's tokens (no special tokens added)."""
    return list(loaded_model.tokenizer(eval_text(), add_special_tokens=False)["input_ids"])


@dataclass(frozen=True, slots=True)
class _StepStats:
    """Per step of one teacher-forced run: log-probabilities over the vocabulary, float64."""

    logprobs: torch.Tensor  # (steps, vocab)
    target_logprobs: torch.Tensor  # (steps,)


@dataclass(frozen=True, slots=True)
class _BlockCost:
    encoded_bytes: int
    encode_s: float
    decode_s: float
    bit_exact: bool


def evaluate_codecs(
    loaded_model: LoadedModel,
    token_ids: Sequence[int],
    codecs: Sequence[str],
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
    *,
    block_tokens: int = 64,
    on_step: StepCallback | None = None,
) -> list[CodecQuality]:
    """Measure each codec of ``codecs`` (registry names) on ``token_ids``; one row per codec, in order.

    Needs ``context_tokens + eval_tokens + 1`` tokens: the context, then ``eval_tokens`` fed
    tokens each scored on the token after it. Every run is a batch of one: batching the codecs as
    rows of one forward pass would be faster, but CPU matrix kernels round a row differently by
    its place in the batch, and a lossless codec must compare exactly equal to the reference.
    """
    if context_tokens < block_tokens:
        raise ConfigError(f"context_tokens must hold at least one {block_tokens}-token block")
    if eval_tokens < 1:
        raise ConfigError("eval_tokens must be at least 1")
    needed = context_tokens + eval_tokens + 1
    if len(token_ids) < needed:
        raise ConfigError(f"the text has {len(token_ids)} tokens; {needed} are needed")
    instances = [get_codec(name) for name in codecs]  # an unknown name fails before any work
    model = loaded_model.model
    layout = layout_for_config(model.config, model.dtype, block_tokens=block_tokens)
    device = next(model.parameters()).device
    ids = torch.tensor(list(token_ids[:needed]), dtype=torch.long, device=device)

    context_kv = _prefill(model, ids[:context_tokens])
    memcpy_gbps = _memcpy_gbps(context_kv, layout)
    compressed = [_compress_context(context_kv, layout, codec) for codec in instances]
    reference = _teacher_force(
        model, [context_kv], [None], ids, context_tokens, eval_tokens, layout, on_step
    )[0]
    stats = [
        _teacher_force(model, [kv], [codec], ids, context_tokens, eval_tokens, layout, on_step)[0]
        for (kv, _), codec in zip(compressed, instances, strict=True)
    ]
    ref_ppl = _perplexity(reference)

    raw_bytes = layout.block_nbytes(_full_blocks(context_tokens, layout) * layout.block_tokens)
    fp16_bytes = raw_bytes // layout.itemsize * _FP16_ITEMSIZE
    results = []
    for name, (_, cost), row in zip(codecs, compressed, stats, strict=True):
        ppl = _perplexity(row)
        results.append(
            CodecQuality(
                codec=name,
                ratio=raw_bytes / cost.encoded_bytes,
                ratio_vs_fp16=fp16_bytes / cost.encoded_bytes,
                ppl=ppl,
                ppl_reference=ref_ppl,
                ppl_delta_pct=(ppl / ref_ppl - 1.0) * 100.0,
                kl=_mean_kl(reference, row),
                top1=_top1_agreement(reference, row),
                encode_gbps=raw_bytes / cost.encode_s / 1e9,
                decode_gbps=raw_bytes / cost.decode_s / 1e9,
                memcpy_gbps=memcpy_gbps,
                bit_exact=cost.bit_exact,
            )
        )
    return results


def _full_blocks(num_tokens: int, layout: KVLayout) -> int:
    return num_tokens // layout.block_tokens


@torch.inference_mode()
def _prefill(model: PreTrainedModel, context_ids: torch.Tensor) -> torch.Tensor:
    """The context's KV as one ``(2, L, H, T, D)`` tensor (batch of one)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=context_ids.unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return torch.stack([keys, values])


def _context_blocks(kv: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    bt = layout.block_tokens
    return [kv[:, :, :, b * bt : (b + 1) * bt].contiguous() for b in range(_full_blocks(kv.shape[3], layout))]


def _compress_context(kv: torch.Tensor, layout: KVLayout, codec: Codec) -> tuple[torch.Tensor, _BlockCost]:
    """``kv`` with each full block replaced by its decoded encoding, and what that cost.

    Times are the fastest of a few passes over all blocks, after an untimed warm-up block: one
    pass over a few MB is short enough for a scheduler hiccup or a first-call setup to dominate.
    """
    blocks = _context_blocks(kv, layout)
    codec.decode(codec.encode(blocks[0], BlockContext(0)), layout)
    encode_s = decode_s = math.inf
    for _ in range(_TIMING_REPEATS):
        started = time.perf_counter()
        encoded = [
            codec.encode(block, BlockContext(b * layout.block_tokens)) for b, block in enumerate(blocks)
        ]
        encode_s = min(encode_s, time.perf_counter() - started)
        started = time.perf_counter()
        decoded = [codec.decode(record, layout) for record in encoded]
        decode_s = min(decode_s, time.perf_counter() - started)
    out = kv.clone()
    out[:, :, :, : len(blocks) * layout.block_tokens] = torch.cat(decoded, dim=3)
    bit_exact = torch.equal(_int_view(out), _int_view(kv))
    encoded_bytes = sum(record.nbytes for record in encoded)
    return out, _BlockCost(encoded_bytes, encode_s, decode_s, bit_exact)


def _int_view(kv: torch.Tensor) -> torch.Tensor:
    """Same bits as integers, so that -0.0 != 0.0 and NaN payloads compare exactly."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[kv.element_size()]
    return kv.contiguous().view(int_dtype)


def _memcpy_gbps(kv: torch.Tensor, layout: KVLayout) -> float:
    """Throughput of ``copy_`` over the same full blocks the codecs encode, fastest of a few runs."""
    blocks = _context_blocks(kv, layout)
    targets = [torch.empty_like(block) for block in blocks]
    nbytes = sum(block.numel() * block.element_size() for block in blocks)
    best_s = math.inf
    for _ in range(_MEMCPY_REPEATS):
        started = time.perf_counter()
        for target, block in zip(targets, blocks, strict=True):
            target.copy_(block)
        best_s = min(best_s, time.perf_counter() - started)
    return nbytes / best_s / 1e9


@torch.inference_mode()
def _teacher_force(
    model: PreTrainedModel,
    row_kvs: Sequence[torch.Tensor],
    row_codecs: Sequence[Codec | None],
    ids: torch.Tensor,
    context_tokens: int,
    eval_tokens: int,
    layout: KVLayout,
    on_step: StepCallback | None,
) -> list[_StepStats]:
    """Feed tokens ``context_tokens ..`` one at a time; batch row ``r`` attends over ``row_kvs[r]``.

    Each block that fills up during the loop is replaced, in row ``r``, by its decoded encoding
    under ``row_codecs[r]`` (None: left as it is) before the next step attends to it.
    """
    rows = len(row_kvs)
    label = "+".join("reference" if codec is None else codec.name for codec in row_codecs)
    cache = DynamicCache(config=model.config)
    for layer_idx in range(row_kvs[0].shape[1]):
        keys = torch.stack([kv[0, layer_idx] for kv in row_kvs])
        values = torch.stack([kv[1, layer_idx] for kv in row_kvs])
        cache.update(keys, values, layer_idx)
    bt = layout.block_tokens
    logprobs = []
    for step in range(eval_tokens):
        pos = context_tokens + step
        out = model(
            input_ids=ids[pos : pos + 1].expand(rows, 1),
            position_ids=torch.full((rows, 1), pos, device=ids.device),
            cache=cache,
            use_cache=True,
        )
        logprobs.append(torch.log_softmax(out.logits[:, -1].double(), dim=-1))
        cached = pos + 1
        if cached % bt == 0:
            for row, codec in enumerate(row_codecs):
                if codec is not None:
                    _compress_cache_block(cache, row, codec, cached - bt, layout)
        if on_step is not None:
            on_step(label, step + 1)
    per_step = torch.stack(logprobs, dim=1)  # (rows, steps, vocab)
    targets = ids[context_tokens + 1 : context_tokens + eval_tokens + 1]
    return [
        _StepStats(per_step[row], per_step[row].gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        for row in range(rows)
    ]


def _compress_cache_block(cache: DynamicCache, row: int, codec: Codec, start: int, layout: KVLayout) -> None:
    end = start + layout.block_tokens
    block = torch.stack(
        [
            torch.stack([layer.keys[row, :, start:end] for layer in cache.layers]),
            torch.stack([layer.values[row, :, start:end] for layer in cache.layers]),
        ]
    )
    decoded = codec.decode(codec.encode(block.contiguous(), BlockContext(start)), layout)
    for layer_idx, layer in enumerate(cache.layers):
        # DynamicLayer.update concatenates into new tensors, so writing in place touches no one else.
        layer.keys[row, :, start:end] = decoded[0, layer_idx]
        layer.values[row, :, start:end] = decoded[1, layer_idx]


def _perplexity(stats: _StepStats) -> float:
    return math.exp(-stats.target_logprobs.mean().item())


def _mean_kl(reference: _StepStats, other: _StepStats) -> float:
    p_ref = reference.logprobs.exp()
    kl = (p_ref * (reference.logprobs - other.logprobs)).sum(dim=-1)
    return kl.mean().item()


def _top1_agreement(reference: _StepStats, other: _StepStats) -> float:
    agree = reference.logprobs.argmax(dim=-1) == other.logprobs.argmax(dim=-1)
    return agree.double().mean().item()
