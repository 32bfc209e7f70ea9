"""The example's task: answer with one integer in a given range, and nothing else.

The base SmolLM2-135M-Instruct is poor at it at temperature 1 (it explains, or names a
number outside the range, or both: a mean reward of about 0.1 to 0.2), and the reward is
graded, so a group of samples almost always has some spread to learn from. Pure Python.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_TEMPLATES = (
    "Pick a number between {lo} and {hi}. Reply with the number only.",
    "Give one integer from {lo} to {hi}. Answer with just the number.",
    "Choose a whole number in the range {lo}-{hi}. Write only the number.",
    "Say a number between {lo} and {hi}, digits only.",
)
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class NumberPrompt:
    """One prompt of the task and the range its answer must fall in."""

    text: str
    lo: int
    hi: int


def make_prompts(num_prompts: int, *, seed: int = 0) -> list[NumberPrompt]:
    """``num_prompts`` prompts: random ranges of width 10 to 30 within 1..200."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        lo = rng.randint(1, 170)
        hi = lo + rng.randint(9, 29)
        prompts.append(NumberPrompt(_TEMPLATES[i % len(_TEMPLATES)].format(lo=lo, hi=hi), lo, hi))
    return prompts


def number_reward(prompt: NumberPrompt, completion: str) -> float:
    """1.0 for exactly one integer in range and nothing else; partial credit on the way.

    0.5 when the first integer in the reply is in range, plus 0.5 when the reply is that
    integer alone (an optional final period allowed); 0.2 for a bare integer out of range;
    0.0 otherwise.
    """
    reply = completion.strip().removesuffix(".").strip()
    numbers = _NUMBER.findall(reply)
    if not numbers:
        return 0.0
    in_range = prompt.lo <= int(numbers[0]) <= prompt.hi
    alone = reply == numbers[0]
    if in_range:
        return 1.0 if alone else 0.5
    return 0.2 if alone else 0.0
