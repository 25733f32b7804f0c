"""megatron.inference: text generation for BloomModel.

    engine.py     InferenceEngine: static KV cache, batched/chunked prefill, CUDA-graph decode, continuous batching
    kv_cache.py   StaticKVCache: the slots x positions cache and its attention
    decode.py     FusedDecoder: the fused decode step (segments for torch.compile, per-row-length attention;
                  triton_decode.py holds its Triton kernel)
    parity.py     greedy parity with HF per row, each divergence measured (bf16 near-ties)
    sampling.py   SamplingParams, per-row greedy/temperature/top-k/top-p sampling with hashed seeds
    scoring.py    Scorer: token log-probs on any TP x PP layout (LM head on scored positions only, padding rows of
                  the vocabulary masked): evaluation (megatron/evaluation) and the server's logprobs/echo
    reference.py  the eager path with a growing cache (the engine is tested against it and against HF)
    api.py        the server's request validation, streamed text deltas and response objects (pure)
    server.py     the HTTP server: OpenAI completions + Megatron's PUT /api over one engine thread
    worker.py     the engine thread (EngineWorker), TP plans, the rows of one HTTP request
    remote.py     --frontend process: the HTTP app in a process of its own, over a pipe to the engine's process
"""
from megatron.inference.engine import InferenceEngine, Request
from megatron.inference.kv_cache import StaticKVCache
from megatron.inference.sampling import SamplingParams

__all__ = ["InferenceEngine", "Request", "SamplingParams", "StaticKVCache"]
