"""graphslot's shipped specs against sglang 0.5.23's real ``CudaGraphBufferRegistry``.

For each case of a matrix of deployments, sglang's registry (``build_decode_registry``,
``build_prefill_registry`` or ``build_eager_registry``; ``share_pool=False``, CPU) and
ours (the shipped spec with the matching params, in both modes) are built side by side,
every buffer of all of them is poisoned with the same values before each step, all are
filled from the same random real sglang ``ForwardBatch``, and every common buffer and
every field of the extracted views is compared bit for bit. Where graphslot
deliberately differs (``graphslot/slot_specs/README.md``, "Compatibility with sglang
0.5.23"), a test below asserts exactly that difference.

Install what it needs with
``python -m pip install --no-deps sglang==0.5.23 msgspec``; without sglang the module
is skipped. ``tests/sglang_loader.py`` imports the three sglang modules the registry
needs with stand-ins for the rest of sglang.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any, Dict, List

import pytest
import torch

import graphslot as gs

import sglang_loader
from graphslot.api import build

try:
    SGL = sglang_loader.load()
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang's buffer registry cannot be imported: {exc}", allow_module_level=True)

REG = SGL.registry
ForwardBatch = SGL.fbi.ForwardBatch
ForwardMode = SGL.fbi.ForwardMode
CPU = torch.device("cpu")
MODES = ("interpreted", "generated")
STEPS = 6

# Slots graphslot has and sglang 0.5.23 does not (documented extensions).
EXTENSIONS = {"out_cache_loc_swa"}


def test_installed_sglang_is_the_pinned_version():
    assert SGL.version == sglang_loader.TARGET_VERSION, (
        f"the compat suite targets sglang {sglang_loader.TARGET_VERSION}, installed: {SGL.version}")


# --- building both sides ---------------------------------------------------------------

@dataclasses.dataclass
class Case:
    id: str
    kind: str                       # "decode", "prefill" or "eager"
    knobs: Dict[str, Any]           # in sglang's argument names (see to_params)
    max_bs: int = 8
    tokens_per_req: int = 1         # decode: tokens per request (speculative verify > 1)
    max_num_tokens: int = 32        # prefill / eager: the token ceiling
    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    num_dp_ranks: int = 1
    multimodal_batches: bool = False  # decode: mrope_positions set on some steps


# sglang argument -> graphslot param, where the names differ (the README's table).
RENAMED = {"num_dp_ranks": "dp_size"}


def to_params(case: Case) -> Dict[str, Any]:
    params: Dict[str, Any] = {}
    for key, value in case.knobs.items():
        if key == "attn_tp_sharded":   # sglang: attn_tp_sharded_fn=lambda n: value
            params["attn_tp_sharded"] = value
            continue
        params[RENAMED.get(key, key)] = value
    if case.attn_tp_size != 1 or case.attn_tp_rank != 0:
        params.update(attn_tp_rank=case.attn_tp_rank, attn_tp_size=case.attn_tp_size)
    if case.kind == "decode" and "num_dp_ranks" not in case.knobs:
        params["dp_size"] = case.num_dp_ranks
    return params


def max_tokens(case: Case) -> int:
    return case.max_bs * case.tokens_per_req if case.kind == "decode" else case.max_num_tokens


def build_sglang(case: Case):
    knobs = dict(case.knobs)
    with sglang_loader.parallel(attn_tp_rank=case.attn_tp_rank, attn_tp_size=case.attn_tp_size,
                                num_dp_ranks=case.num_dp_ranks):
        common = dict(device=CPU, max_bs=case.max_bs, max_num_token=max_tokens(case))
        if case.kind == "eager":
            # build_eager_registry hard-codes share_pool=True: start from an empty
            # process-wide pool so this registry owns fresh buffers, as share_pool=False would.
            SGL.input_buffers._forward_input_buffer_pool.clear()
            try:
                return REG.build_eager_registry(**common, **knobs)
            finally:
                SGL.input_buffers._forward_input_buffer_pool.clear()
        if "attn_tp_sharded" in knobs:
            sharded = knobs.pop("attn_tp_sharded")
        else:  # ModelRunner.attn_tp_sequence_sharded: require_gathered_buffer() for every bucket
            sharded = knobs.get("require_gathered_buffer", False)
        knobs["attn_tp_sharded_fn"] = lambda num_tokens: sharded
        knobs.setdefault("cache_loc_dtype", torch.int64)
        if case.kind == "decode":
            knobs.setdefault("seq_len_fill_value", 1)
            knobs.setdefault("num_dp_ranks", case.num_dp_ranks)
            return REG.build_decode_registry(**common, share_pool=False, **knobs)
        return REG.build_prefill_registry(**common, share_pool=False, **knobs)


def build_ours(case: Case, mode: str):
    spec = "prefill" if case.kind == "prefill" else "decode"
    preset = "eager" if case.kind == "eager" else None
    return build(spec, max_bs=case.max_bs, max_num_tokens=max_tokens(case), device=CPU, params=to_params(case),
                             impl=mode, preset=preset)


# --- random batches ---------------------------------------------------------------------

def rand_int(g: torch.Generator, n: Any, high: int, dtype=torch.int64) -> torch.Tensor:
    shape = (n,) if isinstance(n, int) else tuple(n)
    return torch.randint(1, high, shape, generator=g, dtype=torch.int64).to(dtype)


def random_step(case: Case, rng: random.Random, g: torch.Generator, sgl_reg):
    """(fb, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens) with every field the
    registry reads set (optional ones sometimes None)."""
    names = set(sgl_reg.slot_names())
    if case.kind == "prefill":
        # The batch size is never padded on the prefill path; tokens pad to a bucket.
        raw_bs = padded_bs = rng.randint(1, case.max_bs)
        padded_n = rng.randint(raw_bs, case.max_num_tokens)
        raw_n = rng.randint(raw_bs, padded_n)
        mode = ForwardMode.EXTEND
    else:
        raw_bs = rng.randint(1, case.max_bs)
        padded_bs = rng.randint(raw_bs, case.max_bs)
        k = case.tokens_per_req
        raw_n, padded_n = raw_bs * k, padded_bs * k
        mode = ForwardMode.DECODE if k == 1 else ForwardMode.TARGET_VERIFY
        if case.kind == "eager" and rng.random() < 0.5:
            padded_bs, padded_n = raw_bs, raw_n  # eager never pads; check both anyway
    seq_lens = rand_int(g, raw_bs, 4000)
    cache_dtype = rng.choice([torch.int64, torch.int32])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=raw_bs,
        input_ids=rand_int(g, raw_n, 32000),
        req_pool_indices=rand_int(g, raw_bs, 64),
        seq_lens=seq_lens,
        out_cache_loc=rand_int(g, raw_n, 1 << 20, cache_dtype),
        seq_lens_sum=int(seq_lens.sum()),
        positions=rand_int(g, raw_n, 4000),
    )
    if case.kind != "prefill":
        fb.seq_lens_cpu = seq_lens.clone()
        fb.mrope_positions = (rand_int(g, (3, raw_n), 4000)
                              if case.multimodal_batches and rng.random() < 0.7 else None)
    elif "mrope_positions" in names:
        fb.mrope_positions = rand_int(g, (3, raw_n), 4000) if rng.random() < 0.8 else None
    if "mamba_track_indices" in names:
        fb.mamba_track_indices = rand_int(g, raw_bs, 128)
        fb.mamba_track_mask = torch.rand(raw_bs, generator=g) < 0.5
        if "mamba_track_seqlens" in names:
            fb.mamba_track_seqlens = rand_int(g, raw_bs, 4000)  # int64 on the batch
    if "encoder_lens" in names:
        fb.encoder_lens = rand_int(g, raw_bs, 1500, rng.choice([torch.int32, torch.int64]))
    # Non-padded counts: the global one (0-d or [1], sometimes beyond the bucket to
    # exercise the clamp), the local one, either, both or neither.
    which = rng.random()
    if which < 0.6:
        count = rng.randint(0, padded_n + 2)
        shape = rng.choice([(), (1,)])
        fb.global_num_token_non_padded = torch.full(shape, count, dtype=rng.choice([torch.int32, torch.int64]))
        fb.global_num_token_non_padded_cpu = count
    if which > 0.3:
        fb.num_token_non_padded = torch.tensor([rng.randint(0, raw_n)], dtype=torch.int32)
    if case.kind == "eager" or not case.knobs.get("register_global_num_tokens", True):
        # What build_eager_registry's callers bring themselves.
        fb.global_num_tokens_gpu = rand_int(g, 1, 100, torch.int32) if rng.random() < 0.5 else None
    return fb, raw_bs, padded_bs, raw_n, padded_n


# --- comparing --------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    # a copy with unit strides: contiguous() keeps a strided [1] tensor as it is, and view() refuses it
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(bits(a), bits(b))


def poison(registries: List[Any], names: List[str], rng: random.Random) -> None:
    """The same arbitrary values into each named buffer of every registry."""
    for name in names:
        bufs = [r.get_slot(name).buffer if hasattr(r, "get_slot") else r.slot(name).buffer for r in registries]
        ref = bufs[0]
        if ref.dtype == torch.bool:
            value = torch.rand(ref.shape) < 0.5
        elif ref.dtype.is_floating_point:
            value = torch.randn(ref.shape) * 1000
        else:
            value = torch.randint(-(1 << 30), 1 << 30, ref.shape)
        value = value.to(ref.dtype)
        for buf in bufs:
            buf.copy_(value)


def compare(case: Case, sgl_reg, ours, where: str) -> List[str]:
    out = []
    sgl_names, our_names = set(sgl_reg.slot_names()), set(ours.slot_names())
    if our_names - EXTENSIONS != sgl_names:
        out.append(f"{where}: slot sets differ: only sglang {sorted(sgl_names - our_names)}, "
                   f"only graphslot {sorted(our_names - sgl_names - EXTENSIONS)}")
    for name in sorted(sgl_names & our_names):
        a, b = sgl_reg.get_slot(name).buffer, ours.slot(name).buffer
        if not same_bits(a, b):
            out.append(f"{where}: buffer '{name}' differs: sglang {a.dtype} {list(a.shape)} {a.tolist()} "
                       f"vs graphslot {b.dtype} {list(b.shape)} {b.tolist()}")
    return out


def compare_views(sgl_view, our_view, fb, sgl_reg, ours, where: str) -> List[str]:
    out = []
    if sgl_view.batch_size != our_view.batch_size:
        out.append(f"{where}: view batch_size {sgl_view.batch_size} vs {our_view.batch_size}")
    for name in sorted(set(sgl_reg.slot_names()) | (set(ours.slot_names()) - EXTENSIONS)):
        a, b = getattr(sgl_view, name, None), getattr(our_view, name, None)
        carried = getattr(fb, name, None)
        if a is None or b is None:
            if (a is None) != (b is None):
                out.append(f"{where}: view '{name}': sglang {type(a).__name__}, graphslot {type(b).__name__}")
            continue
        if (a is carried) != (b is carried):
            out.append(f"{where}: view '{name}': one side carries the batch's tensor, the other a buffer")
            continue
        if a is carried:
            continue
        if not same_bits(a, b) or a.stride() != b.stride():
            out.append(f"{where}: view '{name}' differs: {list(a.shape)} {a.tolist()} vs {list(b.shape)} {b.tolist()}")
        own = ours.slot(name).buffer
        if b.data_ptr() != own.data_ptr():
            out.append(f"{where}: graphslot view '{name}' is not a view of its static buffer")
    return out


def run_case(case: Case, seed: int = 0) -> Dict[str, int]:
    """Fill all registries from STEPS random batches; returns mismatch counts by mode
    (and the number of buffer/field comparisons made) after asserting none."""
    rng, g = random.Random(f"{case.id}-{seed}"), torch.Generator().manual_seed(seed)
    sgl_reg = build_sglang(case)
    ours = {mode: build_ours(case, mode) for mode in MODES}
    mismatches: List[str] = []
    for mode, reg in ours.items():
        mismatches += compare(case, sgl_reg, reg, f"{case.id}/{mode}/at allocation")
    common = sorted(set(sgl_reg.slot_names()) & set(ours["interpreted"].slot_names()))
    checks = 0
    with sglang_loader.parallel(attn_tp_rank=case.attn_tp_rank, attn_tp_size=case.attn_tp_size,
                                num_dp_ranks=case.num_dp_ranks):
        for step in range(STEPS):
            fb, raw_bs, padded_bs, raw_n, padded_n = random_step(case, rng, g, sgl_reg)
            poison([sgl_reg, *ours.values()], common, rng)
            sgl_reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_n,
                              padded_num_tokens=padded_n)
            sgl_view = sgl_reg.extract_buffer(padded_bs=padded_bs, padded_num_tokens=padded_n,
                                              forward_batch_template=fb)
            for mode, reg in ours.items():
                where = f"{case.id}/{mode}/step {step} (bs {raw_bs}/{padded_bs}, tokens {raw_n}/{padded_n})"
                reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_n, padded_num_tokens=padded_n)
                view = reg.extract(fb, padded_bs=padded_bs, padded_num_tokens=padded_n)
                mismatches += compare(case, sgl_reg, reg, where)
                mismatches += compare_views(sgl_view, view, fb, sgl_reg, reg, where)
                checks += 2 * len(common) + 1
    assert mismatches == [], "\n".join(mismatches[:20]) + f"\n({len(mismatches)} mismatches)"
    return {"checks": checks, "mismatches": len(mismatches)}


D, P, E = "decode", "prefill", "eager"
CASES = [
    Case("decode-defaults", D, {}),
    Case("decode-fill0-int32-cache", D, {"seq_len_fill_value": 0, "cache_loc_dtype": torch.int32}),
    Case("decode-fill7", D, {"seq_len_fill_value": 7}),
    Case("decode-encoder-decoder", D, {"is_encoder_decoder": True, "encoder_len_fill_value": 3}),
    Case("decode-encoder-decoder-int64", D, {"is_encoder_decoder": True, "encoder_lens_dtype": torch.int64}),
    Case("decode-mamba", D, {"enable_mamba_track": True}),
    Case("decode-multimodal-verify", D, {}, tokens_per_req=3, multimodal_batches=True),
    Case("decode-num-token-non-padded", D, {"enable_num_token_non_padded": True}),
    Case("decode-ntnp-verify", D, {"enable_num_token_non_padded": True}, tokens_per_req=2),
    Case("decode-dp-gather", D, {"require_gathered_buffer": True}, num_dp_ranks=4),
    Case("decode-dp-mlp-gather", D, {"require_gathered_buffer": True, "require_mlp_tp_gather": True},
         num_dp_ranks=4),
    Case("decode-attn-tp-rank0-sharded", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True},
         attn_tp_rank=0, attn_tp_size=2, tokens_per_req=2),
    Case("decode-attn-tp-rank1-sharded", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True,
                                             "require_mlp_tp_gather": True},
         attn_tp_rank=1, attn_tp_size=2, num_dp_ranks=2, tokens_per_req=2),
    Case("decode-attn-tp-rank3-of-4", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True},
         attn_tp_rank=3, attn_tp_size=4),
    Case("decode-gathered-not-sharded", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True,
                                            "attn_tp_sharded": False}, attn_tp_rank=1, attn_tp_size=2),
    Case("decode-prefill-cp", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True,
                                  "enable_prefill_cp": True}, attn_tp_rank=1, attn_tp_size=2),
    Case("decode-no-global-num-tokens", D, {"register_global_num_tokens": False}),
    Case("decode-everything", D, {"seq_len_fill_value": 0, "cache_loc_dtype": torch.int32,
                                  "enable_mamba_track": True, "is_encoder_decoder": True,
                                  "encoder_len_fill_value": 5, "enable_num_token_non_padded": True,
                                  "require_gathered_buffer": True, "require_mlp_tp_gather": True},
         attn_tp_rank=1, attn_tp_size=2, num_dp_ranks=2, tokens_per_req=2, multimodal_batches=True),
    Case("eager-defaults", E, {"cache_loc_dtype": torch.int64}, max_num_tokens=32, multimodal_batches=True),
    Case("eager-mamba-encoder", E, {"cache_loc_dtype": torch.int32, "enable_mamba_track": True,
                                    "is_encoder_decoder": True, "encoder_len_fill_value": 2},
         max_num_tokens=24, num_dp_ranks=4),
    Case("prefill-defaults", P, {}),
    Case("prefill-int32-cache", P, {"cache_loc_dtype": torch.int32}),
    Case("prefill-num-token-non-padded", P, {"enable_num_token_non_padded": True}),
    Case("prefill-multimodal", P, {"is_multimodal": True, "hidden_size": 8, "embed_dtype": torch.float16}),
    Case("prefill-text-with-embeds", P, {"register_input_embeds": True, "hidden_size": 4,
                                         "embed_dtype": torch.bfloat16}),
    Case("prefill-multimodal-no-embeds", P, {"is_multimodal": True, "register_input_embeds": False}),
    Case("prefill-mamba", P, {"enable_mamba_track": True}),
    Case("prefill-attn-tp-rank0-sharded", P, {"enable_num_token_non_padded": True, "require_gathered_buffer": True},
         attn_tp_rank=0, attn_tp_size=2),
    Case("prefill-attn-tp-rank1-sharded", P, {"enable_num_token_non_padded": True, "require_gathered_buffer": True},
         attn_tp_rank=1, attn_tp_size=2),
    Case("prefill-sharded-without-gather", P, {"enable_num_token_non_padded": True, "attn_tp_sharded": True},
         attn_tp_rank=2, attn_tp_size=3),
    Case("prefill-cp", P, {"enable_num_token_non_padded": True, "require_gathered_buffer": True,
                           "enable_prefill_cp": True}, attn_tp_rank=1, attn_tp_size=2),
    Case("prefill-everything", P, {"cache_loc_dtype": torch.int32, "is_multimodal": True, "hidden_size": 4,
                                   "embed_dtype": torch.float32, "enable_mamba_track": True,
                                   "enable_num_token_non_padded": True, "require_gathered_buffer": True},
         attn_tp_rank=1, attn_tp_size=2),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bit_identical_to_sglang(case):
    result = run_case(case)
    assert result["mismatches"] == 0 and result["checks"] > 0


# --- params: names and defaults ---------------------------------------------------------

# sglang argument -> graphslot param, per builder (the README's table). Arguments with
# no param: device/max_bs/max_num_token are build_registry's own arguments,
# attn_tp_sharded_fn is the attn_tp_sharded param, share_pool/source are build_registry's.
BUILDER_ARGS = {
    "decode": ("build_decode_registry", {
        "seq_len_fill_value": "seq_len_fill_value", "cache_loc_dtype": "cache_loc_dtype",
        "enable_mamba_track": "enable_mamba_track", "is_encoder_decoder": "is_encoder_decoder",
        "encoder_len_fill_value": "encoder_len_fill_value", "encoder_lens_dtype": "encoder_lens_dtype",
        "enable_num_token_non_padded": "enable_num_token_non_padded",
        "require_gathered_buffer": "require_gathered_buffer", "enable_prefill_cp": "enable_prefill_cp",
        "require_mlp_tp_gather": "require_mlp_tp_gather", "num_dp_ranks": "dp_size",
        "register_global_num_tokens": "register_global_num_tokens",
    }),
    "prefill": ("build_prefill_registry", {
        "cache_loc_dtype": "cache_loc_dtype", "is_multimodal": "is_multimodal",
        "hidden_size": "hidden_size", "embed_dtype": "embed_dtype",
        "enable_mamba_track": "enable_mamba_track",
        "enable_num_token_non_padded": "enable_num_token_non_padded",
        "require_gathered_buffer": "require_gathered_buffer", "enable_prefill_cp": "enable_prefill_cp",
        "register_input_embeds": "register_input_embeds",
    }),
}
NOT_PARAMS = {"device", "max_bs", "max_num_token", "attn_tp_sharded_fn", "share_pool", "source"}
# Documented default differences: (spec, param) -> (sglang default, graphslot default).
DEFAULT_DEVIATIONS = {
    ("decode", "seq_len_fill_value"): (inspect.Parameter.empty, 1),
    ("decode", "cache_loc_dtype"): (inspect.Parameter.empty, torch.int64),
    ("prefill", "cache_loc_dtype"): (inspect.Parameter.empty, torch.int64),
    ("prefill", "hidden_size"): (0, 4096),
    ("prefill", "embed_dtype"): (None, torch.bfloat16),
    ("prefill", "register_input_embeds"): (None, False),  # both: "is_multimodal"
}


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_every_sglang_argument_has_a_param_with_its_default(kind):
    builder, mapping = BUILDER_ARGS[kind]
    signature = inspect.signature(getattr(REG, builder))
    assert set(signature.parameters) == set(mapping) | NOT_PARAMS
    resolved = gs.build_registry(kind, max_bs=4, max_num_tokens=8, impl="interpreted", device="cpu").params
    for arg, param in mapping.items():
        theirs, ours = signature.parameters[arg].default, resolved[param]
        if (kind, arg) in DEFAULT_DEVIATIONS:
            assert (theirs, ours) == DEFAULT_DEVIATIONS[(kind, arg)], arg
        else:
            assert ours == theirs, f"{kind} param {param}: graphslot default {ours!r}, sglang {theirs!r}"


def test_eager_preset_is_build_eager_registry():
    """The preset pins exactly what build_eager_registry hard-codes; its free
    arguments stay params."""
    spec = gs.load_spec("decode")
    preset = dict(spec.presets["eager"])
    assert preset == {"seq_len_fill_value": 0, "enable_num_token_non_padded": False,
                      "register_global_num_tokens": False, "require_gathered_buffer": False,
                      "require_mlp_tp_gather": False, "enable_prefill_cp": False}
    free = set(inspect.signature(REG.build_eager_registry).parameters) - {"device", "max_bs", "max_num_token"}
    assert free == {"cache_loc_dtype", "enable_mamba_track", "is_encoder_decoder", "encoder_len_fill_value",
                    "encoder_lens_dtype"}
    assert not free & set(preset)


def test_zero_policy_slots_are_sglangs_index_semantic_buffers():
    """sglang asserts ZERO == INDEX_SEMANTIC_BUFFERS for decode; graphslot's `index: true`
    slots are that set (plus the SWA extension) in both specs, all params on."""
    index_semantic = SGL.input_buffers.INDEX_SEMANTIC_BUFFERS
    on = {"decode": {"enable_mamba_track": True, "is_encoder_decoder": True, "is_hybrid_swa": True,
                     "enable_num_token_non_padded": True},
          "prefill": {"enable_mamba_track": True, "is_multimodal": True, "is_hybrid_swa": True,
                      "enable_num_token_non_padded": True}}
    for kind, params in on.items():
        reg = gs.build_registry(kind, max_bs=4, max_num_tokens=8, impl="interpreted", params=params, device="cpu")
        index = {s.name for s in reg.all_slots() if s.resolved.index}
        assert index - EXTENSIONS == index_semantic & set(reg.slot_names()), kind
    decode = gs.build_registry("decode", max_bs=4, max_num_tokens=8, impl="interpreted", params=on["decode"],
                               device="cpu")
    zero = {s.name for s in decode.all_slots() if s.resolved.padding == "zero"}
    assert zero - EXTENSIONS == index_semantic


# --- documented deviations, each asserted -------------------------------------------------

def decode_batch(bs: int = 3, **fields: Any):
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                      input_ids=torch.arange(1, bs + 1), req_pool_indices=torch.arange(1, bs + 1),
                      seq_lens=torch.full((bs,), 9), out_cache_loc=torch.arange(10, 10 + bs),
                      seq_lens_sum=9 * bs, positions=torch.arange(bs), seq_lens_cpu=torch.full((bs,), 9))
    for name, value in fields.items():
        setattr(fb, name, value)
    return fb


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field, value", [("positions", None), ("seq_lens_cpu", None),
                                          ("positions", [0, 1, 2])])
def test_deviation_required_field_none_or_non_tensor_raises(mode, field, value):
    """sglang skips a copied slot whose batch field is None or not a tensor (the buffer
    keeps its previous contents); graphslot raises SlotError for a non-optional slot."""
    case = Case("none-rule", D, {})
    sgl_reg, ours = build_sglang(case), build_ours(case, mode)
    fb = decode_batch(**{field: value})
    poison([sgl_reg, ours], sorted(sgl_reg.slot_names()), random.Random(1))
    stale = sgl_reg.get_slot(field).buffer.clone()
    sgl_reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert torch.equal(sgl_reg.get_slot(field).buffer[:3], stale[:3])  # silently stale
    with pytest.raises(gs.SlotError, match=field):
        ours.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)


@pytest.mark.parametrize("mode", MODES)
def test_deviation_optional_field_none_is_skipped_like_sglang(mode):
    """The counterpart: an optional slot (mrope_positions) absent this step is skipped
    by both and the view carries the None."""
    case = Case("optional", D, {})
    sgl_reg, ours = build_sglang(case), build_ours(case, mode)
    fb = decode_batch()
    sgl_reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    ours.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert sgl_reg.extract_buffer(padded_bs=4, padded_num_tokens=4,
                                  forward_batch_template=fb).mrope_positions is None
    assert ours.extract(fb, padded_bs=4, padded_num_tokens=4).mrope_positions is None


@pytest.mark.parametrize("mode", MODES)
def test_deviation_wrong_length_source_raises(mode):
    """sglang copies whatever broadcasts into the head (a 1-row source fills all raw
    rows); graphslot raises SlotError for a source whose shape is not the head's."""
    case = Case("length", D, {})
    sgl_reg, ours = build_sglang(case), build_ours(case, mode)
    fb = decode_batch(req_pool_indices=torch.tensor([5]))
    sgl_reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert sgl_reg.get_slot("req_pool_indices").buffer[:4].tolist() == [5, 5, 5, 0]
    with pytest.raises(gs.SlotError, match="req_pool_indices"):
        ours.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_deviation_swa_out_cache_loc_is_a_graphslot_extension(mode, kind):
    """out_cache_loc_swa (is_hybrid_swa) exists only in graphslot; every other slot is
    still bit-identical with it on."""
    case = Case(f"swa-{kind}", kind, {})
    sgl_reg = build_sglang(case)
    ours = gs.build_registry(kind, max_bs=case.max_bs, max_num_tokens=max_tokens(case), device=CPU, impl=mode,
                             params={"is_hybrid_swa": True})
    assert set(ours.slot_names()) - set(sgl_reg.slot_names()) == {"out_cache_loc_swa"}
    assert "out_cache_loc_swa" not in {f.name for f in dataclasses.fields(ForwardBatch)}
    fb = decode_batch(4) if kind == "decode" else decode_batch(4, forward_mode=ForwardMode.EXTEND)
    fb.out_cache_loc_swa = torch.arange(4, dtype=torch.int32) + 1
    sgl_reg.fill_from(fb, raw_bs=4, padded_bs=4 if kind == "prefill" else 6, raw_num_tokens=4, padded_num_tokens=6)
    ours.fill_from(fb, raw_bs=4, padded_bs=4 if kind == "prefill" else 6, raw_num_tokens=4, padded_num_tokens=6)
    assert compare(case, sgl_reg, ours, "swa") == []
    assert ours.slot("out_cache_loc_swa").buffer[:6].tolist() == [1, 2, 3, 4, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_deviation_prefill_mamba_track_index_tails_are_zeroed(mode):
    """sglang's prefill registry leaves mamba_track_indices/_mask as plain copies
    (FOREACH_COPY: bs is not padded on that path); graphslot declares them index slots
    (zero tail). Identical whenever raw_bs == padded_bs (the matrix); with a padded bs
    only the tails of those two differ."""
    case = Case("prefill-mamba-padded-bs", P, {"enable_mamba_track": True})
    sgl_reg, ours = build_sglang(case), build_ours(case, mode)
    fb = decode_batch(2, forward_mode=ForwardMode.EXTEND, mamba_track_indices=torch.tensor([3, 4]),
                      mamba_track_mask=torch.tensor([True, True]), mamba_track_seqlens=torch.tensor([7, 8]))
    names = sorted(sgl_reg.slot_names())
    poison([sgl_reg, ours], names, random.Random(2))
    for reg in (sgl_reg.get_slot, ours.slot):
        reg("mamba_track_mask").buffer.fill_(True)
        reg("mamba_track_indices").buffer.fill_(77)
    sgl_reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    ours.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    differing = [n for n in names if not same_bits(sgl_reg.get_slot(n).buffer, ours.slot(n).buffer)]
    assert differing == ["mamba_track_indices", "mamba_track_mask"]
    for name in differing:
        assert not ours.slot(name).buffer[2:4].any() and sgl_reg.get_slot(name).buffer[2:4].all()
        assert torch.equal(sgl_reg.get_slot(name).buffer[:2], ours.slot(name).buffer[:2])
    assert ours.slot("mamba_track_seqlens").buffer.dtype == torch.int32


# --- num_token_non_padded details -----------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(), (1,)])
def test_num_token_non_padded_buffer_keeps_its_shape_and_address(mode, shape):
    """A 0-d global count (as ForwardBatch holds it) must not resize the [1] buffer."""
    case = Case("ntnp-0d", D, {"require_gathered_buffer": True, "enable_num_token_non_padded": True},
                attn_tp_rank=1, attn_tp_size=2)
    ours = build_ours(case, mode)
    buf = ours.slot("num_token_non_padded").buffer
    ptr = buf.data_ptr()
    fb = decode_batch(3, global_num_token_non_padded=torch.full(shape, 3, dtype=torch.int32))
    # 2 tokens per rank: rank 1 owns token 3
    ours.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert buf.shape == (1,) and buf.data_ptr() == ptr and buf.tolist() == [1]
    assert ours.slot("num_token_non_padded").buffer is buf


@pytest.mark.parametrize("mode", MODES)
def test_num_token_non_padded_untouched_without_any_count(mode):
    case = Case("ntnp-none", D, {"enable_num_token_non_padded": True})
    sgl_reg, ours = build_sglang(case), build_ours(case, mode)
    for reg in (sgl_reg, ours):
        (reg.get_slot if reg is sgl_reg else reg.slot)("num_token_non_padded").buffer.fill_(-5)
    fb = decode_batch()
    sgl_reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    ours.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
    assert sgl_reg.get_slot("num_token_non_padded").buffer.tolist() == [-5]
    assert ours.slot("num_token_non_padded").buffer.tolist() == [-5]
