"""The local engine's runtime: scheduler, KV cache, sampler, the engine object."""
