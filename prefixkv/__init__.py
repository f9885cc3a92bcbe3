"""prefixkv: a lossless LLM inference engine (paged KV cache, radix prefix sharing, chunked-prefill
continuous batching). ``from prefixkv import LLM, SamplingParams``."""

from prefixkv.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprob
from prefixkv.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch and transformers; load it on first use.
    if name == "LLM":
        from prefixkv.llm import LLM

        return LLM
    if name == "LLMEngine":
        from prefixkv.engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from prefixkv.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'prefixkv' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TokenLogprob"]
