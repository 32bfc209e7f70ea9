"""How much int8 weight-only quantization changes a model: perplexity, top-1 agreement, greedy.

    python tools/quantization_accuracy.py [--model DIR] [--windows 8] [--window 512] [--out F]

Runs the model three times through the public engine API (float32, bfloat16, bfloat16 with
``quantization="int8"``), on the same text: the English of Python's own reference
documentation (``pydoc_data.topics``, shipped with every CPython, so the figures can be
reproduced offline), cut into ``--windows`` windows of ``--window`` tokens. From each
position's prompt log probabilities (``SamplingParams(prompt_logprobs=1)``):

- perplexity of the text, and its ratio to float32's (llama.cpp's ``PPL(Q)/PPL(base)``);
- top-1 agreement: the share of positions whose most likely next token is the base's
  (llama.cpp's "same top p"), against float32 and (for int8) against bfloat16;
- mean |delta log p| of the text's tokens against the base;

and, for a few chat prompts, how many greedy continuations of 64 tokens equal the base's and
how long their common prefix is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import anyio

from tgengine import EngineConfig, SamplingParams, open_engine
from tgengine.cli.default_model import ensure_default_model
from tgengine.tokenization.tokenizer import chat_prompt, load_tokenizer

VARIANTS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16 + int8 weights": {"dtype": "bfloat16", "quantization": "int8"},
}
CHATS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Give me a short name for a cat.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What does CPU stand for?",
]


def text_windows(tokenizer: Any, windows: int, window: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer.encode(text)
    if len(ids) < windows * window:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {windows} x {window}")
    stride = len(ids) // windows
    return [ids[i * stride : i * stride + window] for i in range(windows)]


async def measure(
    config: EngineConfig, windows: list[list[int]], chats: list[list[int]]
) -> dict[str, Any]:
    logprobs: list[float] = []
    top1: list[int] = []
    greedy: list[list[int]] = []
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    answer = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    async with open_engine(config) as engine:
        for ids in windows:
            async for chunk in engine.generate(ids, scoring):
                if chunk.prompt_logprobs is not None:
                    assert chunk.prompt_top_logprobs is not None
                    logprobs += [lp for lp in chunk.prompt_logprobs[1:] if lp is not None]
                    top1 += [next(iter(top)) for top in chunk.prompt_top_logprobs[1:] if top]
        for ids in chats:
            tokens: list[int] = []
            async for chunk in engine.generate(ids, answer):
                tokens += chunk.token_ids
            greedy.append(tokens)
    return {"logprobs": logprobs, "top1": top1, "greedy": greedy}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(name: str, run: dict[str, Any], base_name: str, base: dict[str, Any]) -> dict[str, Any]:
    """``run``'s figures, and how far they are from ``base``'s."""
    lps, base_lps = run["logprobs"], base["logprobs"]
    ppl = math.exp(-sum(lps) / len(lps))
    base_ppl = math.exp(-sum(base_lps) / len(base_lps))
    same = sum(a == b for a, b in zip(run["top1"], base["top1"], strict=True))
    delta = sum(abs(a - b) for a, b in zip(lps, base_lps, strict=True)) / len(lps)
    prefixes = [common_prefix(a, b) for a, b in zip(run["greedy"], base["greedy"], strict=True)]
    return {
        "variant": name,
        "against": base_name,
        "perplexity": ppl,
        "ppl_ratio": ppl / base_ppl,
        "same_top1": same / len(base["top1"]),
        "mean_abs_delta_logp": delta,
        "greedy_equal": sum(p == len(b) for p, b in zip(prefixes, base["greedy"], strict=True)),
        "greedy_common_prefix_mean": sum(prefixes) / len(prefixes),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    model = args.model or str(ensure_default_model(progress=True))
    tokenizer = load_tokenizer(model)
    windows = text_windows(tokenizer, args.windows, args.window)
    chats = [chat_prompt(tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    runs = {}
    for name, options in VARIANTS.items():
        config = EngineConfig(model=model, device="cpu", **options)  # type: ignore[arg-type]
        runs[name] = anyio.run(measure, config, windows, chats)
        print(f"measured {name}", file=sys.stderr)
    pairs = [
        ("float32", "float32"),
        ("bfloat16", "float32"),
        ("bfloat16 + int8 weights", "float32"),
        ("bfloat16 + int8 weights", "bfloat16"),
    ]
    rows = [compare(name, runs[name], base, runs[base]) for name, base in pairs]
    positions = len(runs["float32"]["logprobs"])
    print(f"text: {args.windows} windows x {args.window} tokens of pydoc_data.topics")
    print(f"({positions} scored positions); greedy: {len(CHATS)} chat prompts x 64 tokens\n")
    header = (
        "variant                  against   perplexity  ppl ratio  same top-1  |dlogp|  "
        "greedy equal  common prefix"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['variant']:<24} {r['against']:<9} {r['perplexity']:>10.3f}  "
            f"{r['ppl_ratio']:>9.4f}  {r['same_top1']:>10.3%}  {r['mean_abs_delta_logp']:>7.4f}"
            f"  {r['greedy_equal']:>6}/{len(CHATS)}     {r['greedy_common_prefix_mean']:>6.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
