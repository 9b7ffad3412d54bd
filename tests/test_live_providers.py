"""A live param's provider, misbehaving (issue 37): its exception, a value of the wrong
type, or a read of its own param is a SlotError naming the param and the slot that read
it, in both modes -- never read as "absent" (``ctx.params.get`` used to swallow a
KeyError, so rank 1 wrote rank 0's token count) nor silently converted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import graphslot as gs
from conftest import parse

MODES = ("interpreted", "generated")
SHARDED = """\
    name: sharded
    params:
      attn_tp_sharded: {type: bool, default: false, live: true}
      attn_tp_rank: {type: int, default: 0, live: true}
      attn_tp_size: {type: int, default: 1, live: true}
    slots:
      - name: num_token_non_padded
        shape: [1]
        dtype: int32
        axis: none
        copy_from_fb: false
        post_fill: local_num_token_non_padded
"""
USER = """\
    name: user
    params:
      scale: {type: float, default: 2.0, live: true}
    slots:
      - name: out
        shape: [1]
        dtype: float32
        axis: none
        copy_from_fb: false
        post_fill: scaled
"""
BATCH = SimpleNamespace(global_num_token_non_padded=torch.tensor(7))


def fill_sharded(mode, rank):
    """A fill of rank ``rank``'s provider on a sharded step (rank 1 of 2 would write 3)."""
    params = {"attn_tp_sharded": lambda ctx: True, "attn_tp_rank": rank, "attn_tp_size": lambda ctx: 2}
    reg = gs.build_registry(parse(SHARDED), max_bs=4, max_num_tokens=8, impl=mode, params=params, device="cpu")
    reg.fill_from(BATCH, raw_bs=3, padded_bs=4, raw_num_tokens=7, padded_num_tokens=8)
    return reg.slot("num_token_non_padded").buffer.tolist()


def fill_error(mode, rank):
    with pytest.raises(gs.SlotError) as err:
        fill_sharded(mode, rank)
    return err.value


@pytest.mark.parametrize("mode", MODES)
def test_a_providers_exception_propagates_naming_the_param_and_the_slot(mode):
    def rank(ctx):
        return {}["rank"]

    assert fill_sharded(mode, lambda ctx: 1) == [3]
    err = fill_error(mode, rank)
    assert str(err) == ("slot 'num_token_non_padded': live param 'attn_tp_rank': its provider raised "
                        "KeyError: 'rank'")
    assert isinstance(err.__cause__, KeyError)  # the original, chained


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value, shown", [("2", "str '2'"), (2.5, "float 2.5"), (None, "NoneType None"),
                                          (True, "bool True")])
def test_a_providers_value_of_another_type_is_an_error_not_converted(mode, value, shown):
    assert str(fill_error(mode, lambda ctx: value)) == (
        f"slot 'num_token_non_padded': live param 'attn_tp_rank' is int, its provider returned {shown}")


@pytest.mark.parametrize("mode", MODES)
def test_a_provider_reading_its_own_param_is_an_error_not_a_recursion(mode):
    err = fill_error(mode, lambda ctx: ctx.params["attn_tp_rank"])
    assert str(err) == ("slot 'num_token_non_padded': live param 'attn_tp_rank': its provider reads "
                        "ctx.params['attn_tp_rank'] itself (a provider computes the value; it cannot read it)")


@pytest.mark.parametrize("mode", MODES)
def test_user_hooks_get_the_same_errors_naming_their_slot(mode):
    def scaled(buffer, fb, ctx):
        buffer.fill_(ctx.params.get("scale", 0.0))  # .get must not read a failure as absent

    def build(provider):
        return gs.build_registry(parse(USER), max_bs=4, max_num_tokens=8, impl=mode, params={"scale": provider},
                                 hooks={"scaled": scaled}, device="cpu")

    reg = build(lambda ctx: 3)  # an int for a float param, as at build
    reg.fill_from(SimpleNamespace(), raw_bs=1, padded_bs=1, raw_num_tokens=1, padded_num_tokens=1)
    assert reg.slot("out").buffer.tolist() == [3.0]
    for provider, message in [
        (lambda ctx: {}["scale"], "live param 'scale': its provider raised KeyError: 'scale'"),
        (lambda ctx: "3", "live param 'scale' is float, its provider returned str '3'"),
    ]:
        with pytest.raises(gs.SlotError) as err:
            build(provider).fill_from(SimpleNamespace(), raw_bs=1, padded_bs=1, raw_num_tokens=1,
                                      padded_num_tokens=1)
        assert str(err.value) == f"slot 'out': {message}"
