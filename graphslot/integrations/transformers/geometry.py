"""What a transformers model caches per token: its layers' kinds and each layer's K and V shapes.

* :func:`attention_layers`: each decoder layer's kind (full or sliding, and its window);
* :class:`LayerGeometry`: the heads and widths of the K and V one layer writes per token,
  one per layer (:data:`KVGeometry`): a multi-query model writes one KV head, Falcon's
  new architecture broadcasts K and V to every head first, an MLA model (DeepSeek-V2/V3,
  MiniCPM3) caches its compressed latent, whose K and V widths differ, and a model may
  shape each layer its own way. :func:`config_geometry` is the config's guess;
  :func:`.cache.kv_geometry` learns the truth from one forward of the model;
* :func:`bytes_per_slot`: what one KV slot costs, the unit every pool size is counted in
  (:mod:`.budget`);
* :class:`GeometryKVPool`: the pool with each layer's K and V shaped so.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...kvpool import PagedKVCache

FULL = "full_attention"
SLIDING = "sliding_attention"


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) transformers config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_layers(config) -> List[Tuple[str, Optional[int]]]:
    """``(layer type, sliding window or None)`` per decoder layer of a transformers config.

    ``config.layer_types`` when the config has it (Qwen2/Qwen3), else every layer is
    sliding when ``config.sliding_window`` is set (Mistral) and full otherwise (Llama).
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * n
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"{type(config).__name__}: layer types {unknown} are not supported by PagedCache, which "
                         f"serves '{FULL}' and '{SLIDING}' layers only")
    if SLIDING in types and not window:
        raise ValueError(f"{type(config).__name__} has '{SLIDING}' layers but no sliding_window")
    return [(t, window if t == SLIDING else None) for t in types]


class LayerGeometry(NamedTuple):
    """What one layer writes per token: K as ``[k_heads, k_width]``, V as ``[v_heads, v_width]``."""

    k_heads: int
    k_width: int
    v_heads: int
    v_width: int

    @property
    def elements(self) -> int:
        return self.k_heads * self.k_width + self.v_heads * self.v_width


#: One :class:`LayerGeometry` per decoder layer.
KVGeometry = Tuple[LayerGeometry, ...]


def config_geometry(config) -> Optional[KVGeometry]:
    """The geometry a config suggests (``num_key_value_heads`` or ``num_attention_heads``
    heads of ``head_dim``, or ``hidden_size // num_attention_heads``, for K and V alike),
    or None when it names no heads. A guess: :meth:`.cache.PagedCache.probe` learns the truth."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    width = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not kv_heads or not width:
        return None
    return (LayerGeometry(kv_heads, width, kv_heads, width),) * len(attention_layers(config))


def bytes_per_slot(geometry: Sequence[LayerGeometry], dtype: torch.dtype) -> int:
    """Bytes one KV slot takes: K and V over every layer."""
    return sum(layer.elements for layer in geometry) * dtype.itemsize


def describe_slot(geometry: KVGeometry, itemsize: int) -> str:
    """What one slot holds, for messages."""
    first = geometry[0]
    if all(layer == first for layer in geometry) and (first.k_heads, first.k_width) == (first.v_heads, first.v_width):
        return (f"{len(geometry)} layers x {first.k_heads} KV heads x head_dim {first.k_width} x 2 (K and V) x "
                f"{itemsize} bytes")
    return f"{bytes_per_slot(geometry, torch.uint8) * itemsize} bytes (K and V over {len(geometry)} layers)"


class GeometryKVPool(PagedKVCache):
    """:class:`~graphslot.kvpool.PagedKVCache` with each layer's K and V shaped as it writes them."""

    def __init__(self, geometry: KVGeometry, size: int, dtype: torch.dtype, device: torch.device):
        self.geometry = tuple(geometry)
        first = self.geometry[0]
        super().__init__(len(self.geometry), first.k_heads, first.k_width, size, dtype=dtype, device=device)

    def layer_shapes(self, layer: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        g = self.geometry[layer]
        return (g.k_heads, g.k_width), (g.v_heads, g.v_width)
