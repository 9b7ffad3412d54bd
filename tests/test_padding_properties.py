"""Property tests of the padding invariants (interpreted registry).

For any capacities, any ``raw <= padded <= capacity`` and any dtype, with every buffer
poisoned with random values before the fill:

* the head ``[:raw]`` equals the source;
* the tail ``[raw:padded]`` is 0 for ``zero``, the pad value for ``fill_sentinel``, and
  untouched (the poison) for ``keep_pad``, ``foreach_copy`` and ``fill_once``;
* nothing past ``padded`` changes, and an ``axis: none`` buffer that is not copied does
  not change at all.

Each policy is checked on a 1-D ``bs`` slot, a ``tokens`` slot with a trailing dimension
and a ``slice_dim: 1`` slot (``[2, max_num_tokens]``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphslot as gs

DTYPES = {"int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "float32": torch.float32}
PARAM_TYPE = {"int64": "int", "int32": "int", "bool": "bool", "float32": "float"}
POLICIES = ("zero", "fill_sentinel", "keep_pad", "foreach_copy", "fill_once")
LAYOUTS = {  # name suffix -> (shape, axis, slice_dim)
    "bs": ('["max_bs"]', "bs", 0),
    "tok": ('["max_num_tokens", 3]', "tokens", 0),
    "dim1": ('[2, "max_num_tokens"]', "tokens", 1),
}


@functools.lru_cache(maxsize=None)
def policy_spec(dtype_name: str) -> gs.RegistrySpec:
    """One slot per (policy, layout), all of ``dtype_name``; the pad value is a param."""
    default = {"bool": "true", "float32": "0.5"}.get(dtype_name, "7")
    lines = [
        "name: props",
        "params:",
        f"  pad: {{type: {PARAM_TYPE[dtype_name]}, default: {default}}}",
        "slots:",
    ]
    for policy in POLICIES:
        for suffix, (shape, axis, slice_dim) in LAYOUTS.items():
            lines += [f"  - name: {policy}_{suffix}", f"    shape: {shape}", f"    dtype: {dtype_name}",
                      f"    axis: {axis}", f"    slice_dim: {slice_dim}", f"    padding: {policy}"]
            if policy in ("fill_sentinel", "fill_once"):
                lines.append("    pad_value: pad")
    lines += ["  - name: fixed", "    shape: [5]", f"    dtype: {dtype_name}", "    axis: none",
              "    padding: keep_pad", "    copy_from_fb: false"]
    return gs.parse_spec("\n".join(lines) + "\n", path="props.yaml")


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype) * 100
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int64).to(dtype)


def narrow(tensor, dim, start, stop):
    return tensor.narrow(dim, start, stop - start)


@st.composite
def steps(draw):
    max_bs = draw(st.integers(1, 16))
    max_tokens = draw(st.integers(1, 32))
    padded_bs = draw(st.integers(0, max_bs))
    padded_tokens = draw(st.integers(0, max_tokens))
    return dict(
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        max_bs=max_bs,
        max_tokens=max_tokens,
        padded_bs=padded_bs,
        raw_bs=draw(st.integers(0, padded_bs)),
        padded_tokens=padded_tokens,
        raw_tokens=draw(st.integers(0, padded_tokens)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=100, deadline=None)
@given(step=steps())
def test_padding_invariants(step):
    dtype = DTYPES[step["dtype"]]
    gen = torch.Generator().manual_seed(step["seed"])
    pad = random_tensor((), dtype, gen).item()
    reg = gs.build_registry(policy_spec(step["dtype"]), max_bs=step["max_bs"], max_num_tokens=step["max_tokens"],
                            params={"pad": pad}, impl="interpreted", device="cpu")

    poisoned, batch = {}, SimpleNamespace()
    for name in reg.slot_names():
        buffer = reg.slot(name).buffer
        buffer.copy_(random_tensor(tuple(buffer.shape), dtype, gen))
        poisoned[name] = buffer.clone()
        spec = reg.slot(name).spec
        if spec.axis != "none":
            shape = list(buffer.shape)
            shape[spec.slice_dim] = step["raw_bs"] if spec.axis == "bs" else step["raw_tokens"]
            setattr(batch, name, random_tensor(tuple(shape), dtype, gen))
    batch.fixed = random_tensor((5,), dtype, gen)  # present on the batch, yet not copied

    reg.fill_from(batch, raw_bs=step["raw_bs"], padded_bs=step["padded_bs"], raw_num_tokens=step["raw_tokens"], padded_num_tokens=step["padded_tokens"])

    assert torch.equal(reg.slot("fixed").buffer, poisoned["fixed"])
    view = reg.extract(batch, padded_bs=step["padded_bs"], padded_num_tokens=step["padded_tokens"])
    for policy in POLICIES:
        for suffix in LAYOUTS:
            name = f"{policy}_{suffix}"
            slot = reg.slot(name)
            buffer, before, dim = slot.buffer, poisoned[name], slot.resolved.slice_dim
            raw, padded = ((step["raw_bs"], step["padded_bs"]) if slot.resolved.axis == "bs"
                           else (step["raw_tokens"], step["padded_tokens"]))
            capacity = buffer.shape[dim]

            assert torch.equal(narrow(buffer, dim, 0, raw), getattr(batch, name)), f"{name}: head"
            tail = narrow(buffer, dim, raw, padded)
            if policy == "zero":
                assert tail.eq(0).all(), f"{name}: tail"
            elif policy == "fill_sentinel":
                assert tail.eq(pad).all(), f"{name}: tail"
            else:
                assert torch.equal(tail, narrow(before, dim, raw, padded)), f"{name}: tail touched"
            assert torch.equal(narrow(buffer, dim, padded, capacity), narrow(before, dim, padded, capacity)), (
                f"{name}: past padded"
            )
            assert torch.equal(getattr(view, name), narrow(buffer, dim, 0, padded)), f"{name}: extracted view"


@settings(max_examples=30, deadline=None)
@given(dtype_name=st.sampled_from(sorted(DTYPES)), max_bs=st.integers(1, 16), max_tokens=st.integers(1, 32))
def test_fill_once_buffers_start_filled_with_the_pad_value(dtype_name, max_bs, max_tokens):
    reg = gs.build_registry(policy_spec(dtype_name), max_bs=max_bs, max_num_tokens=max_tokens, impl="interpreted", device="cpu")
    pad = reg.params["pad"]
    for suffix in LAYOUTS:
        assert reg.slot(f"fill_once_{suffix}").buffer.eq(pad).all()
