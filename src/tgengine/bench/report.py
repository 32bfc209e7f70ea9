"""Printing, saving and plotting bench results (plain dicts from the bench modules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import step_split, threads, weights_report
from .control_plane import render as control_plane_lines
from .plots import plot
from .tables import isa_suffix, table

_GB = 1e9
_MIB = 1024**2


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


def render(result: dict[str, Any]) -> str:
    """The human-readable report of one bench result."""
    kind = result["bench"]
    machine = result.get("machine")
    lines = [f"== bench {kind}{isa_suffix(result)} =="]
    if machine:
        where = machine.get("gpu") or f"{machine['cpu']} ({machine['cores']} cores)"
        lines.append(
            f"machine: {where}, ISA {machine.get('isa', 'unknown')}, torch {machine['torch']}, "
            f"transformers {machine['transformers']}, {machine['date']}"
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
            ("fraction_of_roofline_floor", "of roofline floor"),
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
    "step": step_split.render,
    "throughput": _throughput,
    "batch32": _batch32,
    "latency": _latency,
    "lifecycle": _lifecycle,
    "parity": _parity,
    "structured": _structured,
    "memory": _memory,
    "startup": _startup,
    "weights": weights_report.render,
    "threads": threads.render,
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
