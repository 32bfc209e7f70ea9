"""A fake ``vllm`` for the peer tests: the offline API the bench's driver uses, no model.

``LLM`` records its arguments and the thread binding it was given in the JSON-lines file
named by ``FAKE_PEER_RECORD``, and starts a child process that outlives it unless killed
(as vLLM's engine core would), whose pid it records too. ``generate`` returns
``max_tokens`` tokens per prompt after a short, proportional pause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__version__ = "0.0.fake"


def record(entry: dict[str, Any]) -> None:
    with open(os.environ["FAKE_PEER_RECORD"], "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        engine_core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        record(
            {
                "llm": {"model": model, **kwargs},
                "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "host_ip": os.environ.get("VLLM_HOST_IP"),
                "kvcache_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                "pythonpath_of_caller": "tgengine" in os.environ.get("CALLER_PYTHONPATH", ""),
                "engine_core_pid": engine_core.pid,
            }
        )

    def generate(
        self, prompts: list[Any], params: list[SamplingParams], *, use_tqdm: bool = True
    ) -> list[_RequestOutput]:
        assert len(prompts) == len(params)
        for p in params:
            assert p.temperature == 0 and p.ignore_eos
        sizes = [
            [len(p["prompt_token_ids"]), s.max_tokens] for p, s in zip(prompts, params, strict=True)
        ]
        record({"generate": sizes})
        time.sleep(0.01 * max(s.max_tokens for s in params))
        return [_RequestOutput([_Completion(list(range(s.max_tokens)))]) for s in params]
