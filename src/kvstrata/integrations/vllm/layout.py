"""What kvstrata needs from vLLM's view of the model: the block layout, the weight fingerprint, and
how K and V lie inside one page of vLLM's paged cache.

* :func:`layout_from_vllm` builds the :class:`KVLayout` from the KV cache spec vLLM allocated
  (layers, KV heads, head size, cache dtype) with vLLM's block size as ``block_tokens``, so one
  vLLM block is one kvstrata block.
* :func:`model_fingerprint` digests the model's weights (``fingerprint_model_dir``), so blocks of
  other weights never share a key.
* :class:`PageFormat` maps a page (vLLM's logical per-layer view ``[blocks, H, N, C]``) to
  kvstrata's ``(2, H, N, D)`` K-then-V block and back. The arrangement inside ``C`` differs by
  attention backend (the CPU backend stores a head's K rows then its V rows; GPU backends put K and V
  side by side per token), so it is not assumed: :meth:`PageFormat.probe` asks the backend itself to
  write a known pattern into a scratch page and reads where each element landed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout, dtype_name

log = logging.getLogger(__name__)

_PROBE_BASE = 128  # integers below this are exact in bf16, fp16 and fp32
_PROBE_BASE_FP8 = 8  # and below this in both fp8 formats (E5M2 has two mantissa bits)


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


def attention_geometry(vllm_config: Any, kv_cache_config: Any | None) -> AttentionGeometry:
    """The geometry of the one full-attention KV cache group vLLM allocated."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if groups:
        if len(groups) != 1:
            raise ConfigError(
                f"the kvstrata connector supports models with one KV cache group (plain full attention); "
                f"this one has {len(groups)} (hybrid or sliding-window layers)"
            )
        spec = groups[0].kv_cache_spec
        for attr in ("num_kv_heads", "head_size", "block_size", "dtype"):
            if not hasattr(spec, attr):
                raise ConfigError(f"unsupported KV cache spec {type(spec).__name__} (no {attr})")
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            raise ConfigError("the kvstrata connector does not support sliding-window or chunked attention")
        head_v = getattr(spec, "head_size_v", spec.head_size)
        if head_v != spec.head_size:
            raise ConfigError(f"K head size {spec.head_size} differs from V head size {head_v}")
        if getattr(spec, "num_head_slots", None) not in (None, spec.num_kv_heads):
            raise ConfigError("packed KV cache pages (num_head_slots) are not supported")
        return AttentionGeometry(
            tuple(groups[0].layer_names), spec.num_kv_heads, spec.head_size, spec.block_size, spec.dtype
        )
    # no KV cache config (older call sites): the model config says the same for plain attention
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    num_layers = model_config.get_num_layers(parallel)
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model_config.dtype if cache_dtype == "auto" else FP8_CACHES.get(cache_dtype)
    if dtype is None:
        raise ConfigError(
            f"KV cache dtype {cache_dtype!r} is not supported by kvstrata (use 'auto' or one of "
            f"{', '.join(FP8_CACHES)})"
        )
    return AttentionGeometry(
        tuple(f"layer.{i}" for i in range(num_layers)),
        model_config.get_num_kv_heads(parallel),
        model_config.get_head_size(),
        vllm_config.cache_config.block_size,
        dtype,
    )


FP8_CACHES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8" is E4M3 (the probe checks the backend agrees)
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM's fp8 KV cache dtypes kvstrata stores as they are: vLLM allocates them as ``uint8``; the
connector views them as the 8-bit float they hold (same bytes)."""


def cache_dtype(vllm_config: Any, allocated: torch.dtype) -> torch.dtype:
    """The dtype the KV cache's elements are: what vLLM allocated, or the fp8 format a ``uint8``
    cache holds (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``)."""
    name = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if name in ("auto", "float32", "float16", "half", "bfloat16", "float") and allocated.is_floating_point:
        return allocated
    if name in FP8_CACHES and allocated in (torch.uint8, FP8_CACHES[name]):
        return FP8_CACHES[name]
    raise ConfigError(
        f"vLLM's KV cache dtype {name!r} ({allocated}) is not supported by kvstrata: use 'auto' "
        f"(the model's dtype) or one of {', '.join(FP8_CACHES)}"
    )


def tensor_parallel_size(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.tensor_parallel_size)


def layout_from_vllm(vllm_config: Any, kv_cache_config: Any | None) -> KVLayout:
    """kvstrata's layout for the model vLLM runs: one vLLM block = one kvstrata block, of one
    tensor-parallel rank (its share of the KV heads; every rank has the same layout, and its own
    keys: see ``ranks``)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "the kvstrata connector supports pipeline_parallel_size=1 "
            f"(got {parallel.pipeline_parallel_size}); tensor parallelism is supported"
        )
    geometry = attention_geometry(vllm_config, kv_cache_config)
    try:
        dtype = dtype_name(cache_dtype(vllm_config, geometry.dtype))
    except ConfigError as exc:
        raise ConfigError(f"vLLM's KV cache dtype is not supported by kvstrata: {exc}") from exc
    return KVLayout(
        num_layers=len(geometry.layer_names),
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_size,
        dtype=dtype,
        block_tokens=geometry.block_size,
    )


def resolve_model_dir(vllm_config: Any) -> Path | None:
    """The local directory holding the model's weights: the path given to vLLM, or the Hugging Face
    cache snapshot of a hub name (looked up offline; never downloaded)."""
    model_config = vllm_config.model_config
    name = str(model_config.model)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(name, revision=getattr(model_config, "revision", None), local_files_only=True)
        )
    except Exception:
        return None


def model_fingerprint(vllm_config: Any, override: bytes | None = None) -> bytes:
    """The weight fingerprint that roots every block key of this model (see ``keys.root_key``).

    ``override`` (``model_fingerprint`` in the extra config) wins; otherwise the content digest of
    the model directory's safetensors and architecture config (``fingerprint_model_dir``, cached by
    file identity so the weights are hashed once), exactly as the transformers integration keys its
    blocks. The KV dtype is part of the layout (and so of every key); a quantization method, which
    changes the KV the same weights produce, is mixed in.
    """
    if override is not None:
        return override
    model_dir = resolve_model_dir(vllm_config)
    if model_dir is None:
        raise ConfigError(
            f"cannot find the weights of {vllm_config.model_config.model!r} on local disk to fingerprint "
            "them; set model_fingerprint in kv_connector_extra_config"
        )
    from kvstrata.integrations.transformers.model import fingerprint_model_dir

    digest = fingerprint_model_dir(model_dir)
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if not quantization:
        return digest
    extra = f"quantization={quantization}".encode()
    return hashlib.blake2b(digest + extra, digest_size=32, person=b"kvstrata-vllm").digest()


class PageFormat:
    """Where each K/V element of a block lies inside one page ``[H, N, C]`` of a layer's cache.

    ``index`` has shape ``(2, H, N, D)``: the flat offset inside the page of K (``[0]``) and V
    (``[1]``) of each head, token and channel.
    """

    def __init__(self, page_shape: tuple[int, ...], index: torch.Tensor, source: str) -> None:
        self.page_shape = page_shape
        self.index = index
        self.flat_index = index.reshape(-1)
        self.source = source
        # Every backend seen so far places K and V each at an affine offset of (head, token, channel)
        # (dense K|V per token on GPUs; on CPU each head's K transposed, [D, N], then its V [N, D]):
        # then a transfer is two strided copies per page, not a gather.
        self._affine = _affine_strides(index)

    @classmethod
    def dense(cls, page_shape: tuple[int, int, int], head_size: int) -> PageFormat:
        """``C`` holds K then V of the same token (the standard dense ``[B, H, N, K|V]`` page)."""
        heads, tokens, content = page_shape
        if content != 2 * head_size:
            raise ConfigError(f"page content {content} is not 2 x head size {head_size}")
        flat = torch.arange(heads * tokens * content, dtype=torch.long).view(heads, tokens, 2, head_size)
        return cls(page_shape, flat.permute(2, 0, 1, 3).contiguous(), "dense")

    @classmethod
    def probe(
        cls,
        layer: Any,
        kv_cache: torch.Tensor,
        head_size: int,
        block_size: int,
        *,
        elements: torch.dtype | None = None,
        inputs: torch.dtype | None = None,
    ) -> PageFormat | None:
        """Ask the attention backend where it writes K and V: ``layer.impl.do_kv_cache_update``
        fills a one-page scratch cache with coded values, read back digit by digit. None when the
        backend offers no such call or the result is not a clean permutation.

        ``kv_cache`` is as vLLM allocated it; ``elements`` is what its elements are when that
        differs (an fp8 format in a ``uint8`` cache), ``inputs`` the dtype of the K and V the
        backend is handed (the model's). fp8 holds only small integers exactly: base 8 digits."""
        impl = getattr(layer, "impl", None)
        update = getattr(impl, "do_kv_cache_update", None)
        if update is None:
            return None
        elements = elements or kv_cache.dtype
        inputs = inputs or kv_cache.dtype
        base = _PROBE_BASE if elements.itemsize > 1 else _PROBE_BASE_FP8
        page_shape = tuple(kv_cache.shape[1:])
        heads = page_shape[0]
        n = 2 * heads * block_size * head_size
        ids = torch.arange(n, dtype=torch.long).view(2, block_size, heads, head_size)  # (kv, token, head, d)
        found = torch.zeros(int(torch.tensor(page_shape).prod()), dtype=torch.long)
        written = torch.ones_like(found, dtype=torch.bool)
        slots = torch.arange(block_size, dtype=torch.long, device=kv_cache.device)
        digits = 1
        while base**digits < n:
            digits += 1
        try:
            for digit in range(digits):
                scale = base**digit
                coded = ((ids // scale) % base).to(inputs).to(kv_cache.device)
                scratch = torch.full((1, *page_shape), -1.0, dtype=elements, device=kv_cache.device)
                key, value = coded[0].contiguous(), coded[1].contiguous()
                update(layer, key, value, scratch.view(kv_cache.dtype), slots)
                values = scratch.reshape(-1).to(torch.float32).cpu()
                if not bool((values == values.round()).all()):
                    return None  # not the element format assumed
                written &= values >= 0
                found += values.clamp(min=0).to(torch.long) * scale
        except Exception as exc:  # a backend that needs more context than a scratch page
            log.info("kvstrata: probing the KV page layout failed (%s); assuming dense pages", exc)
            return None
        if n != int(written.sum()):
            return None
        positions = torch.nonzero(written).squeeze(1)
        index = torch.full((n,), -1, dtype=torch.long)
        if bool((found[positions] >= n).any()):
            return None
        index[found[positions]] = positions
        if bool((index < 0).any()):
            return None
        # ids were laid out (kv, token, head, d); kvstrata wants (kv, head, token, d)
        index = index.view(2, block_size, heads, head_size).permute(0, 2, 1, 3).contiguous()
        return cls(page_shape, index, "probed")

    # -- conversions -----------------------------------------------------------------------------
    def _kv_views(self, pages: torch.Tensor) -> list[torch.Tensor] | None:
        """``(n, H, N, D)`` strided views of K and V inside ``(n, H, N, C)`` pages, when the format
        is affine and the pages are dense."""
        if self._affine is None or not pages.is_contiguous() or pages[0].numel() != self.flat_index.numel():
            return None
        n = pages.shape[0]
        size = (n, *self.index.shape[1:])
        base = pages.storage_offset()
        return [
            pages.as_strided(size, (pages[0].numel(), *strides), base + offset)
            for offset, strides in self._affine
        ]

    def write_page(self, page: torch.Tensor, block: torch.Tensor) -> bool:
        """Write one ``(2, H, N, D)`` block into ``page`` (a ``[H, N, C]`` view of the cache) in
        place; False (nothing written) when this format or page needs the general path."""
        views = self._kv_views(page.unsqueeze(0))
        if views is None:
            return False
        for kv, view in enumerate(views):
            view[0].copy_(block[kv])
        return True

    def read_pages_into(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """``(n, H, N, C)`` pages into ``out``, an ``(n, 2, H, N, D)`` view (no intermediate)."""
        views = self._kv_views(pages)
        if views is None:
            out.copy_(self.pages_to_blocks(pages))
            return
        for kv, view in enumerate(views):
            out[:, kv].copy_(view)

    def pages_to_blocks(self, pages: torch.Tensor) -> torch.Tensor:
        """``(n, H, N, C)`` pages -> ``(n, 2, H, N, D)`` K-then-V blocks."""
        n = pages.shape[0]
        views = self._kv_views(pages)
        if views is not None:
            return torch.stack(views, dim=1)
        flat = pages.reshape(n, -1)
        return flat[:, self.flat_index.to(flat.device)].view(n, *self.index.shape)

    def blocks_to_pages(self, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write ``(n, 2, H, N, D)`` blocks into ``out`` (``(n, H, N, C)``, contiguous; page bytes
        outside the index, padding, keep what ``out`` held)."""
        n = out.shape[0]
        views = self._kv_views(out)
        if views is not None:
            for kv, view in enumerate(views):
                view.copy_(blocks[:, kv])
            return out
        flat = out.view(n, -1)
        flat[:, self.flat_index.to(flat.device)] = blocks.reshape(n, -1).to(flat.dtype)
        return out


def _affine_strides(index: torch.Tensor) -> list[tuple[int, tuple[int, int, int]]] | None:
    """Per K and V, ``(offset, (head, token, channel) strides)`` when ``index`` is exactly that."""
    out = []
    _, heads, tokens, dim = index.shape
    grid = [
        torch.arange(size).view(*[-1 if i == axis else 1 for i in range(3)])
        for axis, size in enumerate((heads, tokens, dim))
    ]
    for kv in range(2):
        part = index[kv]
        offset = int(part[0, 0, 0])
        strides = (
            int(part[1, 0, 0]) - offset if heads > 1 else 0,
            int(part[0, 1, 0]) - offset if tokens > 1 else 0,
            int(part[0, 0, 1]) - offset if dim > 1 else 0,
        )
        if min(strides) < 0:
            return None
        expected = offset + grid[0] * strides[0] + grid[1] * strides[1] + grid[2] * strides[2]
        if not torch.equal(expected, part):
            return None
        out.append((offset, strides))
    return out
