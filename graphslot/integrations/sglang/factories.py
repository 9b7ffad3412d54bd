"""sglang 0.5.23's registry factories, backed by graphslot's shipped specs.

``build_decode_registry`` is ``decode.yaml``, ``build_eager_registry`` its ``eager``
preset and ``build_prefill_registry`` ``prefill.yaml``, each read with
``absent_fields: skip`` (a batch field that is None or missing is not copied and the
view carries the None, as in sglang). sglang's arguments become the specs' params
(``num_dp_ranks`` is ``dp_size``); ``attn_tp_sharded_fn`` and the attention-TP rank
and size become *live* params, read at each fill from the predicate and from sglang's
``forward_batch_info.get_parallel()``, and only when the count is sharded, as sglang
reads them. With ``source``, each slot adopts the same-named tensor (``ValueError``
when it is missing), and the structured slots sglang registers only when the source
carries them (``ngram_embedding_info.*``, ``pp_proxy_tensors.*``, ``rids_int``,
``bootstrap_room_ids_int``) are registered from Python (:mod:`.entries`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from ...spec.loading import load_spec, shipped_spec_path, spec_from_dict
from ...spec.model import RegistrySpec
from ...spec.resolve import evaluate_field, resolve_params, resolve_slots
from .entries import ABSENT_FIELDS
from .registry import CudaGraphBufferRegistry
from .sglang_env import attn_tp_rank, attn_tp_size, index_semantic_buffers
from .slots import GraphSlot, PaddingPolicy, SliceDim

_BASE: Dict[str, RegistrySpec] = {}


def base_spec(kind: str) -> RegistrySpec:
    """The shipped spec ``kind`` with ``absent_fields: skip`` (built once per process):
    graphslot's own file, never a spec of that name in the working directory's project,
    so the drop-in is sglang wherever sglang is started."""
    spec = _BASE.get(kind)
    if spec is None:
        data = load_spec(shipped_spec_path(kind)).to_dict()
        data["absent_fields"] = ABSENT_FIELDS
        spec = _BASE[kind] = spec_from_dict(data, label=f"<graphslot.integrations.sglang: {kind}.yaml>")
    return spec


def _replicated(num_tokens: int) -> bool:
    return False


class SpecShape:
    """A spec slot's ``shape_fn``: its extents evaluated for ``(max_bs, max_num_tokens)``."""

    __slots__ = ("extents", "params")

    def __init__(self, extents, params):
        self.extents = tuple(extents)
        self.params = params

    def __call__(self, max_bs: int, max_num_tokens: int) -> tuple:
        env = dict(self.params, max_bs=max_bs, max_num_tokens=max_num_tokens)
        return tuple(int(evaluate_field(e, env)) for e in self.extents)


def _live_shard(attn_tp_sharded_fn: Callable[[int], bool]) -> Dict[str, Any]:
    return {"attn_tp_sharded": lambda ctx: bool(attn_tp_sharded_fn(ctx.padded_num_tokens)),
            "attn_tp_rank": attn_tp_rank, "attn_tp_size": attn_tp_size}


def from_spec(kind: str, params: Dict[str, Any], *, device: Any, max_bs: int, max_num_token: int, share_pool: Any,
              source: Any, preset: Optional[str] = None, sharded_fn: Optional[Callable[[int], bool]] = None,
              pp_axis: Optional[str] = None) -> CudaGraphBufferRegistry:
    """A registry holding the enabled slots of the shipped spec ``kind`` for these
    params, allocated (or adopted from ``source``) in spec order; with the count on,
    the attention-TP params are live (``sharded_fn`` and sglang's parallel state); with
    ``source``, the structured slots it carries follow (``pp_axis``: register_structured)."""
    if params.get("enable_num_token_non_padded"):
        params = {**params, **_live_shard(sharded_fn or _replicated)}
    spec = base_spec(kind)
    resolved = resolve_params(spec, params, preset)
    reg = CudaGraphBufferRegistry(device=device, max_bs=max_bs, max_num_tokens=max_num_token, share_pool=share_pool)
    reg._base = (spec, params, preset)
    fixed = {k: v for k, v in resolved.items() if not spec.params[k].live}
    for declared, slot in zip(spec.slots, resolve_slots(spec, resolved, max_bs, max_num_token)):
        if not slot.enabled:
            continue
        graph_slot = GraphSlot(
            slot.name, SpecShape(declared.shape, fixed), slot.dtype, axis=slot.axis,
            device=torch.device("cpu") if slot.host else None,
            padding_policy=PaddingPolicy(declared.padding or "foreach_copy"), pad_value=slot.pad_value,
            copy_from_fb=slot.copy_from_fb, slice_fn=SliceDim(slot.slice_dim) if slot.slice_dim else None)
        if source is not None and slot.adopt:
            bind = getattr(source, slot.name, None)
            if bind is None:
                raise ValueError(f"source is missing buffer {slot.name!r} required by the {kind} registry; "
                                 "cannot adopt.")
            buffer = reg._checked_bind(slot.name, bind, slot.shape, slot.dtype, graph_slot.device)
        else:
            fresh = reg._zeros(slot.name, slot.shape, slot.dtype, graph_slot.device)
            buffer = reg._share(slot.name, fresh, slot.pad_value if slot.fills_at_allocation else None)
        reg._add(graph_slot, buffer)
    if source is not None and pp_axis is not None:
        register_structured(reg, source, pp_axis)
    return reg


def build_decode_registry(
    *, device: torch.device, max_bs: int, max_num_token: int, seq_len_fill_value: int, cache_loc_dtype: torch.dtype,
    enable_mamba_track: bool = False, is_encoder_decoder: bool = False, encoder_len_fill_value: int = 0,
    encoder_lens_dtype: torch.dtype = torch.int32, enable_num_token_non_padded: bool = False,
    require_gathered_buffer: bool = False, enable_prefill_cp: bool = False, require_mlp_tp_gather: bool = False,
    attn_tp_sharded_fn: Callable[[int], bool] = _replicated, num_dp_ranks: int = 1,
    register_global_num_tokens: bool = True, share_pool: bool = True, source: Optional[Any] = None,
    enable_global_num_token_non_padded: bool = False,
) -> CudaGraphBufferRegistry:
    """sglang's ``build_decode_registry`` (``decode.yaml``); ``enable_global_num_token_non_padded``
    is the flag of later sglang versions (a registry-owned 0-d copy of the global count)."""
    params: Dict[str, Any] = dict(
        seq_len_fill_value=seq_len_fill_value, cache_loc_dtype=cache_loc_dtype, enable_mamba_track=enable_mamba_track,
        is_encoder_decoder=is_encoder_decoder, encoder_len_fill_value=encoder_len_fill_value,
        encoder_lens_dtype=encoder_lens_dtype, enable_num_token_non_padded=enable_num_token_non_padded,
        enable_global_num_token_non_padded=enable_global_num_token_non_padded,
        require_gathered_buffer=require_gathered_buffer, enable_prefill_cp=enable_prefill_cp,
        require_mlp_tp_gather=require_mlp_tp_gather, dp_size=num_dp_ranks,
        register_global_num_tokens=register_global_num_tokens)
    reg = from_spec("decode", params, device=device, max_bs=max_bs, max_num_token=max_num_token,
                    share_pool=share_pool, source=source, sharded_fn=attn_tp_sharded_fn, pp_axis="none")
    registered = set(reg.slot_names())
    zero = {n for n in registered if reg.get_slot(n).padding_policy is PaddingPolicy.ZERO}
    assert zero == index_semantic_buffers() & registered, (
        f"ZERO-policy slots and INDEX_SEMANTIC_BUFFERS disagree: {sorted(zero)} vs "
        f"{sorted(index_semantic_buffers() & registered)}")
    return reg


def build_prefill_registry(
    *, device: torch.device, max_bs: int, max_num_token: int, cache_loc_dtype: torch.dtype,
    is_multimodal: bool = False, hidden_size: int = 0, embed_dtype: Optional[torch.dtype] = None,
    enable_mamba_track: bool = False, enable_num_token_non_padded: bool = False,
    require_gathered_buffer: bool = False, enable_prefill_cp: bool = False,
    attn_tp_sharded_fn: Callable[[int], bool] = _replicated, register_input_embeds: Optional[bool] = None,
    share_pool: bool = True, source: Optional[Any] = None, enable_global_num_token_non_padded: bool = False,
) -> CudaGraphBufferRegistry:
    """sglang's ``build_prefill_registry`` (``prefill.yaml``); ``embed_dtype=None`` is
    torch's default dtype, as sglang's ``torch.zeros(dtype=None)`` gives."""
    params: Dict[str, Any] = dict(
        cache_loc_dtype=cache_loc_dtype, is_multimodal=is_multimodal, hidden_size=hidden_size,
        embed_dtype=torch.get_default_dtype() if embed_dtype is None else embed_dtype,
        enable_mamba_track=enable_mamba_track, enable_num_token_non_padded=enable_num_token_non_padded,
        enable_global_num_token_non_padded=enable_global_num_token_non_padded,
        require_gathered_buffer=require_gathered_buffer, enable_prefill_cp=enable_prefill_cp,
        register_input_embeds=is_multimodal if register_input_embeds is None else register_input_embeds)
    return from_spec("prefill", params, device=device, max_bs=max_bs, max_num_token=max_num_token,
                     share_pool=share_pool, source=source, sharded_fn=attn_tp_sharded_fn, pp_axis="tokens")


def build_eager_registry(
    *, device: torch.device, max_bs: int, max_num_token: int, cache_loc_dtype: torch.dtype,
    enable_mamba_track: bool = False, is_encoder_decoder: bool = False, encoder_len_fill_value: int = 0,
    encoder_lens_dtype: torch.dtype = torch.int32,
) -> CudaGraphBufferRegistry:
    """sglang's ``build_eager_registry``: ``decode.yaml``'s ``eager`` preset, pooled."""
    params = dict(cache_loc_dtype=cache_loc_dtype, enable_mamba_track=enable_mamba_track,
                  is_encoder_decoder=is_encoder_decoder, encoder_len_fill_value=encoder_len_fill_value,
                  encoder_lens_dtype=encoder_lens_dtype)
    return from_spec("decode", params, device=device, max_bs=max_bs, max_num_token=max_num_token,
                     share_pool=True, source=None, preset="eager")


def register_structured(reg: CudaGraphBufferRegistry, source: Any, pp_axis: str) -> None:
    """The adopt-only slots sglang registers when ``source`` carries them: copied
    from a nested batch field or from ``fill_from(pp_proxy_tensors=...)``."""
    ngram = getattr(source, "ngram_embedding_info", None)
    if pp_axis == "none" and ngram is not None:
        for attr in ("column_starts", "req_lens"):
            backing = getattr(ngram, attr)
            reg.register_slot(GraphSlot(f"ngram_embedding_info.{attr}", _fixed(backing.shape), backing.dtype,
                                        axis="none", padding_policy=PaddingPolicy.KEEP_PAD,
                                        source_fn=NestedField("ngram_embedding_info", attr)), bind=backing)
    pp = getattr(source, "pp_proxy_tensors", None)
    for key, backing in (pp or {}).items():
        tokens = pp_axis == "tokens"
        shape = (reg.max_num_tokens, *backing.shape[1:]) if tokens else tuple(backing.shape)
        reg.register_slot(GraphSlot(f"pp_proxy_tensors.{key}", _fixed(shape), backing.dtype, axis=pp_axis,
                                    padding_policy=PaddingPolicy.ZERO if tokens else PaddingPolicy.KEEP_PAD,
                                    source_fn=ProxyTensor(key)), bind=backing)
    if pp_axis == "none":
        for name in ("rids_int", "bootstrap_room_ids_int"):
            canary = getattr(source, name, None)
            if canary is not None:
                reg.register_slot(GraphSlot(name, _fixed(canary.shape), canary.dtype, axis="bs"), bind=canary)


def _fixed(shape) -> Callable[[int, int], tuple]:
    shape = tuple(shape)
    return lambda max_bs, max_num_tokens: shape


class NestedField:
    """``source_fn``: ``fb.<field>.<attr>``, or None when the batch has no ``<field>``."""

    __slots__ = ("field", "attr")

    def __init__(self, field: str, attr: str):
        self.field = field
        self.attr = attr

    def __call__(self, fb: Any, ctx: Any) -> Any:
        info = getattr(fb, self.field, None)
        return None if info is None else getattr(info, self.attr)


class ProxyTensor:
    """``source_fn``: ``pp_proxy_tensors.tensors.get(key)`` from ``fill_from``'s side input."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key

    def __call__(self, fb: Any, ctx: Any) -> Any:
        proxy = ctx.pp_proxy_tensors
        return None if proxy is None else proxy.tensors.get(self.key)
