"""The model core: a Llama-family decoder by layer range.

Owns: the architecture (arch), weight files read lazily by tensor (weights: GGUF, safetensors), the decoder slice
(shard: one block implementation, tree-attention masks), the few-row matmul kernels (kernels, csrc/), the KV cache
and its causal-consistent prune (kv_cache), the tokenizer, the sampling parameters, the autoregressive reference
decoder (generate) and model loading (load).

May import: the base modules (errors, types, env) only. Pure: no asyncio, aiohttp or zeroconf.
"""
