"""Sampling: the batched sampler, logits processors and log probabilities."""
