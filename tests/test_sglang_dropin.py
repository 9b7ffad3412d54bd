"""graphslot.integrations.sglang against sglang 0.5.23's real registry, bit for bit.

The drop-in and sglang's ``CudaGraphBufferRegistry`` are built side by side through the
same API (the drop-in's factories are called by exactly the code that calls sglang's:
``test_sglang_compat.build_sglang`` with its registry module swapped), every common
buffer of both is poisoned with the same values before each step, both are filled from
the same random sglang ``ForwardBatch`` (sometimes with ``copy_slots`` + ``skip_slots``,
as sglang's early verify path does), and every buffer, every view and the padding
policies are compared. The same is done for slots registered from Python (random slot
sets, on sglang's ``GraphSlot`` objects and the drop-in's), for ``source=`` adoption
with the structured slots, and for sharing through sglang's pool. Differences by
design are tested in ``test_sglang_dropin_api.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional
from unittest import mock

import pytest
import torch

import test_sglang_compat as compat  # skips this module when sglang cannot be loaded

import graphslot as gs
import graphslot.integrations.sglang as dropin
from graphslot.integrations.sglang import factories
from graphslot.spec.loading import shipped_spec_path

SGL = compat.SGL
REG = SGL.registry
CPU = torch.device("cpu")
SRT_DIR = Path(REG.__file__).resolve().parents[1]  # .../site-packages/sglang/srt
# Documented deviation (docs/sglang.md): prefill's mamba index slots are zeroed, not
# FOREACH_COPY; sglang's prefill path never pads the batch size, so nothing differs there.
POLICY_DEVIATIONS = {("prefill", "mamba_track_indices"), ("prefill", "mamba_track_mask")}


def staged_slots() -> frozenset:
    """sglang's STAGED_SLOTS (runner/early_verify_metadata.py): the fields of
    VerifyInputSources, read from the installed source (the module does not import here)."""
    tree = ast.parse((SRT_DIR / "model_executor/runner/early_verify_metadata.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VerifyInputSources")
    return frozenset(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign))


STAGED = staged_slots()


class AsGraphslot:
    """The drop-in seen through the interface test_sglang_compat's helpers compare."""

    def __init__(self, registry):
        self.registry = registry

    def slot(self, name):
        return self.registry.get_slot(name)

    def slot_names(self):
        return self.registry.slot_names()


def build_dropin(case: compat.Case):
    with mock.patch.object(compat, "REG", dropin):
        return compat.build_sglang(case)


def compare_all(sgl_reg, ours, fb, sgl_view, our_view, where: str) -> List[str]:
    """Every buffer (both registries' whole slot sets) and every view field."""
    out = []
    if sgl_reg.slot_names() != ours.slot_names():
        out.append(f"{where}: slot names {sgl_reg.slot_names()} vs {ours.slot_names()}")
    for name in sgl_reg.slot_names():
        a, b = sgl_reg.get_slot(name).buffer, ours.get_slot(name).buffer
        if not compat.same_bits(a, b):
            out.append(f"{where}: buffer '{name}': sglang {a.tolist()} vs drop-in {b.tolist()}")
    if sgl_view is not None:
        out += compat.compare_views(sgl_view, our_view, fb, sgl_reg, AsGraphslot(ours), where)
    return out


def step_both(sgl_reg, ours, fb, counts, rng: random.Random, pp=None, stage=False) -> tuple:
    """Fill and extract both; with ``stage``, first copy_slots the staged fields (sglang's
    early verify) and fill with skip_slots=STAGED."""
    raw_bs, padded_bs, raw_n, padded_n = counts
    skip = frozenset()
    if stage:
        sources = {n: getattr(fb, n) for n in sorted(STAGED) if getattr(fb, n, None) is not None}
        for reg in (sgl_reg, ours):
            reg.copy_slots(sources)
        skip = STAGED if rng.random() < 0.5 else set(STAGED)  # sglang passes a frozenset; a set works too
    views = []
    for reg in (sgl_reg, ours):
        reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_n, padded_num_tokens=padded_n,
                      pp_proxy_tensors=pp, skip_slots=skip)
        views.append(reg.extract_buffer(padded_bs=padded_bs, padded_num_tokens=padded_n, forward_batch_template=fb))
    return tuple(views)


# --- the factories -------------------------------------------------------------------

@pytest.mark.parametrize("case", compat.CASES, ids=[c.id for c in compat.CASES])
def test_factories_bit_identical_to_sglang(case):
    assert_factories_bit_identical(case)


def assert_factories_bit_identical(case: compat.Case) -> None:
    rng, g = random.Random(f"dropin-{case.id}"), torch.Generator().manual_seed(7)
    sgl_reg, ours = compat.build_sglang(case), build_dropin(case)
    assert type(ours) is dropin.CudaGraphBufferRegistry
    mismatches = compare_all(sgl_reg, ours, None, None, None, f"{case.id}/at allocation")
    for name in sgl_reg.slot_names():
        theirs, mine = sgl_reg.get_slot(name), ours.get_slot(name)
        if (case.kind, name) not in POLICY_DEVIATIONS:
            assert mine.padding_policy.value == theirs.padding_policy.value, name
        assert (mine.axis, mine.dtype, mine.pad_value, mine.copy_from_fb) == (
            theirs.axis, theirs.dtype, theirs.pad_value, theirs.copy_from_fb), name
        assert tuple(mine.shape_fn(case.max_bs, compat.max_tokens(case))) == tuple(theirs.buffer.shape), name
    steps = 0
    with compat.sglang_loader.parallel(attn_tp_rank=case.attn_tp_rank, attn_tp_size=case.attn_tp_size,
                                       num_dp_ranks=case.num_dp_ranks):
        for step in range(2 * compat.STEPS):
            fb, *counts = compat.random_step(case, rng, g, sgl_reg)
            compat.poison([sgl_reg, AsGraphslot(ours)], sgl_reg.slot_names(), rng)
            stage = case.kind == "decode" and step % 3 == 2
            sgl_view, our_view = step_both(sgl_reg, ours, fb, counts, rng, stage=stage)
            mismatches += compare_all(sgl_reg, ours, fb, sgl_view, our_view, f"{case.id}/step {step} {counts}")
            steps += 1
    assert mismatches == [], "\n".join(mismatches[:10])
    assert steps == 2 * compat.STEPS


@pytest.fixture
def project_with_its_own_specs(tmp_path, monkeypatch):
    """The working directory is a project with its own ``decode`` and ``prefill`` specs
    (the ``graphslot new-spec`` workflow), which ``graphslot.load_spec`` prefers to the
    shipped ones: decode keeps ``seq_lens``' padded tail (fill_once, not fill_sentinel),
    prefill keeps ``input_ids``' (keep_pad, not zero)."""
    specs = tmp_path / "specs"
    specs.mkdir()
    edits = {"decode": ("padding: fill_sentinel", "padding: fill_once"),
             "prefill": ("padding: zero", "padding: keep_pad")}
    for kind, (old, new) in edits.items():
        text = shipped_spec_path(kind).read_text(encoding="utf-8")
        (specs / f"{kind}.yaml").write_text(text.replace(old, new, 1), encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/decode.yaml", "specs/prefill.yaml"]\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(factories, "_BASE", {})  # no shipped spec read by an earlier test is reused
    assert [gs.load_spec(kind).path for kind in edits] == ["specs/decode.yaml", "specs/prefill.yaml"]
    return tmp_path


def test_factories_use_the_shipped_specs_whatever_project_is_the_working_directory(project_with_its_own_specs):
    kw = dict(device=CPU, max_bs=4, max_num_token=4, cache_loc_dtype=torch.int64, share_pool=False)
    fb = SimpleNamespace(batch_size=2, input_ids=torch.tensor([7, 8]), seq_lens=torch.tensor([5, 6]))
    tails = {}
    for module in (REG, dropin):
        decode = module.build_decode_registry(**kw, seq_len_fill_value=1)
        prefill = module.build_prefill_registry(**kw)
        decode.get_slot("seq_lens").buffer.copy_(torch.tensor([50, 51, 52, 53]))
        prefill.get_slot("input_ids").buffer.copy_(torch.tensor([60, 61, 62, 63]))
        for reg in (decode, prefill):
            reg.fill_from(fb, raw_bs=2, padded_bs=4 if reg is decode else 2, raw_num_tokens=2, padded_num_tokens=4)
        tails[module] = decode.get_slot("seq_lens").buffer.tolist(), prefill.get_slot("input_ids").buffer.tolist()
    assert tails[dropin] == tails[REG] == ([5, 6, 1, 1], [7, 8, 0, 0])
    for case in (compat.CASES[0], next(c for c in compat.CASES if c.kind == "prefill"),
                 next(c for c in compat.CASES if c.kind == "eager")):
        assert_factories_bit_identical(case)


def test_every_case_exercises_padding_and_every_slot():
    """The matrix is not vacuous: its steps pad, and its cases register every slot
    sglang's factories can register without a source."""
    seen = set()
    for case in compat.CASES:
        seen |= set(compat.build_sglang(case).slot_names())
    assert seen == {"input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                    "mrope_positions", "mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens",
                    "encoder_lens", "num_token_non_padded", "global_num_tokens_gpu",
                    "global_num_tokens_for_logprob_gpu", "input_embeds"}
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    case = compat.CASES[0]
    padded = [compat.random_step(case, rng, g, compat.build_sglang(case)) for _ in range(12)]
    assert any(raw_bs < padded_bs for _, raw_bs, padded_bs, _, _ in padded)


# --- source= adoption and the structured slots ----------------------------------------

def decode_source(max_bs: int, max_tokens: int, **extra) -> SimpleNamespace:
    """What sglang's DecodeInputBuffers hands build_decode_registry(source=...)."""
    z = torch.zeros
    return SimpleNamespace(
        input_ids=z(max_tokens, dtype=torch.int64), positions=z(max_tokens, dtype=torch.int64),
        out_cache_loc=z(max_tokens, dtype=torch.int64), req_pool_indices=z(max_bs, dtype=torch.int64),
        seq_lens=torch.full((max_bs,), 3, dtype=torch.int64), seq_lens_cpu=torch.full((max_bs,), 3, dtype=torch.int64),
        mrope_positions=z((3, max_tokens), dtype=torch.int64), num_token_non_padded=z(1, dtype=torch.int32),
        global_num_tokens_gpu=z(1, dtype=torch.int32), global_num_tokens_for_logprob_gpu=z(1, dtype=torch.int32),
        ngram_embedding_info=SimpleNamespace(column_starts=z(max_bs, dtype=torch.int32),
                                             req_lens=torch.ones(max_bs, dtype=torch.int32)),
        pp_proxy_tensors={"hidden_states": z((max_tokens, 4)), "residual": z((max_tokens, 4))},
        rids_int=z(max_bs, dtype=torch.int64), bootstrap_room_ids_int=torch.full((max_bs,), -1, dtype=torch.int64),
        **extra)


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a strided tensor (every other element of a wider one, last stride 2)."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def clone_source(src: SimpleNamespace, layout=torch.Tensor.clone) -> SimpleNamespace:
    """A copy of ``src``, each tensor made by ``layout``."""
    def clone(v):
        if isinstance(v, torch.Tensor):
            return layout(v)
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, SimpleNamespace):
            return SimpleNamespace(**{k: clone(x) for k, x in vars(v).items()})
        return v
    return clone(src)


@pytest.mark.parametrize("layout", [torch.Tensor.clone, strided], ids=["dense", "strided"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_source_adoption_and_structured_slots_match_sglang(kind, layout):
    """Strided: sglang binds a tensor of any layout (the drop-in refused one at its first
    fill, as graphslot's generated code cannot take it; its interpreter fills it)."""
    max_bs, max_tokens = 4, 8
    rng, g = random.Random(kind), torch.Generator().manual_seed(3)
    src_a = clone_source(decode_source(max_bs, max_tokens), layout)
    src_b = clone_source(src_a, layout)
    assert (layout is strided) == (not src_b.input_ids.is_contiguous())
    common = dict(device=CPU, max_bs=max_bs, max_num_token=max_tokens, cache_loc_dtype=torch.int64,
                  enable_num_token_non_padded=True, attn_tp_sharded_fn=lambda n: n % 4 == 0)
    if kind == "decode":
        common.update(seq_len_fill_value=2, require_gathered_buffer=True)
        sgl_reg = REG.build_decode_registry(**common, source=src_a)
        ours = dropin.build_decode_registry(**common, source=src_b)
    else:
        sgl_reg = REG.build_prefill_registry(**common, source=src_a)
        ours = dropin.build_prefill_registry(**common, source=src_b)
    assert ours.slot_names() == sgl_reg.slot_names()
    structured = [n for n in sgl_reg.slot_names() if "." in n or n.endswith("_int")]
    assert structured == (["ngram_embedding_info.column_starts", "ngram_embedding_info.req_lens",
                           "pp_proxy_tensors.hidden_states", "pp_proxy_tensors.residual", "rids_int",
                           "bootstrap_room_ids_int"] if kind == "decode"
                          else ["pp_proxy_tensors.hidden_states", "pp_proxy_tensors.residual"])
    for name in sgl_reg.slot_names():  # adopted: the source's own storage, on both sides
        owner_a, owner_b = src_a, src_b
        for part in name.split("."):
            owner_a = owner_a[part] if isinstance(owner_a, dict) else getattr(owner_a, part)
            owner_b = owner_b[part] if isinstance(owner_b, dict) else getattr(owner_b, part)
        assert sgl_reg.get_slot(name).buffer.data_ptr() == owner_a.data_ptr(), name
        assert ours.get_slot(name).buffer.data_ptr() == owner_b.data_ptr(), name
    mismatches = []
    with compat.sglang_loader.parallel(attn_tp_rank=1, attn_tp_size=2):
        for step in range(10):
            raw_bs = rng.randint(1, max_bs)
            padded_bs = raw_bs if kind == "prefill" else rng.randint(raw_bs, max_bs)
            raw_n = rng.randint(raw_bs, max_tokens) if kind == "prefill" else raw_bs
            padded_n = rng.randint(raw_n, max_tokens) if kind == "prefill" else padded_bs
            fb = compat.ForwardBatch(
                forward_mode=compat.ForwardMode.DECODE, batch_size=raw_bs,
                input_ids=compat.rand_int(g, raw_n, 100), req_pool_indices=compat.rand_int(g, raw_bs, 8),
                seq_lens=compat.rand_int(g, raw_bs, 50), out_cache_loc=compat.rand_int(g, raw_n, 64),
                seq_lens_sum=0, positions=compat.rand_int(g, raw_n, 50))
            fb.seq_lens_cpu = fb.seq_lens.clone()
            fb.global_num_token_non_padded = torch.tensor([rng.randint(0, padded_n)], dtype=torch.int32)
            fb.global_num_token_non_padded_cpu = rng.randint(0, padded_n)
            if rng.random() < 0.7:
                fb.ngram_embedding_info = SimpleNamespace(column_starts=compat.rand_int(g, raw_bs, 9, torch.int32),
                                                          req_lens=compat.rand_int(g, raw_bs, 9, torch.int32))
                fb.rids_int = compat.rand_int(g, raw_bs, 1000)
                fb.bootstrap_room_ids_int = compat.rand_int(g, raw_bs, 1000)
            pp = None
            if rng.random() < 0.7:
                tensors = {"hidden_states": torch.randn(raw_n, 4, generator=g)}
                if rng.random() < 0.5:
                    tensors["residual"] = torch.randn(raw_n, 4, generator=g)
                pp = SGL.fbi.PPProxyTensors(tensors)
            compat.poison([sgl_reg, AsGraphslot(ours)], sgl_reg.slot_names(), rng)
            views = step_both(sgl_reg, ours, fb, (raw_bs, padded_bs, raw_n, padded_n), rng, pp=pp)
            mismatches += compare_all(sgl_reg, ours, fb, *views, f"{kind}/step {step}")
    assert mismatches == [], "\n".join(mismatches[:10])


def test_missing_source_buffer_is_a_value_error_like_sglang():
    src = decode_source(4, 4)
    del src.seq_lens
    kwargs = dict(device=CPU, max_bs=4, max_num_token=4, seq_len_fill_value=1, cache_loc_dtype=torch.int64)
    for module in (REG, dropin):
        with pytest.raises(ValueError, match="source is missing buffer 'seq_lens'"):
            module.build_decode_registry(**kwargs, source=clone_source(src))


# --- sharing through sglang's pool -----------------------------------------------------

def pooled_pair(module):
    """sglang's order: the eager registry first (canonical), then a pooled decode graph
    registry; which slots share storage, and what each holds."""
    SGL.input_buffers._forward_input_buffer_pool.clear()
    try:
        eager = module.build_eager_registry(device=CPU, max_bs=4, max_num_token=8, cache_loc_dtype=torch.int64,
                                            is_encoder_decoder=True, encoder_len_fill_value=6)
        graph = module.build_decode_registry(device=CPU, max_bs=4, max_num_token=8, seq_len_fill_value=3,
                                             cache_loc_dtype=torch.int64, is_encoder_decoder=True,
                                             encoder_len_fill_value=9)
        pool = dict(SGL.input_buffers._forward_input_buffer_pool)
    finally:
        SGL.input_buffers._forward_input_buffer_pool.clear()
    shared = sorted(n for n in eager.slot_names() if graph.has_slot(n)
                    and eager.get_slot(n).buffer.data_ptr() == graph.get_slot(n).buffer.data_ptr())
    contents = {(which, n): r.get_slot(n).buffer.tolist()
                for which, r in (("eager", eager), ("graph", graph)) for n in r.slot_names()}
    in_pool = all(any(t.data_ptr() == eager.get_slot(n).buffer.data_ptr() for t in pool.values())
                  for n in eager.slot_names())
    return eager, graph, shared, contents, in_pool


def test_sharing_through_sglangs_pool_matches_sglang():
    *_, shared_s, contents_s, in_pool_s = pooled_pair(REG)
    eager, graph, shared_d, contents_d, in_pool_d = pooled_pair(dropin)
    assert shared_d == shared_s
    assert set(shared_d) >= {"input_ids", "req_pool_indices", "seq_lens", "seq_lens_cpu", "encoder_lens"}
    assert contents_d == contents_s  # the last registrant's init value wins, as in sglang
    assert contents_d["eager", "seq_lens"] == [3] * 4 and contents_d["eager", "encoder_lens"] == [9] * 4
    assert in_pool_d and in_pool_s
    fb = SimpleNamespace(input_ids=torch.arange(2), seq_lens=torch.tensor([5, 6]))
    graph.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
    assert eager.get_slot("seq_lens").buffer.tolist() == [5, 6, 3, 3]  # one storage


# --- slots registered from Python --------------------------------------------------------

@dataclasses.dataclass
class MiniBatch:
    batch_size: int = 0
    tok: Optional[torch.Tensor] = None
    req: Optional[torch.Tensor] = None
    grid: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    host: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None
    computed: Optional[torch.Tensor] = None
    hooked: Optional[torch.Tensor] = None
    once: Optional[torch.Tensor] = None
    reset_only: Optional[torch.Tensor] = None
    nested: Any = None
    extra: Optional[str] = None


def fill_padded(buffer, fb, ctx):
    buffer.fill_(ctx.padded_num_tokens * 100 + ctx.raw_bs)


def scale_head(buffer, fb, ctx):
    buffer[: ctx.raw_num_tokens] *= 3


def nested_source(fb, ctx):
    return None if fb.nested is None else fb.nested.values


POLICIES = ("KEEP_PAD", "FILL_SENTINEL", "ZERO", "FOREACH_COPY", "FILL_ONCE")


def slot_kwargs(rng: random.Random) -> List[Dict[str, Any]]:
    """A random slot set (sglang's GraphSlot keyword arguments, policies by name)."""
    def policy(**kw):
        name = rng.choice(POLICIES)
        if name in ("FILL_SENTINEL", "FILL_ONCE"):
            kw["pad_value"] = rng.randint(-5, 9)
        return dict(kw, padding_policy=name)

    pool = [
        policy(name="tok", shape_fn=lambda bs, mt: (mt,), dtype=torch.int64, axis="tokens"),
        policy(name="req", shape_fn=lambda bs, mt: (bs,), dtype=torch.int32, axis="bs"),
        policy(name="grid", shape_fn=lambda bs, mt: (3, mt), dtype=torch.int64, axis="tokens",
               slice_fn=lambda buf, n: buf[:, :n]),
        policy(name="rows", shape_fn=lambda bs, mt: (mt, 4), dtype=torch.float32, axis="tokens"),
        policy(name="host", shape_fn=lambda bs, mt: (bs,), dtype=torch.int64, axis="bs", device=CPU),
        policy(name="mask", shape_fn=lambda bs, mt: (bs,), dtype=torch.bool, axis="bs")
        | {"padding_policy": rng.choice(["ZERO", "KEEP_PAD", "FOREACH_COPY"])},
        dict(name="count", shape_fn=lambda bs, mt: (1,), dtype=torch.int32, axis="none"),
        dict(name="computed", shape_fn=lambda bs, mt: (1,), dtype=torch.int32, axis="none", copy_from_fb=False,
             post_fill=fill_padded),
        policy(name="hooked", shape_fn=lambda bs, mt: (mt,), dtype=torch.int64, axis="tokens", post_fill=scale_head),
        dict(name="once", shape_fn=lambda bs, mt: (2,), dtype=torch.int32, axis="none",
             padding_policy=rng.choice(["FILL_ONCE", "FILL_SENTINEL"]), pad_value=rng.randint(1, 9)),
        policy(name="reset_only", shape_fn=lambda bs, mt: (mt, 2), dtype=torch.float16, axis="tokens",
               copy_from_fb=False),
        dict(name="nested.values", shape_fn=lambda bs, mt: (bs,), dtype=torch.int32, axis="none",
             padding_policy="KEEP_PAD", source_fn=nested_source),
        dict(name="off", shape_fn=lambda bs, mt: (bs,), dtype=torch.int32, axis="bs", enabled=False),
        policy(name="nested.scratch", shape_fn=lambda bs, mt: (mt,), dtype=torch.int64, axis="tokens",
               post_fill=scale_head),  # dotted, no source_fn: sglang never copies it
    ]
    chosen = rng.sample(pool, rng.randint(3, len(pool)))
    return chosen


def make_slot(cls, policy_enum, kwargs):
    kw = dict(kwargs)
    kw["padding_policy"] = policy_enum[kw.get("padding_policy", "FOREACH_COPY")]
    return cls(**kw)


def random_batch(rng, g, names, raw_bs, raw_n) -> MiniBatch:
    fb = MiniBatch(batch_size=raw_bs, extra="carried")
    shapes = {"tok": (raw_n,), "req": (raw_bs,), "grid": (3, raw_n), "rows": (raw_n, 4), "host": (raw_bs,),
              "mask": (raw_bs,), "count": (1,), "computed": (1,), "hooked": (raw_n,), "once": (2,),
              "reset_only": (raw_n, 2)}
    for name, shape in shapes.items():
        if rng.random() < 0.8:
            value = torch.randint(-50, 50, shape, generator=g)
            setattr(fb, name, value > 0 if name == "mask" else value.float() if name == "rows" else value)
    if rng.random() < 0.2:  # a field that is not a tensor: skipped, its view exposed, by both
        setattr(fb, rng.choice(sorted(shapes)), [1, 2])
    if rng.random() < 0.7:
        fb.nested = SimpleNamespace(values=torch.randint(0, 9, (rng.randint(0, raw_bs),), generator=g,
                                                         dtype=torch.int32))
    return fb


@pytest.mark.parametrize("seed", range(12))
def test_slots_registered_from_python_match_sglang(seed):
    """Random slot sets; odd seeds hand sglang's own GraphSlot objects to the drop-in,
    and register part of the set late, after some fills."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    max_bs, max_tokens = rng.randint(2, 6), rng.randint(6, 12)
    chosen = slot_kwargs(rng)
    ours_cls = (REG.GraphSlot, REG.PaddingPolicy) if seed % 2 else (dropin.GraphSlot, dropin.PaddingPolicy)
    sgl_reg = REG.CudaGraphBufferRegistry(device=CPU, max_bs=max_bs, max_num_tokens=max_tokens)
    ours = dropin.CudaGraphBufferRegistry(device=CPU, max_bs=max_bs, max_num_tokens=max_tokens)
    late = len(chosen) // 2 if seed % 2 else len(chosen)
    registered = []

    def register(kwargs):
        theirs = sgl_reg.register_slot(make_slot(REG.GraphSlot, REG.PaddingPolicy, kwargs))
        mine_obj = make_slot(*ours_cls, kwargs)
        assert ours.register_slot(mine_obj) is mine_obj
        assert (mine_obj.buffer is None) == (theirs.buffer is None)
        registered.append(kwargs["name"])

    for kwargs in chosen[:late]:
        register(kwargs)
    mismatches = compare_all(sgl_reg, ours, None, None, None, f"seed {seed}/at allocation")
    for step in range(14):
        if step == 5:
            for kwargs in chosen[late:]:
                register(kwargs)
        raw_bs = rng.randint(0, max_bs)  # an empty head too; views keep a row (an empty one has no address)
        padded_bs = rng.randint(max(raw_bs, 1), max_bs)
        raw_n = rng.randint(raw_bs, max_tokens)
        padded_n = rng.randint(max(raw_n, 1), max_tokens)
        fb = random_batch(rng, g, registered, raw_bs, raw_n)
        compat.poison([sgl_reg, AsGraphslot(ours)], sgl_reg.slot_names(), rng)
        views = step_both(sgl_reg, ours, fb, (raw_bs, padded_bs, raw_n, padded_n), rng)
        mismatches += compare_all(sgl_reg, ours, fb, *views, f"seed {seed}/step {step}")
        assert views[1].extra == "carried" and views[1].batch_size == padded_bs
    assert mismatches == [], "\n".join(mismatches[:10])
    assert sorted(ours.slot_names()) == sorted(n for n in registered if n != "off")


def test_late_runner_slot_on_a_factory_registry_matches_sglang():
    """The decode runner's dllm_input_preparation_state: registered after the factory
    built its registry (and after fills), then filled with the rest."""
    case = compat.Case("late", "decode", {"enable_num_token_non_padded": True})
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    sgl_reg, ours = compat.build_sglang(case), build_dropin(case)
    mismatches = []
    for step in range(8):
        if step == 3:
            for module, reg in ((REG, sgl_reg), (dropin, ours)):
                reg.register_slot(module.GraphSlot("dllm_input_preparation_state", lambda bs, tokens: (tokens, 5),
                                                   torch.float32, axis="tokens",
                                                   padding_policy=module.PaddingPolicy.ZERO))
        fb, *counts = compat.random_step(case, rng, g, sgl_reg)
        compat.poison([sgl_reg, AsGraphslot(ours)], sgl_reg.slot_names(), rng)
        if step >= 3:
            for reg in (sgl_reg, ours):  # the runner writes the head itself
                reg.get_slot("dllm_input_preparation_state").buffer[: counts[2]].fill_(step)
        views = step_both(sgl_reg, ours, fb, counts, rng)
        mismatches += compare_all(sgl_reg, ours, fb, *views, f"late/step {step}")
    assert "dllm_input_preparation_state" in ours.slot_names()
    assert mismatches == [], "\n".join(mismatches[:10])


def test_random_slot_sets_cover_every_kind_of_slot():
    """Across the seeds above, every slot of the pool (each kind of GraphSlot) is drawn,
    late registration included."""
    drawn, late = set(), set()
    for seed in range(12):
        chosen = [kw["name"] for kw in slot_kwargs(random.Random(seed))]
        drawn |= set(chosen)
        if seed % 2:
            late |= set(chosen[len(chosen) // 2:])
    assert drawn == {"tok", "req", "grid", "rows", "host", "mask", "count", "computed", "hooked", "once",
                     "reset_only", "nested.values", "off", "nested.scratch"}
    assert len(late) >= 6


def test_a_slot_named_like_a_disabled_factory_slot_is_the_users_like_sglang():
    """sglang's factories register the mamba slots only with enable_mamba_track: without
    it, a runner's own ``mamba_track_indices`` is just another slot."""
    kw = dict(device=CPU, max_bs=4, max_num_token=4, seq_len_fill_value=1, cache_loc_dtype=torch.int64,
              share_pool=False)
    fb = SimpleNamespace(batch_size=2, input_ids=torch.tensor([7, 8]), mamba_track_indices=torch.tensor([3, 4]))
    buffers = []
    for module in (REG, dropin):
        reg = module.build_decode_registry(**kw)
        assert not reg.has_slot("mamba_track_indices")
        reg.register_slot(module.GraphSlot("mamba_track_indices", lambda bs, mt: (bs,), torch.int64, axis="bs",
                                           padding_policy=module.PaddingPolicy.FILL_SENTINEL, pad_value=-1))
        reg.fill_from(fb, raw_bs=2, padded_bs=4, raw_num_tokens=2, padded_num_tokens=4)
        buffers.append((reg.slot_names()[-1], reg.get_slot("mamba_track_indices").buffer.tolist(),
                        reg.get_slot("input_ids").buffer.tolist()))
    assert buffers[1] == buffers[0] == ("mamba_track_indices", [3, 4, -1, -1], [7, 8, 0, 0])


def test_a_dotted_slot_without_source_fn_is_reset_and_hooked_never_copied_like_sglang():
    """sglang reads ``getattr(fb, 'a.b')`` for it, never there: no copy; the tail
    resets and ``post_fill`` run, and ``extract_buffer`` leaves it off the view."""
    fb = MiniBatch(batch_size=2, tok=torch.tensor([1, 2]), nested=SimpleNamespace(values=torch.tensor([9, 9])))
    seen = []
    for module in (REG, dropin):
        reg = module.CudaGraphBufferRegistry(device=CPU, max_bs=4, max_num_tokens=4)
        for name, copy in (("nested.values", True), ("nested.computed", False)):
            reg.register_slot(module.GraphSlot(name, lambda bs, mt: (mt,), torch.int64, post_fill=scale_head,
                                               padding_policy=module.PaddingPolicy.ZERO, copy_from_fb=copy))
            reg.get_slot(name).buffer.fill_(5)
        reg.fill_from(fb, raw_bs=2, padded_bs=2, raw_num_tokens=2, padded_num_tokens=3)
        view = reg.extract_buffer(padded_bs=2, padded_num_tokens=3, forward_batch_template=fb)
        seen.append(([reg.get_slot(n).buffer.tolist() for n in reg.slot_names()], view.nested is fb.nested))
    assert seen[1] == seen[0] == ([[15, 15, 0, 5], [15, 15, 0, 5]], True)
