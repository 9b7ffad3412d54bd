"""Property tests of the padding invariants (interpreted registry).

For any capacities, any ``raw <= padded <= capacity`` and any dtype, with every buffer
poisoned with random values before the fill:

* the head ``[:raw + k]`` equals the source (``k``: the slot's ``extra_rows``);
* the tail ``[raw + k:padded + k]`` is 0 for ``zero``, the pad value for ``fill_sentinel``,
  the head's last row for ``repeat_last`` (0 for an empty head), and untouched (the
  poison) for ``keep_pad``, ``foreach_copy`` and ``fill_once``;
* under ``reset_to: capacity`` the written tail runs to the end of the buffer;
* nothing past the written tail changes, and an ``axis: none`` buffer that is not copied
  does not change at all;
* a staged slot's device buffer holds its host buffer's rows ``[:padded + k]`` (the whole
  buffer under ``reset_to: capacity``), and its view is of the device buffer.

Each policy is checked on a 1-D ``bs`` slot, a ``tokens`` slot with a trailing dimension,
a ``slice_dim: 1`` slot (``[2, max_num_tokens]``), and with extra rows (staged), each
resetting policy to the padded size and to the capacity; in both implementations.
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
POLICIES = ("zero", "fill_sentinel", "keep_pad", "foreach_copy", "fill_once", "repeat_last")
WRITING = ("zero", "fill_sentinel", "repeat_last")  # the policies reset_to applies to
LAYOUTS = {  # name suffix -> (shape, axis, slice_dim, extra_rows, staged)
    "bs": ('["max_bs"]', "bs", 0, 0, False),
    "tok": ('["max_num_tokens", 3]', "tokens", 0, 0, False),
    "dim1": ('[2, "max_num_tokens"]', "tokens", 1, 0, False),
    "bs1": ('["max_bs + 1"]', "bs", 0, 1, True),
    "tok2": ('["max_num_tokens + 2", 3]', "tokens", 0, 2, True),
    "dim1x1": ('[2, "max_num_tokens + 1"]', "tokens", 1, 1, False),
}
RESETS = ("padded", "capacity")


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
    for policy, suffix, reset in slot_names():
        shape, axis, slice_dim, extra_rows, staged = LAYOUTS[suffix]
        lines += [f"  - name: {policy}_{suffix}_{reset}", f"    shape: {shape}", f"    dtype: {dtype_name}",
                  f"    axis: {axis}", f"    slice_dim: {slice_dim}", f"    padding: {policy}",
                  f"    extra_rows: {extra_rows}", f"    staged: {str(staged).lower()}", f"    reset_to: {reset}"]
        if policy in ("fill_sentinel", "fill_once"):
            lines.append("    pad_value: pad")
    lines += ["  - name: fixed", "    shape: [5]", f"    dtype: {dtype_name}", "    axis: none",
              "    padding: keep_pad", "    copy_from_fb: false"]
    return gs.parse_spec("\n".join(lines) + "\n", path="props.yaml")


def slot_names():
    """(policy, layout, reset_to) of every slot of ``policy_spec``."""
    return [(p, suffix, r) for p in POLICIES for suffix in LAYOUTS for r in RESETS if r == "padded" or p in WRITING]


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
@given(step=steps(), impl=st.sampled_from(["interpreted", "generated"]))
def test_padding_invariants(step, impl):
    dtype = DTYPES[step["dtype"]]
    gen = torch.Generator().manual_seed(step["seed"])
    pad = random_tensor((), dtype, gen).item()
    reg = gs.build_registry(policy_spec(step["dtype"]), max_bs=step["max_bs"], max_num_tokens=step["max_tokens"],
                            params={"pad": pad}, impl=impl, device="cpu")

    poisoned, batch = {}, SimpleNamespace()
    for name in reg.slot_names():
        slot = reg.slot(name)
        for buffer in slot.buffers():  # a staged slot's two, each its own poison
            buffer.copy_(random_tensor(tuple(buffer.shape), dtype, gen))
        poisoned[name] = slot.filled.clone()
        if slot.resolved.axis != "none":
            shape = list(slot.buffer.shape)
            shape[slot.resolved.slice_dim] = slot.count(step["raw_bs"], step["raw_tokens"])
            setattr(batch, name, random_tensor(tuple(shape), dtype, gen))
    batch.fixed = random_tensor((5,), dtype, gen)  # present on the batch, yet not copied

    reg.fill_from(batch, raw_bs=step["raw_bs"], padded_bs=step["padded_bs"], raw_num_tokens=step["raw_tokens"],
                  padded_num_tokens=step["padded_tokens"])

    assert torch.equal(reg.slot("fixed").buffer, poisoned["fixed"])
    view = reg.extract(batch, padded_bs=step["padded_bs"], padded_num_tokens=step["padded_tokens"])
    for policy, suffix, reset in slot_names():
        name = f"{policy}_{suffix}_{reset}"
        slot = reg.slot(name)
        buffer, before, dim = slot.filled, poisoned[name], slot.resolved.slice_dim
        raw, padded = ((step["raw_bs"], step["padded_bs"]) if slot.resolved.axis == "bs"
                       else (step["raw_tokens"], step["padded_tokens"]))
        extra, capacity = slot.resolved.extra_rows, buffer.shape[dim]
        head, end = raw + extra, capacity if reset == "capacity" else padded + extra

        assert torch.equal(narrow(buffer, dim, 0, head), getattr(batch, name)), f"{name}: head"
        tail = narrow(buffer, dim, head, end)
        if policy == "zero":
            assert tail.eq(0).all(), f"{name}: tail"
        elif policy == "fill_sentinel":
            assert tail.eq(pad).all(), f"{name}: tail"
        elif policy == "repeat_last":
            last = narrow(buffer, dim, head - 1, head) if head else torch.zeros_like(narrow(buffer, dim, 0, 1))
            assert torch.equal(tail, last.expand_as(tail)), f"{name}: tail"
        else:
            assert torch.equal(tail, narrow(before, dim, head, end)), f"{name}: tail touched"
        assert torch.equal(narrow(buffer, dim, end, capacity), narrow(before, dim, end, capacity)), (
            f"{name}: past the tail"
        )
        assert torch.equal(getattr(view, name), narrow(slot.buffer, dim, 0, padded + extra)), f"{name}: view"
        if slot.host is not None:  # staged: what the step defines reached the device buffer
            staged = capacity if reset == "capacity" else padded + extra
            assert torch.equal(narrow(slot.buffer, dim, 0, staged), narrow(buffer, dim, 0, staged)), name


@settings(max_examples=30, deadline=None)
@given(dtype_name=st.sampled_from(sorted(DTYPES)), max_bs=st.integers(1, 16), max_tokens=st.integers(1, 32))
def test_fill_once_buffers_start_filled_with_the_pad_value(dtype_name, max_bs, max_tokens):
    reg = gs.build_registry(policy_spec(dtype_name), max_bs=max_bs, max_num_tokens=max_tokens, impl="interpreted",
                            device="cpu")
    pad = reg.params["pad"]
    for suffix in LAYOUTS:
        for buffer in reg.slot(f"fill_once_{suffix}_padded").buffers():  # a staged slot's host one too
            assert buffer.eq(pad).all()
