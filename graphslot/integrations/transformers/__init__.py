"""transformers causal LMs through graphslot's decode graph runner (``pip install 'graphslot[hf]'``).

* :class:`PagedCache`: a paged KV cache implementing transformers' ``Cache`` protocol,
  indexed by the decode spec's slots (``out_cache_loc``, ``req_pool_indices``), so one
  cache serves every captured batch size and requests of any length;
* :class:`HFDecodeAdapter`: the :class:`~graphslot.runners.decode.DecodeGraphRunner`
  adapter for a causal LM of a tested family (:data:`TESTED_FAMILIES`: Llama, Mistral,
  Qwen2, Qwen3) whose attention goes through the cache;
* :class:`HFPrefillAdapter`: the :class:`~graphslot.runners.prefill.PrefillGraphRunner`
  adapter for a Llama-like causal LM (:data:`.attention.ROUTED_FAMILIES`): the decoder
  layers as the captured stack, prefill K and V written into the same
  :class:`PagedCache`; with such a model both runners take ``capture="full"``,
  ``"breakable"`` or ``"piecewise"`` (:mod:`.attention`);
* :class:`ContinuousBatcher`: requests join and leave; prefill runs eagerly through
  transformers into the pool, decode through the graphs; per-request sampling
  (:mod:`.sampling`), stopping as generate, logprobs and streaming (:class:`TokenEvent`);
* :func:`tiny_model` and :class:`PerRequestHF`: random-weight models of the tested
  families and plain per-request transformers decode to check against.

The model's classes are transformers' own and run unchanged.
"""

from __future__ import annotations

#: Oldest transformers the tests pass with (tests/test_hf_integration.py): before 5.4 the
#: tested families derive ``cache_position`` from the cache's (single) sequence length.
MIN_TRANSFORMERS = "5.4.0"

try:
    import transformers as _transformers
except ImportError as _exc:  # one line, naming the extra
    raise ImportError(f"graphslot.integrations.transformers needs transformers>={MIN_TRANSFORMERS}: "
                      "pip install 'graphslot[hf]'") from _exc


from packaging.version import Version  # noqa: E402 - a dependency of transformers

if Version(_transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
    raise ImportError(f"graphslot.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, found "
                      f"{_transformers.__version__}: pip install -U 'graphslot[hf]'")

from .adapter import DecodeStep, HFDecodeAdapter, check_model  # noqa: E402
from .cache import PagedCache, PagedCacheLayer, kv_geometry  # noqa: E402
from .engine import ContinuousBatcher, Request, StepOutput, TokenEvent  # noqa: E402
from .families import REFUSED  # noqa: E402
from .prefill import HFPrefillAdapter, PrefillStep, prefill_step  # noqa: E402
from .requests import RequestFailed  # noqa: E402
from .geometry import LayerGeometry, attention_layers, bytes_per_slot  # noqa: E402
from .models import FAMILIES, TESTED_FAMILIES, PerRequestHF, Recipe, tiny_config, tiny_model  # noqa: E402
from .sampling import SamplingParams, greedy  # noqa: E402

__all__ = [
    "MIN_TRANSFORMERS", "TESTED_FAMILIES", "DecodeStep", "HFDecodeAdapter", "HFPrefillAdapter", "PrefillStep",
    "prefill_step", "check_model", "LayerGeometry", "PagedCache", "PagedCacheLayer", "attention_layers",
    "bytes_per_slot", "kv_geometry", "ContinuousBatcher", "Request", "RequestFailed", "StepOutput", "TokenEvent",
    "greedy", "SamplingParams", "REFUSED", "FAMILIES", "PerRequestHF", "Recipe", "tiny_config", "tiny_model",
]
