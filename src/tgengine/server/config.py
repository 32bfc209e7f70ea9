"""``ServerConfig``: where to listen, who may call, and the limits. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # as tool_parsers.CHOICES


@dataclass(frozen=True)
class ServerConfig:
    """Configuration of one HTTP server; validated on construction (``ValueError`` names the field).

    ``port=0`` binds a free port (``Server.run`` reports the real one). ``api_key`` guards
    every route except the open ones (``/health``, ``/metrics``, ``/version``,
    ``/tokenize``, ``/detokenize``, as in vLLM); ``protect_metrics`` guards ``/metrics``
    too. ``admin_key`` enables the management routes and is the only key they accept.
    ``served_model_name`` defaults to the model directory's basename. ``metrics_prefix``
    names the Prometheus metrics (``vllm`` lets a vLLM dashboard work unchanged).
    ``tool_call_parser`` reads tool calls in ``tool_choice="auto"`` answers: ``hermes``,
    ``llama3_json``, or ``auto`` (picked by the chat template). ``allow_additional_properties``:
    a JSON schema's objects take properties it does not name unless it says
    ``additionalProperties`` (JSON Schema's own reading); by default they do not (vLLM's).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    admin_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    health_stall_seconds: float = 30.0
    retry_after_seconds: int = 1
    graceful_timeout: float = 5.0
    keep_alive_timeout: float = 5.0
    backlog: int = 1024
    tool_call_parser: str = "auto"
    protect_metrics: bool = False
    metrics_prefix: str = "tgengine"
    allow_additional_properties: bool = False
    max_weight_part_bytes: int = 16 * 1024**3
    weight_update_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port!r}")
        for name in ("api_key", "admin_key", "served_model_name"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"{name}: must not be empty (omit it instead)")
        if self.api_key is not None and self.api_key == self.admin_key:
            raise ValueError("admin_key: must differ from api_key")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {TOOL_CALL_PARSERS}")
        if not self.metrics_prefix.isidentifier():
            raise ValueError(f"metrics_prefix: must be an identifier, got {self.metrics_prefix!r}")
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("backlog", self.backlog)
        _positive("max_weight_part_bytes", self.max_weight_part_bytes)
        if not isinstance(self.retry_after_seconds, int) or self.retry_after_seconds < 0:
            raise ValueError("retry_after_seconds: must be an integer >= 0")
        timeouts = ("health_stall_seconds", "graceful_timeout", "keep_alive_timeout")
        for name in (*timeouts, "weight_update_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
