"""A batched step of a Llama model written out directly, without transformers' module calls.

A step of :class:`~kvstrata.engine.batch.forward.BatchedForward` through the model's own
``forward`` runs, per decoder layer, about a dozen ``nn.Module`` calls, transformers' keyword
plumbing (decorators that check and record outputs, kwarg deprecation, the attention registry)
and then a few tensor operations. On a CPU decoding one or a few rows, the linear layers read
every weight once per step, and most of what is left is that Python. This path runs the same
tensor operations on the same weights, with two changes that keep the results bit for bit (a
test compares its logits and KV with the model's own forward):

- q/k/v are one linear and gate/up another (:func:`fuse_linears`), as in vLLM: one weight read
  of 960 rows instead of three calls (576, 192, 192 rows for SmolLM2), one of 3,072 instead of
  two of 1,536. The parts' weights become views of the fused ones (no more memory); where they
  were packed (:mod:`~kvstrata.integrations.transformers.packed_linear`) the fused ones are
  packed in their place. Each output element is the same dot product either way.
- queries and keys are rotated in one operation over all heads.

Measured (SmolLM2, one thread, Intel Xeon VM with AMX, 2026-12-05; the model's own forward at
21b2882 against this path, alternated by process): a one-row decode step 60.1 / 61.9 -> 57.9 /
57.1 ms in fp32, 45.5 / 46.4 -> 42.8 / 42.7 ms in bf16. All of SmolLM2's bf16 linear layers of a
one-row step, packed, read from memory: 25.3 ms as seven per layer, 23.6 ms fused into four.

Only ``LlamaForCausalLM`` takes this path (:func:`supports`); other architectures keep the
model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.engine.batch.attention import STEP_KWARG, Step, StepCache, batched_attention
from kvstrata.integrations.transformers import packed_linear

_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Llama causal LM this module runs as transformers would: the class
    and every part it reads, a SiLU MLP and no rotary variant that depends on the step (dynamic
    scaling re-computes frequencies from the positions it is called with)."""
    inner = getattr(model, "model", None)
    if type(model).__name__ != "LlamaForCausalLM" or type(inner).__name__ != "LlamaModel":
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "hidden_act", None) != "silu" or rope.get("rope_type", "default") == "dynamic":
        return False
    layers = model.model.layers
    return all(type(layer).__name__ == "LlamaDecoderLayer" for layer in layers) and all(
        layer.get_submodule(part) is not None for layer in layers for part in _LAYER_PARTS
    )


@dataclass(frozen=True, slots=True)
class _Shape:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class FusedLinears:
    """A decoder layer's q/k/v projections as one linear, and gate/up as another (kept on the
    layer as a plain attribute, not a submodule: the model's modules and state dict stay its own)."""

    qkv: torch.nn.Linear
    gate_up: torch.nn.Linear


_FUSED = "_kvstrata_fused_linears"


def fuse_linears(layer: torch.nn.Module) -> FusedLinears:
    """One linear for q/k/v and one for gate/up of a ``LlamaDecoderLayer`` (idempotent). The
    parts' weights become views into the fused weights, so the plain weights take no more memory;
    where the parts were packed (:mod:`~kvstrata.integrations.transformers.packed_linear`), the
    fused linears are packed instead and the parts' packed copies dropped (the model's own forward
    still runs on the views, unpacked)."""
    fused: FusedLinears | None = getattr(layer, _FUSED, None)
    if fused is not None:
        return fused
    attention, mlp = layer.self_attn, layer.mlp
    qkv_parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    fused = FusedLinears(_fuse(qkv_parts), _fuse([mlp.gate_proj, mlp.up_proj]))
    if any(packed_linear.is_packed(part) for part in [*qkv_parts, mlp.gate_proj, mlp.up_proj]):
        for part in [*qkv_parts, mlp.gate_proj, mlp.up_proj]:
            packed_linear.unpack(part)
        holder = torch.nn.ModuleList([fused.qkv, fused.gate_up])
        packed_linear.pack_linears(holder)
        packed_linear.pad_fp32_linears(holder)
    setattr(layer, _FUSED, fused)
    return fused


def _fuse(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """A linear whose output is the parts' outputs side by side; each part's weight (and bias)
    becomes a view of it."""
    first = parts[0]
    biased = first.bias is not None
    with torch.no_grad():
        weight = torch.cat([part.weight.detach() for part in parts])
        bias = torch.cat([part.bias.detach() for part in parts]) if biased else None  # type: ignore[union-attr]
    fused = torch.nn.Linear(
        first.in_features, weight.shape[0], bias=biased, device=weight.device, dtype=weight.dtype
    )
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for part in parts:
        stop = start + part.out_features
        part.weight = torch.nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            part.bias = torch.nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return fused.eval()


class LlamaStep:
    """Runs a prepared :class:`Step` through a Llama model's layers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        attention = model.model.layers[0].self_attn
        config = model.config
        self.model = model
        self.shape = _Shape(config.num_attention_heads, config.num_key_value_heads, attention.head_dim)
        self.fused = [fuse_linears(layer) for layer in model.model.layers]

    def __call__(
        self, step: Step, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The logits ``(1, len(keep), vocab)`` after the packed tokens at ``keep``; appends each
        row's new keys and values to its cache as the model's own forward does."""
        inner = self.model.model
        heads, kv_heads, head_dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        qk_sizes = [(heads + kv_heads) * head_dim, kv_heads * head_dim]
        tokens = input_ids.shape[1]
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (1, tokens, 1, head_dim): over every head
        cache = StepCache(step)
        kwargs = {STEP_KWARG: step}
        for index, (layer, fused) in enumerate(zip(inner.layers, self.fused, strict=True)):
            attention, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            query_key, value = fused.qkv(x).split(qk_sizes, dim=-1)
            # queries and keys rotated in one go: (1, tokens, heads + kv_heads, head_dim)
            query_key = _rotate(query_key.view(1, tokens, heads + kv_heads, head_dim), cos, sin)
            query = query_key[:, :, :heads].transpose(1, 2)
            key = query_key[:, :, heads:].transpose(1, 2)
            value = value.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
            cache.update(key, value, index)
            out, _ = batched_attention(attention, query, key, value, None, attention.scaling, **kwargs)
            hidden = hidden + attention.o_proj(out.reshape(1, tokens, -1).contiguous())
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = fused.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(torch.nn.functional.silu(gate) * up)
        hidden = _rms_norm(hidden, inner.norm)
        return self.model.lm_head(hidden[:, keep, :])


def _rms_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, operation for operation."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
