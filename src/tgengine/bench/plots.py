"""The PNG chart of each bench result (``report.save`` draws it; matplotlib optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import step_split, threads, weights_report
from .tables import best_peer_ratios, isa_suffix

_MIB = 1024**2


def plot(result: dict[str, Any], path: Path) -> bool:
    """Draw the result's chart into ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kind = result["bench"]
    ratios = best_peer_ratios(result)
    text_in = 0.22  # inches per ratio line under the charts
    height = 4.5 + text_in * len(ratios)
    fig, axes = plt.subplots(1, 2, figsize=(12, height))
    if kind in ("throughput", "batch32"):
        rows = result["rows"]
        names = [r["system"] for r in rows]
        axes[0].barh(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
        axes[0].set_xlabel("output tokens/s")
        axes[0].invert_yaxis()
        at = range(len(rows))
        axes[1].barh(
            [i - 0.2 for i in at],
            [100 * r.get("fraction_of_compute_floor", 0) for r in rows],
            height=0.4,
            color="tab:orange",
            label="compute floor (measured GEMM rate)",
        )
        if any("fraction_of_roofline_floor" in r for r in rows):  # throughput
            axes[1].barh(
                [i + 0.2 for i in at],
                [100 * r.get("fraction_of_roofline_floor", 0) for r in rows],
                height=0.4,
                color="tab:green",
                label="roofline floor (and the measured memory rate)",
            )
        axes[1].set_yticks(list(at), names)
        axes[1].set_xlabel("% of the floor")
        axes[1].legend(loc="lower right", fontsize="small")
        axes[1].invert_yaxis()
    elif kind == "latency":
        rows = result["rows"]
        systems = sorted({r["system"] for r in rows})
        lens = sorted({r["prompt_len"] for r in rows})
        width = 0.8 / max(1, len(systems))
        for i, system in enumerate(systems):
            by_len = {r["prompt_len"]: r for r in rows if r["system"] == system}
            xs = [j + i * width for j in range(len(lens))]
            axes[0].bar(
                xs,
                [by_len.get(n, {}).get("decode_tokens_per_s", 0) for n in lens],
                width,
                label=system,
            )
            axes[1].bar(xs, [by_len.get(n, {}).get("ttft_s", 0) for n in lens], width, label=system)
        # The floor at the bench's own threads (a peer's row may be at others).
        own = [r for r in rows if "peer" not in r] or rows
        floors = {r["prompt_len"]: r["memory_floor_tokens_per_s"] for r in own}
        axes[0].plot(
            [j + 0.4 - width / 2 for j in range(len(lens))],
            [floors[n] for n in lens],
            "k_",
            markersize=30,
            label="memory floor",
        )
        for ax, label in (
            (axes[0], "decode tokens/s (batch 1)"),
            (axes[1], "time to first token (s)"),
        ):
            ax.set_xticks(
                [j + 0.4 - width / 2 for j in range(len(lens))], [f"prompt {n}" for n in lens]
            )
            ax.set_ylabel(label)
            ax.legend()
    elif kind == "parity":
        for dtype in dict.fromkeys(r["dtype"] for r in result["rows"]):
            rows = [r for r in result["rows"] if r["dtype"] == dtype]
            axes[0 if dtype == "float32" else 1].bar(
                [str(r["prompt_len"]) for r in rows],
                [100 * r["matched_prefix"] / max(1, r["num_tokens"]) for r in rows],
            )
            axes[0 if dtype == "float32" else 1].set_title(f"{dtype}: % of tokens equal")
    elif kind == "structured":
        rows = result["rows"]
        parts = ["forward_ms", "sample_ms", "grammar_fill_ms", "grammar_mask_ms"]
        names = [r["run"] for r in rows]
        for part in parts:
            axes[0].bar(names, [r[part] for r in rows], label=part)
        axes[0].set_ylabel("ms per decode step (not stacked)")
        axes[0].legend()
        compile_ms = result["compile_ms"]
        axes[1].barh(list(compile_ms), list(compile_ms.values()), color="tab:purple")
        axes[1].set_xlabel("ms")
        axes[1].invert_yaxis()
    elif kind == "lifecycle":
        ops = result["seconds"]
        axes[0].barh(list(ops), list(ops.values()), color="tab:green")
        axes[0].set_xlabel("seconds")
        axes[0].invert_yaxis()
        rss = [b / _MIB for b in result["drift"]["rss_per_cycle_bytes"]]
        axes[1].plot(range(len(rss)), rss, marker="o")
        axes[1].set_xlabel("sleep/wakeup cycle")
        axes[1].set_ylabel("process RSS (MiB)")
    elif kind == "memory":
        rows = result["rows"]
        names = [r["system"] for r in rows]
        for i, key in enumerate(("load_peak_rss_bytes", "steady_rss_bytes", "weights_bytes")):
            axes[0].barh(
                [j + 0.25 * i for j in range(len(rows))],
                [(r.get(key) or 0) / _MIB for r in rows],
                height=0.25,
                label=key.removesuffix("_bytes"),
            )
        axes[0].set_yticks(range(len(rows)), names)
        axes[0].set_xlabel("MiB")
        axes[0].legend()
        axes[1].barh(names, [r["decode_tokens_per_s"] for r in rows], color="tab:blue")
        axes[1].set_xlabel("batch-1 decode tokens/s")
    elif kind == "step":
        step_split.plot(result, axes)
    elif kind == "weights":
        weights_report.draw(axes, result)
    elif kind == "threads":
        threads.draw(axes, result)
    elif kind == "startup":
        runs = [str(r["run"]) for r in result["rows"]]
        axes[0].bar(runs, [r["first_byte_s"] for r in result["rows"]], color="tab:blue")
        axes[0].set_xlabel("run")
        axes[0].set_ylabel("seconds to the first token")
        axes[1].bar(runs, [r["exit_s"] for r in result["rows"]], color="tab:orange")
        axes[1].set_xlabel("run")
        axes[1].set_ylabel("seconds to exit")
    fig.suptitle(f"tgengine bench {kind}{isa_suffix(result)}")
    line_h = text_in / fig.get_figheight()  # a chart may have grown to fit its labels
    fig.tight_layout(rect=(0, line_h * len(ratios) + 0.01, 1, 1))
    for i, line in enumerate(ratios):
        fig.text(0.01, line_h * (len(ratios) - 1 - i) + 0.01, line, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
