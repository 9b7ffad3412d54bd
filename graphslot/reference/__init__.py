"""A tiny paged-KV transformer, attention backend and scheduler in pure torch.

It stands in for an inference engine's model runner so graph runners can be exercised
(and compared with eager execution) without one.
"""

from .attention import TorchAttentionBackend, TorchAttnMetadata
from .forward_batch import ForwardBatch, ForwardMode
from ..kvpool import PagedKVCache, ReqToTokenPool
from .memory import SWAKVCache
from .model import ReferenceRuntime, TinyConfig, TinyLlama, build_reference_model
from .scheduler import (
    Request,
    Scheduler,
    StepRecord,
    generate_requests,
    make_decode_batch,
    make_extend_batch,
)

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "PagedKVCache",
    "ReferenceRuntime",
    "ReqToTokenPool",
    "Request",
    "SWAKVCache",
    "Scheduler",
    "StepRecord",
    "TinyConfig",
    "TinyLlama",
    "TorchAttentionBackend",
    "TorchAttnMetadata",
    "build_reference_model",
    "generate_requests",
    "make_decode_batch",
    "make_extend_batch",
]
