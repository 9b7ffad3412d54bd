"""The eager path through the same slots as the graphs, so both see the same inputs.

Batches are not padded (raw == padded), and the registry uses the decode spec's
``eager`` preset: values a batch brings itself (DP global token counts) are carried,
not overwritten. Capacity grows to the next power of two when a batch (an eager
prefill, say) exceeds it, which rebuilds the registry; buffers never move otherwise.

``GRAPHSLOT_EAGER_INPUT_NO_COPY=1`` (or ``no_copy=True``) skips the copy and runs the
model on the batch's own tensors, for when the copy is pure overhead.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .. import env
from ..api import build
from ..spec.loading import load_spec
from ..spec.model import RegistrySpec
from .adapter import DecodeAdapter
from .contract import check_adapter

NO_COPY_ENV = env.EAGER_INPUT_NO_COPY.name
PRESET = "eager"


def no_copy_from_env() -> bool:
    return env.EAGER_INPUT_NO_COPY.enabled()


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class EagerRunner:
    def __init__(
        self,
        adapter: DecodeAdapter,
        max_bs: int = 8,
        max_num_tokens: Optional[int] = None,
        *,
        spec: Any = "decode",
        impl: Any = "generated",
        params: Optional[Mapping[str, Any]] = None,
        no_copy: Optional[bool] = None,
    ):
        #: Where the registry's buffers live: the adapter's ``device``, else its model's.
        self.device = check_adapter(adapter, DecodeAdapter, ("forward_eager",))
        self.adapter = adapter
        self.impl = impl
        self.no_copy = no_copy_from_env() if no_copy is None else bool(no_copy)
        if not isinstance(spec, RegistrySpec):
            spec = load_spec(spec)
        if PRESET not in spec.presets:
            raise ValueError(f"EagerRunner needs a spec with an {PRESET!r} preset (the values a batch brings "
                             f"itself, carried instead of overwritten); spec {spec.name!r} ({spec.path}) has "
                             f"{sorted(spec.presets) or 'none'}: copy the shipped decode spec's presets.eager")
        # The adapter's graph-time values (seq_len_fill_value ...) must not undo the preset.
        preset = spec.presets[PRESET]
        self.params = {k: v for k, v in adapter.spec_params().items() if k not in preset}
        self.params.update(params or {})
        self._spec = spec
        self._side = adapter.side_inputs()
        self.rebuilds = 0
        self.registry = self._build(max_bs, max_num_tokens or max_bs)

    def _build(self, max_bs: int, max_num_tokens: int):
        return build(self._spec, max_bs=max_bs, max_num_tokens=max_num_tokens, device=self.device,
                              params=self.params, impl=self.impl, preset=PRESET)

    @property
    def capacity(self) -> tuple:
        return self.registry.max_bs, self.registry.max_num_tokens

    def ensure_capacity(self, bs: int, num_tokens: int) -> None:
        reg = self.registry
        if bs <= reg.max_bs and num_tokens <= reg.max_num_tokens:
            return
        self.registry = self._build(max(reg.max_bs, next_power_of_two(bs)),
                                    max(reg.max_num_tokens, next_power_of_two(num_tokens)))
        self.rebuilds += 1

    def forward(self, fb: Any) -> Any:
        if self.no_copy:
            return self.adapter.forward_eager(fb)
        bs = self.adapter.batch_size(fb)
        n = self.adapter.num_tokens(fb)
        self.ensure_capacity(bs, n)
        self.registry.fill_from(fb, raw_bs=bs, padded_bs=bs, raw_num_tokens=n, padded_num_tokens=n,
                                side_inputs=self._side)
        return self.adapter.forward_eager(self.registry.extract(fb, padded_bs=bs, padded_num_tokens=n))

    __call__ = forward

    @property
    def static_bytes(self) -> int:
        return self.registry.nbytes
