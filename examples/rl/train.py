"""GRPO on SmolLM2-135M-Instruct with tgengine in the same process (docs/rl.md).

    python examples/rl/train.py [--backend trio] [--process] [--steps 30] [--out rl-out]

The loop itself is ``tgengine.examples.rl``; this script finds the default model the way
the CLI does (``ensure_default_model``: converted once into the cache) and runs it.
"""

from __future__ import annotations

import sys

from tgengine.cli.default_model import ensure_default_model
from tgengine.examples.rl.train import main

if __name__ == "__main__":
    quiet = "--no-progress" in sys.argv[1:]
    model = None if "--model" in sys.argv[1:] else str(ensure_default_model(progress=not quiet))
    sys.exit(main(sys.argv[1:], default_model=model))
