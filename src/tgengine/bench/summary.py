"""One table from the JSON results of several benches (``bench summary DIR``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import best_tgengine
from .report import table

_MIB = 1024**2


def _rows(kind: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(figure: str, value: Any, unit: str = "") -> None:
        rows.append({"bench": kind, "figure": figure, "value": value, "unit": unit})

    if kind == "parity":
        for dtype, s in r["summary"].items():
            add(
                f"greedy tokens equal transformers ({dtype})",
                100 * s["matched_prefix_fraction"],
                "% (exact)" if s["exact"] else "%",
            )
    elif kind == "throughput":
        tg = best_tgengine(r["rows"], "tokens_per_s")
        if tg:
            add("tgengine output tokens/s", tg["tokens_per_s"], "tok/s")
            add("tgengine fraction of compute floor", 100 * tg["fraction_of_compute_floor"], "%")
            if "fraction_of_roofline_floor" in tg:  # JSON written before it existed: none
                roofline = 100 * tg["fraction_of_roofline_floor"]
                add("tgengine fraction of roofline floor", roofline, "%")
        for name, value in r.get("ratios", {}).items():
            if name.startswith("tgengine /"):
                add(name, value, "x")
    elif kind == "batch32":
        for row in r["rows"]:
            add(f"{row['system']} tokens/s", row["tokens_per_s"], "tok/s")
        for name, value in r.get("ratios", {}).items():
            add(name, value, "x")
        b = r.get("step_breakdown", {})
        if b.get("num_steps"):
            add("time outside the forward at 32 running", 100 * b["fraction_outside_forward"], "%")
    elif kind == "latency":
        for row in r["rows"]:
            add(
                f"{row['system']} decode @ prompt {row['prompt_len']}",
                row["decode_tokens_per_s"],
                "tok/s",
            )
        for name, value in r.get("ratios", {}).items():
            if name.startswith("decode"):
                add(name, value, "x")
    elif kind == "lifecycle":
        for op, seconds in r["seconds"].items():
            add(f"{op} ({r['workload']['num_running']} running)", seconds, "s")
        d = r["drift"]
        add(
            f"RSS drift over {d['cycles']} sleep({d['level']})/wakeup cycles",
            d["rss_drift_bytes"] / _MIB,
            "MiB",
        )
    elif kind == "startup":
        add("first token of `generate`, warm (median)", r["summary"]["first_byte_median_s"], "s")
    return rows


def summarize_dir(out_dir: str | Path) -> str:
    """The combined table of every ``<bench>.json`` in ``out_dir`` (parity first)."""
    order = ["parity", "throughput", "batch32", "latency", "lifecycle", "startup"]
    rows: list[dict[str, Any]] = []
    machine = ""
    for kind in order:
        path = Path(out_dir) / f"{kind}.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        m = result.get("machine", {})
        machine = machine or (
            f"{m.get('gpu') or m.get('cpu')}, ISA {m.get('isa', 'unknown')}, "
            f"torch {m.get('torch')}, {m.get('date')}"
        )
        rows.extend(_rows(kind, result))
    if not rows:
        return f"no bench results in {out_dir}"
    head = f"tgengine check on {machine}\n" if machine else ""
    return head + table(
        rows, [("bench", "bench"), ("figure", "figure"), ("value", "value"), ("unit", "unit")]
    )
