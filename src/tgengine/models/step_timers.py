"""``ForwardTimes``: where one forward's time went, measured only while a bench asks.

With ``CausalLM.timers`` set, the forward adds the wall time of every linear product
(``Gemm.linear``: the layers' projections, the MLPs, the experts, the LM head) to
``products_s``, and that of every layer's attention (rotary, the KV store and the attention
itself, from after the q/k/v product to before the output product) to ``attention_s``; the
one-call decode (``kernels.decode_layer``) times the same kernels inside its call. Left
None (the default) nothing is timed: one attribute test per product.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class ForwardTimes:
    """Seconds spent in products and in attention, summed over the forwards that ran with it."""

    products_s: float = 0.0
    attention_s: float = 0.0

    @contextmanager
    def attention(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.attention_s += time.perf_counter() - start
