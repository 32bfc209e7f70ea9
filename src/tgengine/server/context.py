"""``ServerContext``: what every route of one app shares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.client import EngineClient
from .config import ServerConfig
from .health import HealthMonitor
from .metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: EngineClient
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    health: HealthMonitor
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def retry_after(self) -> int:
        return self.config.retry_after_seconds

    @classmethod
    def build(cls, engine: EngineClient, config: ServerConfig) -> ServerContext:
        name = config.served_model_name or served_name(engine.config.model)
        return cls(
            engine=engine,
            config=config,
            model_name=name,
            metrics=ServerMetrics(engine, name, config.metrics_prefix),
            health=HealthMonitor(engine, config.health_stall_seconds),
        )


def served_name(model_dir: str) -> str:
    """The default served model name: the model directory's basename."""
    path = Path(model_dir)
    return path.name or path.resolve().name or model_dir
