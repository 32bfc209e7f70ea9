"""Fixed-width text tables of bench rows, and the lines every report and chart shares."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A fixed-width text table of ``rows``: ``columns`` are (key, header)."""
    cells = [[header for _, header in columns]]
    cells += [[_fmt(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        first = r[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join([first, *rest]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def best_peer_ratios(result: dict[str, Any]) -> list[str]:
    """The ratio lines that compare tgengine with each peer at its best thread count."""
    return [f"{k}: {v:.2f}" for k, v in result.get("ratios", {}).items() if "(best)" in k]


def isa_suffix(result: dict[str, Any]) -> str:
    """`` (avx2)``: the CPU's ISA (``kernels.isa``) that every figure of a result was
    measured on, for its titles; empty for a result without a machine."""
    isa = result.get("machine", {}).get("isa")
    return f" ({isa})" if isa else ""
