"""The model agent: one rank's model, KV cache and sampler, its inputs, memory and threads."""
