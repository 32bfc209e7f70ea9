"""Printing, saving and plotting bench results (plain dicts from the bench modules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .control_plane import render as control_plane_lines

_GB = 1e9
_MIB = 1024**2


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


def roofline_lines(result: dict[str, Any]) -> list[str]:
    roof = result.get("roofline")
    if not roof:
        return []
    m, c = roof["machine"], roof["model"]
    return [
        f"roofline: {m['device']} {m['dtype']} x{m['threads']} threads: matmul "
        f"{m['matmul_flops'] / _GB:.0f} GFLOP/s, memory {m['memory_bandwidth'] / _GB:.1f} GB/s; "
        f"model {c['num_params'] / 1e6:.0f}M params, {c['flops_per_token'] / _GB:.3f} GFLOP/token "
        f"(+{c['attention_flops_per_key'] / 1e6:.2f} MFLOP per context token), "
        f"{c['weight_bytes'] / _MIB:.0f} MiB weights + {c['kv_bytes_per_token'] / 1024:.1f} KiB KV "
        "read per batch-1 token",
    ]


def peer_lines(result: dict[str, Any]) -> list[str]:
    """One line per peer run: its version and start-up time, or why it failed."""
    lines = []
    for label, info in result.get("peers", {}).items():
        if info.get("error"):
            first = str(info["error"]).splitlines()[0]
            lines.append(f"peer {label}: FAILED: {first}")
        else:
            lines.append(
                f"peer {label}: version {info.get('version')}, "
                f"started in {info.get('startup_s', 0.0):.1f} s (not timed)"
            )
    return lines


def best_peer_ratios(result: dict[str, Any]) -> list[str]:
    """The ratio lines that compare tgengine with each peer at its best thread count."""
    return [f"{k}: {v:.2f}" for k, v in result.get("ratios", {}).items() if "(best)" in k]


def render(result: dict[str, Any]) -> str:
    """The human-readable report of one bench result."""
    kind = result["bench"]
    lines = [f"== bench {kind} =="]
    machine = result.get("machine")
    if machine:
        where = machine.get("gpu") or f"{machine['cpu']} ({machine['cores']} cores)"
        lines.append(
            f"machine: {where}, torch {machine['torch']}, transformers "
            f"{machine['transformers']}, {machine['date']}"
        )
    setup = result.get("setup")
    if setup:
        quantized = (
            f", tgengine weights {setup['quantization']}" if setup.get("quantization") else ""
        )
        lines.append(
            f"setup: {setup['dtype']} on {setup['device']}, threads {setup['threads']}{quantized}"
        )
    workload = result.get("workload")
    if workload:
        lines.append("workload: " + ", ".join(f"{k}={v}" for k, v in workload.items()))
    lines.extend(roofline_lines(result))
    lines.extend(peer_lines(result))
    lines.append("")
    lines.append(_RENDERERS[kind](result))
    lines.extend(control_plane_lines(result))
    ratios = result.get("ratios")
    if ratios:
        lines.append("")
        lines.extend(f"{k}: {v:.2f}" for k, v in ratios.items())
    return "\n".join(lines)


def _floor_gemm(row: dict[str, Any]) -> str:
    """The GEMM rate a row's compute floor took: before/after its run, or the bench's."""
    around = row.get("matmul_flops_before_after")
    if around is not None:
        return "/".join(f"{rate / _GB:.0f}" for rate in around)
    rate = row.get("compute_floor_matmul_flops")
    return "" if rate is None else f"{rate / _GB:.0f}"


def _throughput(result: dict[str, Any]) -> str:
    out = table(
        [{**row, "floor_gemm": _floor_gemm(row)} for row in result["rows"]],
        [
            ("system", "system"),
            ("tokens_per_s", "out tok/s"),
            ("requests_per_s", "req/s"),
            ("total_tokens_per_s", "all tok/s"),
            ("wall_s", "wall s"),
            ("output_tokens", "out tokens"),
            ("fraction_of_compute_floor", "of compute floor"),
            ("floor_gemm", "GEMM GFLOP/s before/after"),
        ],
    )
    for name, tg in result.get("details", {}).items():
        if not name.startswith("tgengine"):
            continue
        fraction = tg["forward_fraction_of_wall"]
        forward = "n/a (in the workers)" if fraction is None else f"{100 * fraction:.0f}%"
        out += (
            f"\n{name}: {tg['num_steps']} steps, {tg['num_preemptions']} preemptions, "
            f"forward {forward} of wall, "
            f"TTFT p50 {tg['ttft_s']['p50']:.2f} s, "
            f"inter-token p50 {1e3 * tg['inter_token_s']['p50']:.0f} ms"
        )
        split = tg.get("moe_forward_split") or {}
        if split:
            shares = ", ".join(f"{part} {100 * share:.1f}%" for part, share in split.items())
            out += f"\n{name}: MoE forward time: {shares}"
    return out


def _batch32(result: dict[str, Any]) -> str:
    out = table(
        result["rows"],
        [
            ("system", "system"),
            ("tokens_per_s", "out tok/s"),
            ("decode_tokens_per_s", "decode tok/s"),
            ("wall_s", "wall s"),
            ("output_tokens", "out tokens"),
            ("fraction_of_compute_floor", "of compute floor"),
            ("fraction_of_memory_floor", "of memory floor"),
        ],
    )
    b = result.get("step_breakdown")
    if b and b.get("num_steps"):
        parts = ", ".join(
            f"{k.removesuffix('_ms')} {v:.1f}"
            for k, v in b.items()
            if k.endswith("_ms") and k not in ("step_ms", "forward_ms", "outside_forward_ms")
        )
        out += (
            f"\nstep at {b['num_decode_rows']} running ({b['num_steps']} steps): "
            f"{b['step_ms']:.1f} ms, "
            f"forward {b['forward_ms']:.1f} ms, outside forward {b['outside_forward_ms']:.1f} ms "
            f"= {100 * b['fraction_outside_forward']:.1f}% (ms per step inside: {parts})"
        )
    return out


def _latency(result: dict[str, Any]) -> str:
    out = table(
        result["rows"],
        [
            ("system", "system"),
            ("prompt_len", "prompt"),
            ("ttft_s", "TTFT s"),
            ("decode_tokens_per_s", "decode tok/s"),
            ("memory_floor_tokens_per_s", "floor tok/s"),
            ("fraction_of_memory_floor", "of memory floor"),
        ],
    )
    c = result.get("concurrent")
    if c:
        t, i = c["ttft_s"], c["inter_token_s"]
        out += (
            f"\n{c['num_streams']} concurrent streams ({c.get('system', 'tgengine')}): "
            f"{c['tokens_per_s']:.1f} tok/s; "
            "TTFT p50/p90/p99 "
            f"{t['p50']:.3f}/{t['p90']:.3f}/{t['p99']:.3f} s; inter-token p50/p90/p99 "
            f"{1e3 * i['p50']:.1f}/{1e3 * i['p90']:.1f}/{1e3 * i['p99']:.1f} ms"
        )
    return out


def _lifecycle(result: dict[str, Any]) -> str:
    rows = [{"operation": k, "seconds": v} for k, v in result["seconds"].items()]
    out = table(
        rows,
        [
            ("operation", f"operation ({result['workload']['num_running']} running)"),
            ("seconds", "seconds"),
        ],
    )
    mem_rows = []
    for when, m in result["memory"].items():
        stats: dict[str, Any] = next(iter(m["memory_stats"].values()), {})
        mem_rows.append(
            {
                "when": when,
                "rss": m["rss_bytes"] / _MIB,
                "weights": stats.get("weights_bytes", 0) / _MIB,
                "kv": stats.get("kv_cache_bytes", 0) / _MIB,
                "host": stats.get("host_weights_bytes", 0) / _MIB,
                "peak": stats.get("peak_rss_bytes", 0) / _MIB,
            }
        )
    out += "\n\n" + table(
        mem_rows,
        [
            ("when", "memory (MiB)"),
            ("rss", "process RSS"),
            ("weights", "weights"),
            ("kv", "KV cache"),
            ("host", "host weights"),
            ("peak", "peak RSS so far"),
        ],
    )
    d = result["drift"]
    out += (
        f"\n\nRSS over {d['cycles']} sleep({d['level']})/wakeup cycles: "
        f"{d['rss_before_bytes'] / _MIB:.0f} -> {d['rss_after_bytes'] / _MIB:.0f} MiB "
        f"(drift {d['rss_drift_bytes'] / _MIB:+.1f} MiB; after the first cycle "
        f"{d['rss_drift_after_first_cycle_bytes'] / _MIB:+.1f} MiB)"
    )
    return out


def _mib(value: int | None) -> float | str:
    return "-" if value is None else value / _MIB


def _memory(result: dict[str, Any]) -> str:
    rows = [
        {
            "system": r["system"],
            "threads": r.get("threads", ""),
            "base": r["base_rss_bytes"] / _MIB,
            "load_peak": r["load_peak_rss_bytes"] / _MIB,
            "steady": r["steady_rss_bytes"] / _MIB,
            "weights": _mib(r.get("weights_bytes")),
            "kv": r["kv_cache_bytes"] / _MIB,
            "load_s": r["load_s"],
            "batch": r["batch_tokens_per_s"],
            "decode": r["decode_tokens_per_s"],
        }
        for r in result["rows"]
    ]
    out = table(
        rows,
        [
            ("system", "system (MiB)"),
            ("threads", "threads"),
            ("base", "RSS after imports"),
            ("load_peak", "peak RSS loading"),
            ("steady", "steady RSS"),
            ("weights", "weights"),
            ("kv", "KV cache"),
            ("load_s", "load s"),
            ("batch", "batch-8 tok/s"),
            ("decode", "batch-1 tok/s"),
        ],
    )
    s = result["summary"]
    out += f"\n\ncheckpoint: {s['checkpoint_bytes'] / _MIB:.0f} MiB"
    if "peak_over_steady" in s:
        out += (
            f"; tgengine steady RSS - (weights + KV cache) = "
            f"{s['steady_over_weights_and_kv_bytes'] / _MIB:.0f} MiB (the KV cache at its "
            "full size; on CPU only the blocks sequences wrote are resident); "
            f"peak / steady = {s['peak_over_steady']:.3f}"
        )
    for r in result["rows"]:
        if r.get("peer"):
            out += (
                f"\n{r['system']}: sums over its {r['processes']} processes (RSS counts shared "
                f"pages once per process; PSS splits them): PSS peak loading "
                f"{r['load_peak_pss_bytes'] / _MIB:.0f} MiB, steady "
                f"{r['steady_pss_bytes'] / _MIB:.0f} MiB; load s = its start-up, compile "
                "included; weights not reported"
            )
    return out


def _parity(result: dict[str, Any]) -> str:
    out = table(
        result["rows"],
        [
            ("dtype", "dtype"),
            ("prompt_len", "prompt"),
            ("num_tokens", "tokens"),
            ("matched_prefix", "equal prefix"),
            ("first_mismatch", "first mismatch"),
        ],
    )
    for dtype, s in result["summary"].items():
        verdict = "exact" if s["exact"] else f"{100 * s['matched_prefix_fraction']:.1f}% equal"
        out += f"\n{dtype}: {verdict}"
    return out


def _structured(result: dict[str, Any]) -> str:
    out = table(
        result["rows"],
        [
            ("run", "run"),
            ("num_steps", "steps"),
            ("step_ms", "step ms"),
            ("forward_ms", "forward ms"),
            ("sample_ms", "sample ms"),
            ("grammar_fill_ms", "fill masks ms"),
            ("grammar_mask_ms", "apply masks ms"),
        ],
    )
    compile_ms = ", ".join(f"{k} {v:.1f}" for k, v in result["compile_ms"].items())
    reasons = ", ".join(result["constrained_finish_reasons"])
    return f"{out}\ncompile ms: {compile_ms}\nconstrained requests ended with: {reasons}"


def _startup(result: dict[str, Any]) -> str:
    out = table(
        result["rows"], [("run", "run"), ("first_byte_s", "first token s"), ("exit_s", "exit s")]
    )
    s = result["summary"]
    return (
        f"{out}\ncommand: {result['command']}\nfirst token: min {s['first_byte_min_s']:.2f} s, "
        f"median {s['first_byte_median_s']:.2f} s, max {s['first_byte_max_s']:.2f} s"
    )


_RENDERERS = {
    "throughput": _throughput,
    "batch32": _batch32,
    "latency": _latency,
    "lifecycle": _lifecycle,
    "parity": _parity,
    "structured": _structured,
    "memory": _memory,
    "startup": _startup,
}


def save(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``<bench>.json``, ``<bench>.txt`` and (with matplotlib) ``<bench>.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kind = result["bench"]
    paths = [out / f"{kind}.json", out / f"{kind}.txt"]
    paths[0].write_text(json.dumps(result, indent=2, default=str) + "\n")
    paths[1].write_text(render(result) + "\n")
    png = out / f"{kind}.png"
    if plot(result, png):
        paths.append(png)
    return paths


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
        axes[1].barh(
            names, [100 * r.get("fraction_of_compute_floor", 0) for r in rows], color="tab:orange"
        )
        axes[1].set_xlabel("% of the compute floor (measured GEMM rate)")
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
    elif kind == "startup":
        runs = [str(r["run"]) for r in result["rows"]]
        axes[0].bar(runs, [r["first_byte_s"] for r in result["rows"]], color="tab:blue")
        axes[0].set_xlabel("run")
        axes[0].set_ylabel("seconds to the first token")
        axes[1].bar(runs, [r["exit_s"] for r in result["rows"]], color="tab:orange")
        axes[1].set_xlabel("run")
        axes[1].set_ylabel("seconds to exit")
    fig.suptitle(f"tgengine bench {kind}")
    line_h = text_in / height
    fig.tight_layout(rect=(0, line_h * len(ratios) + 0.01, 1, 1))
    for i, line in enumerate(ratios):
        fig.text(0.01, line_h * (len(ratios) - 1 - i) + 0.01, line, fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
