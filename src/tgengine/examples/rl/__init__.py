"""A GRPO loop with tgengine colocated: ``python examples/rl/train.py`` (docs/rl.md)."""

from .grpo import Sample, StepStats, Trainer, group_advantages
from .loop import CycleStats, RLLoop, RolloutError, process_counts, push_weights
from .task import NumberPrompt, make_prompts, number_reward

__all__ = [
    "CycleStats",
    "NumberPrompt",
    "RLLoop",
    "RolloutError",
    "Sample",
    "StepStats",
    "Trainer",
    "group_advantages",
    "make_prompts",
    "number_reward",
    "process_counts",
    "push_weights",
]
