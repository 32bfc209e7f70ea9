"""``python -m tgengine.examples.rl``: see ``train.py``."""

import sys

from .train import main

sys.exit(main())
