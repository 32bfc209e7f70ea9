"""``CausalLM``: tgengine's one forward, which runs every architecture (``models.architectures``).

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...) so a
checkpoint loads by name. The forward reads one ``ForwardInputs`` (all sequences' rows
concatenated), writes each layer's keys and values into the paged ``KVCache``, and returns
float32 logits for ``inputs.logits_rows`` only.
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch
from torch import nn

from tgengine import kernels
from tgengine.kernels import elementwise
from tgengine.kernels.decode_layer import run_layers
from tgengine.models.attention import AttentionPlan, KernelDecodePlan
from tgengine.models.config import ModelConfig
from tgengine.models.decoder_layer import DecoderLayer
from tgengine.models.fused_decode import DecodeCalls, GluedRun, Segment, decode_step, run_glued
from tgengine.models.gemm import Gemm, LinearWeights
from tgengine.models.inputs import ForwardInputs
from tgengine.models.kv_cache import KVCache
from tgengine.models.layers import RMSNorm
from tgengine.models.parallel_layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    gather_logits,
    local_heads,
    local_kv_heads,
    shard_map,
)
from tgengine.models.rope import RotaryEmbedding
from tgengine.models.self_attention import StepContext
from tgengine.models.step_timers import ForwardTimes
from tgengine.runtime.parallel import ParallelContext


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, unit_offset=config.norm_unit_offset
        )


class CausalLM(nn.Module):
    """A Llama-family decoder with a paged KV cache.

    Build it (on the ``meta`` device if you like) and fill it with ``load_weights``;
    parameters never require grad. Call ``forward`` under ``torch.inference_mode()``.

    ``gemm`` picks the kernel of each linear product (see ``models.gemm``). With
    ``gemm.prepack`` on, ``models.weights.pack_weights`` replaces the linear weights by their
    packed form (one copy: the parameters then hold placeholders); change weights after
    that only through ``models.weights`` (``copy_weights``), which unpacks what it writes.

    With a ``parallel`` context of world size N (``models.parallel_layers``) the model holds
    this rank's shard of every weight (``weight_shards`` says which part of each full
    tensor), runs its share of each layer, and returns the full logits on every rank.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelContext()
        self.model = DecoderModel(config, parallel)
        self.lm_head: ParallelLMHead | None = None
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, parallel)
        ropes = [config.rope] if config.local_rope is None else [config.rope, config.local_rope]
        self.rotary = [RotaryEmbedding(rope, config.head_dim) for rope in ropes]
        self.head = (
            LinearWeights([self.lm_head])
            if self.lm_head is not None
            else self.model.embed_tokens.as_head
        )
        self.gemm = Gemm()
        self.use_kernels = True
        """Use tgengine's compiled CPU kernels where they apply (``models.kernels``)."""
        # Every distinct attention window (None: full), in a fixed order: a one-call decode
        # layer names its window's block tables by its place here.
        self._windows = tuple(dict.fromkeys(config.window_of(i) for i in range(config.num_layers)))
        self.decode_calls = DecodeCalls(
            [cast(DecoderLayer, layer) for layer in self.model.layers], self._windows, self.gemm
        )
        """Each layer's one-call decode (``models.fused_decode``)."""
        self.requires_grad_(False)
        self.weight_shards = shard_map(self)
        """``{parameter name: its Shard of the checkpoint's full tensor}``."""

    @property
    def timers(self) -> ForwardTimes | None:
        """Where the forwards add their time in products and in attention, while a bench
        profiles (``models.step_timers``); None (the default): nothing is timed."""
        return self.gemm.timers

    @timers.setter
    def timers(self, timers: ForwardTimes | None) -> None:
        self.gemm.timers = timers

    def _kernel_fits(self, kv_cache: KVCache, *, prefill: bool = False) -> bool:
        c = self.config
        groups = local_heads(c, self.parallel) // local_kv_heads(c, self.parallel)
        fits = kernels.supports_prefill if prefill else kernels.supports
        return fits(kv_cache.kv.device, kv_cache.kv.dtype, c.head_dim, groups)

    def _layers(self, x: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's ``(output, residual stream)`` in turn; in a decode step, each run of
        consecutive layers that qualify in one call (``models.fused_decode``)."""
        layers = self.model.layers
        segments: list[Segment] = (
            self.decode_calls.segments()
            if step.decode_layers
            else [(i, i + 1, None) for i in range(len(layers))]
        )
        decode_args = None
        alive: list[torch.Tensor] = []  # what decode_args points into, until the calls return
        residual: torch.Tensor | None = None
        timers = self.timers
        spent = None if timers is None else (ctypes.c_int64 * 2)()
        for start, _, run in segments:
            if run is None:
                x, residual = layers[start](x, residual, step, start)
                continue
            if decode_args is None:
                decode_args, alive = decode_step(step, self._windows)
            if isinstance(run, GluedRun):
                decode_args.spent_ns = None if spent is None else ctypes.addressof(spent)
                x, residual = run_glued(run, decode_args, x.contiguous(), residual, self.gemm)
            else:
                x, residual = run_layers(run, decode_args, x.contiguous(), residual, spent)
        del alive
        if timers is not None and spent is not None:
            timers.products_s += spent[0] * 1e-9
            timers.attention_s += spent[1] * 1e-9
        assert residual is not None
        return x, residual

    def linear_weights(self) -> list[LinearWeights]:
        """Every linear product's weight, the output head's last (tied or not)."""
        found: list[LinearWeights] = []
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            found += layer.linear_weights()
        return [*found, self.head]

    def forward(self, inputs: ForwardInputs, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab_size]`` (all rows if it is None).

        Side effect: every row's keys and values are written to ``kv_cache`` at
        ``inputs.slot_mapping``, in every layer.
        """
        c = self.config
        x = self.model.embed_tokens(inputs.input_ids)
        if c.embed_scale is not None:
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        rotary = [r.cos_sin(inputs.positions, x.dtype) for r in self.rotary]
        use_kernel = self.use_kernels and self._kernel_fits(kv_cache)
        prefill_kernel = self.use_kernels and self._kernel_fits(kv_cache, prefill=True)
        plans = {
            w: AttentionPlan.build(
                inputs,
                kv_cache.block_size,
                w,
                use_kernel=use_kernel,
                prefill_kernel=prefill_kernel,
            )
            for w in self._windows
        }
        fused = self.use_kernels and elementwise.applies(x)
        # A decode-only step attended by the paged kernel: runs of layers in one call each.
        decode_layers = fused and not self.parallel.is_parallel
        decode_layers &= all(
            p.decode_only and isinstance(p.decodes[0], KernelDecodePlan) for p in plans.values()
        )
        step = StepContext(
            inputs, plans, kv_cache, rotary, self.gemm, fused=fused, decode_layers=decode_layers
        )
        x, residual = self._layers(x, step)
        if inputs.logits_rows is not None:
            x = x[inputs.logits_rows]
            residual = None if residual is None else residual[inputs.logits_rows]
        x, _ = self.model.norm.add_and_norm(x, residual, fused=fused)
        local = self.gemm.linear(x, self.head, float_output=True)
        logits = gather_logits(local, c.vocab_size, self.parallel).float()
        cap = c.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
