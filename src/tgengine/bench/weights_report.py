"""``bench weights``' table and chart (the runner is ``bench.weights``)."""

from __future__ import annotations

import textwrap
from typing import Any

from .tables import table

_MIB = 1024**2
_LABEL_CHARS = 34  # a path's label is wrapped to lines of this many characters
_LINE_IN = 0.25  # inches of chart height per line of the labels


def render(result: dict[str, Any]) -> str:
    rows = [{k: "" if v is None else v for k, v in row.items()} for row in result["rows"]]
    out = table(
        rows,
        [
            ("path", "path"),
            ("seconds", "seconds"),
            ("gb_per_s", "GB/s"),
            ("fraction_of_memcpy", "of memcpy"),
            ("peak_rss_over_bytes", "engine peak RSS over start (B)"),
            ("peak_over_weights", "peak / weights"),
            ("sender_peak_rss_over_bytes", "sender's (B)"),
            ("relay_peak_rss_over_bytes", "server's (B)"),
            ("shm_peak_bytes", "/dev/shm peak (B)"),
        ],
    )
    return (
        f"{out}\nupdate: {result['update_bytes'] / _MIB:.1f} MiB in {result['num_parts']} "
        f"parts of <= {result['part_bytes'] / _MIB:.0f} MiB; weights resident "
        f"{result['weights_bytes'] / _MIB:.1f} MiB"
    )


def draw(axes: Any, result: dict[str, Any]) -> None:
    """Each path's rate and peak, one bar each, the two charts side by side on the same rows:
    the paths' (long) names, wrapped, label the left one only, and the figure grows to fit
    them."""
    rows = result["rows"]
    names = [textwrap.fill(r["path"], _LABEL_CHARS) for r in rows]
    lines = sum(name.count("\n") + 1 for name in names)
    figure = axes[0].figure
    figure.set_size_inches(
        figure.get_figwidth(), max(figure.get_figheight(), 1.5 + lines * _LINE_IN)
    )
    axes[0].barh(names, [r["gb_per_s"] for r in rows], color="tab:blue")
    axes[0].set_xlabel("GB/s (update bytes / seconds)")
    axes[0].invert_yaxis()
    axes[0].tick_params(axis="y", labelsize=8)
    axes[1].barh(names, [r["peak_over_weights"] for r in rows], color="tab:red")
    axes[1].set_xlabel("peak RSS above the start, / resident weights")
    axes[1].invert_yaxis()
    axes[1].tick_params(axis="y", labelleft=False)
