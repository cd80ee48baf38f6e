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

Its elementwise operations (RMSNorm, the residual add fused with the next norm, rotary) come
from the native module of :mod:`.decode_kernel` once it is loaded (``layer_ops.cpp``; torch's
operators until then, and where it cannot be built; SiLU * up always torch's). Right after a linear layer has
streamed its weight through the caches, each torch operator pays its dispatch and its cache
misses again: an RMSNorm of one row took 45 us there against 15 us alone. The native operations
follow torch's rounding (bfloat16 bit for bit but for RMSNorm's sum of squares, added in another
order), so a step stays within float rounding of the model's own forward (a test); over 256
decode steps of SmolLM2 in bf16, KL to fp32 0.00113 against 0.00129 with torch's operators, top-1
agreement 97.7% against 96.5%.

Where every row of a step decodes one token on the decode kernel and every linear runs the step's
rows on a packed weight (bf16 always; fp32 for 2 to 63 rows, and one row where oneDNN beat MKL on
this CPU), the decoder layers run in one native call (``decode_step.cpp``, :meth:`LlamaStep._decode_layers`):
the same operators in the same order, so the same logits and KV bit for bit (tests), without the
Python around each of the loop's ~20 operator calls a layer (SmolLM2, 8 rows of 150-750 tokens,
one thread, the two alternated step by step in one process, 2026-12-06: 50.8-53.6 -> 42.0-44.6
ms a step; under ``kvstrata serve`` with 8 sessions streaming, ITL p50 51.5-55.3 -> 44.0-46.2
ms). It releases the GIL for the whole loop, taking it again only to ask the step's interrupt
before each layer's attention. A prefill step, and a step where a row's buffer is full, run the
loop.

Measured (SmolLM2, one thread, Intel Xeon VM with AMX, 2026-12-05; the model's own forward at
21b2882 against this path, alternated by process): a one-row decode step 60.1 / 61.9 -> 57.9 /
57.1 ms in fp32, 45.5 / 46.4 -> 42.8 / 42.7 ms in bf16. All of SmolLM2's bf16 linear layers of a
one-row step, packed, read from memory: 25.3 ms as seven per layer, 23.6 ms fused into four.
The native elementwise operations against torch's, alternated in one process (histories of 500
tokens, with the decode kernel's prefetch): one row 42.7 -> 38.8 ms (bf16), 60.7 -> 56.6 ms
(fp32); 8 rows 60.6 -> 55.7 ms (bf16), 106.3 -> 100.5 ms (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvstrata.engine.batch.attention import STEP_KWARG, Step, StepCache, StepInterrupted, batched_attention
from kvstrata.engine.batch.pause import LayersInterrupted
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
    parts: tuple[tuple[int, torch.dtype], ...]
    """The parts' weights when they were fused (:func:`weights_of`): where they differ now (the
    model moved to another dtype or device, or loaded other weights), the fused linears are stale."""


_FUSED = "_kvstrata_fused_linears"


def _parts(layer: torch.nn.Module) -> list[torch.nn.Linear]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]


def weights_of(layer: torch.nn.Module) -> tuple[tuple[int, torch.dtype], ...]:
    """Where and in what dtype the layer's q/k/v and gate/up weights lie now."""
    return tuple((part.weight.data_ptr(), part.weight.dtype) for part in _parts(layer))


def fuse_linears(layer: torch.nn.Module) -> FusedLinears:
    """One linear for q/k/v and one for gate/up of a ``LlamaDecoderLayer`` (idempotent while the
    parts' weights stay where they were; fused again from them where the model was converted,
    ``model.to(torch.bfloat16)`` for example). The parts' weights become views into the fused
    weights, so the plain weights take no more memory; where the parts were packed
    (:mod:`~kvstrata.integrations.transformers.packed_linear`), the fused linears are packed
    instead and the parts' packed copies dropped (the model's own forward still runs on the
    views, unpacked)."""
    fused: FusedLinears | None = getattr(layer, _FUSED, None)
    if fused is not None and fused.parts == weights_of(layer):
        return fused
    was_packed = fused is not None and packed_linear.is_packed(fused.qkv)
    parts = _parts(layer)
    qkv, gate_up = _fuse(parts[:3]), _fuse(parts[3:])
    if was_packed or any(packed_linear.is_packed(part) for part in parts):
        for part in parts:
            packed_linear.unpack(part)
        holder = torch.nn.ModuleList([qkv, gate_up])
        packed_linear.pack_linears(holder)
        packed_linear.pad_fp32_linears(holder)
    fused = FusedLinears(qkv, gate_up, weights_of(layer))
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
        self.fused: list[FusedLinears] = []
        self._norms: list[tuple[torch.Tensor, float]] = []
        """Each layer's input norm, then the model's final one: the norm after layer ``i``'s MLP
        is ``i + 1``."""
        self._native_layers: tuple[list[torch.Tensor], list[float]] | None = None
        self._linears: list[torch.nn.Linear] = []
        self._native_rows: dict[int, bool] = {}
        self.native_steps = 0
        """Steps whose layers ran in one native call (:meth:`_decode_layers`)."""
        self._prepare()

    def _prepare(self) -> None:
        """The fused linears and the norms' weights, as the model holds them now."""
        inner = self.model.model
        self.fused = [fuse_linears(layer) for layer in inner.layers]
        norms = [layer.input_layernorm for layer in inner.layers] + [inner.norm]
        self._norms = [(norm.weight, float(norm.variance_epsilon)) for norm in norms]
        self._native_layers = self._native_weights()

    def _native_weights(self) -> tuple[list[torch.Tensor], list[float]] | None:
        """What the native decode step (``decode_step.cpp``) takes, per layer: the packed q/k/v,
        o, gate/up and down weights, the post-attention norm's and the next norm's weights (and
        their epsilons); None where a linear has no packed weight or has a bias (the Python loop
        runs those steps)."""
        weights: list[torch.Tensor] = []
        eps: list[float] = []
        for index, (layer, fused) in enumerate(zip(self.model.model.layers, self.fused, strict=True)):
            linears = [fused.qkv, layer.self_attn.o_proj, fused.gate_up, layer.mlp.down_proj]
            packed = [packed_linear.packed_for_rows(linear, 2) for linear in linears]
            if any(p is None for p in packed) or any(linear.bias is not None for linear in linears):
                return None
            post = layer.post_attention_layernorm
            following, following_eps = self._norms[index + 1]
            weights += [*packed, post.weight, following]  # type: ignore[list-item]
            eps += [float(post.variance_epsilon), following_eps]
        self._linears = [
            linear
            for layer, fused in zip(self.model.model.layers, self.fused, strict=True)
            for linear in (fused.qkv, layer.self_attn.o_proj, fused.gate_up, layer.mlp.down_proj)
        ]
        self._native_rows.clear()
        return weights, eps

    def _packed_for(self, rows: int) -> bool:
        """Whether every linear runs ``rows`` rows on its packed weight (fp32 linears send one row
        to MKL where that was faster on this CPU: :func:`packed_linear.measure_routes`)."""
        known = self._native_rows.get(rows)
        if known is None:
            known = all(packed_linear.packed_for_rows(linear, rows) is not None for linear in self._linears)
            self._native_rows[rows] = known
        return known

    def __call__(
        self,
        step: Step,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """The logits ``(1, len(keep), vocab)`` after the packed tokens at ``keep``; appends each
        row's new keys and values to its cache as the model's own forward does. ``ops``: the
        native elementwise operations (:mod:`.decode_kernel`'s module, ``layer_ops.cpp``); None
        runs torch's, as transformers does, bit for bit."""
        if self.fused[0].parts != weights_of(self.model.model.layers[0]):
            self._prepare()  # the model was converted since (another dtype or device)
        native = None if ops is None or ops is TorchOps else ops
        ops = ops or TorchOps
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)  # a fresh tensor: the residual adds go into it
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos[0], sin[0]  # (tokens, head_dim)
        cache = StepCache(step, native)  # type: ignore[arg-type]
        x = ops.rms_norm(hidden, *self._norms[0])
        if native is not None and self._native_layers is not None and step.kernel is not None:
            out = self._decode_layers(native, step, hidden, x, cos, sin)
            if out is not None:
                return self.model.lm_head(out[:, keep, :])
        return self.layers(step, cache, (hidden, x, cos, sin), keep, ops)

    def layers(
        self,
        step: Step,
        cache: StepCache,
        state: tuple[torch.Tensor, ...],
        keep: torch.Tensor,
        ops: LayerOps,
        start: int = 0,
    ) -> torch.Tensor:
        """The layers from ``start`` on, then the logits at ``keep``; ``state``: the residual stream
        before ``start``, its normed input, the rotary tables (given up: :mod:`.pause`)."""
        (hidden, x, cos, sin), inner = state, self.model.model
        heads, kv_heads, head_dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        qk_sizes = [(heads + kv_heads) * head_dim, kv_heads * head_dim]
        tokens = hidden.shape[1]
        kwargs = {STEP_KWARG: step}
        for index, (layer, fused) in enumerate(zip(inner.layers, self.fused, strict=True)):
            if index < start:
                continue
            attention = layer.self_attn
            query_key, value = fused.qkv(x).split(qk_sizes, dim=-1)
            # queries and keys rotated in one go: (tokens, heads + kv_heads, head_dim)
            query_key = ops.rotate(query_key.view(tokens, heads + kv_heads, head_dim), cos, sin)
            query = query_key[:, :heads].transpose(0, 1).unsqueeze(0)  # (1, heads, tokens, head_dim)
            key = query_key[:, heads:].transpose(0, 1).unsqueeze(0)
            value = value.view(1, tokens, kv_heads, head_dim).transpose(1, 2)
            cache.update(key, value, index)
            try:
                out, _ = batched_attention(attention, query, key, value, None, attention.scaling, **kwargs)
            except StepInterrupted as exc:
                raise LayersInterrupted(str(exc), index, hidden, x, cos, sin) from None
            delta = attention.o_proj(out.reshape(1, tokens, -1))
            norm = layer.post_attention_layernorm
            x = ops.add_rms_norm(hidden, delta, norm.weight, float(norm.variance_epsilon))
            delta = layer.mlp.down_proj(TorchOps.silu_mul(fused.gate_up(x)))
            x = ops.add_rms_norm(hidden, delta, *self._norms[index + 1])
        return self.model.lm_head(x[:, keep, :])

    def _decode_layers(
        self,
        native: LayerOps,
        step: Step,
        hidden: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """The decoder layers in one native call (``decode_step.cpp``: the loop of
        :meth:`__call__`, operator for operator) where every row decodes one token on the
        kernel; None where that call does not apply (a row prefills, or a layer's buffer has no
        room: the loop grows it)."""
        decode_layers = getattr(native, "decode_layers", None)
        if decode_layers is None or step.native_tokens is not None or len(step.native) != len(step.rows):
            return None
        if not self._packed_for(len(step.rows)):
            return None
        assert self._native_layers is not None
        by_row = [row.cache.layers for row in step.rows]
        buffers: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        for index in range(len(self.fused)):
            for layers in by_row:
                layer = layers[index]
                if layer._key_buffer is None:
                    return None
                buffers += (layer._key_buffer, layer._value_buffer)
                views += (layer.keys, layer.values)
        shape = self.shape
        paged = step.arenas is not None
        status, out = decode_layers(
            hidden,
            x,
            *self._native_layers,
            cos,
            sin,
            buffers,
            views,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            self.model.model.layers[0].self_attn.scaling,
            step.arenas if paged else [],
            step.tables if paged else [],
            step.masses,
            step.interrupt,
        )
        if status == 1:
            return None
        if status >= 2:  # every view was put back as it was
            raise StepInterrupted(f"the step was given up at layer {status - 2}")
        for layers in by_row:
            for layer in layers:
                layer.length += 1
        self.native_steps += 1
        return out


class LayerOps(Protocol):
    """The elementwise operations of a step: torch's (:class:`TorchOps`) or the native ones
    (SiLU * up is always torch's: vectorized, it is faster than a scalar loop)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """transformers' operations, operation for operation (its Llama code's rounding)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``LlamaRMSNorm.forward``."""
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return weight * h.to(dtype)

    @staticmethod
    def add_rms_norm(
        hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The residual add in place (the same bits as ``hidden + delta``), then the norm."""
        hidden.add_(delta)
        return TorchOps.rms_norm(hidden, weight, eps)

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        """``LlamaMLP``'s ``act_fn(gate_proj(x)) * up_proj(x)`` on the fused gate/up output."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)  # the product into SiLU's own output

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary_pos_emb`` for ``x`` ``(tokens, heads, head_dim)``: ``x * cos +
        rotate_half(x) * sin``, ``cos`` / ``sin`` ``(tokens, head_dim)``."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
