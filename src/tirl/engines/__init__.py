"""tirl.engines: token-in/token-out generation, KV capacity and weight loading (hf, vllm)."""

from tirl.engines.base import Engine, EnginePool, Generation, KVCapacity, SamplingParams, SingleEnginePool
from tirl.engines.config import EngineConfig
from tirl.engines.factory import build_engines, build_pool
from tirl.engines.tokenizer import load_tokenizer

__all__ = [
    "Engine",
    "EngineConfig",
    "EnginePool",
    "Generation",
    "KVCapacity",
    "SamplingParams",
    "SingleEnginePool",
    "build_engines",
    "build_pool",
    "load_tokenizer",
]
