"""``kernels.isa``: the CPU's ISA label that every bench figure carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tgengine.bench import plots
from tgengine.kernels.isa import ISAS, cpu_flags, isa, isa_of, parse_flags

ZEN3 = "fpu vme sse sse2 avx fma f16c avx2 bmi2"
ZEN4 = ZEN3 + " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8 avx512_fp16"


@pytest.mark.parametrize(
    ("flags", "label"),
    [
        (ZEN3, "avx2"),
        (ZEN3 + " avx512f avx512bw", "avx512"),
        (ZEN4, "avx512_bf16"),
        (SAPPHIRE_RAPIDS, "amx"),
        ("fpu sse sse2 avx", None),
        ("avx2 fma", None),  # AVX2 without F16C: not what the avx2 kernels need
    ],
)
def test_the_label_is_the_best_isa_whose_flags_are_all_there(flags: str, label: str | None) -> None:
    cpuinfo = (
        f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t: avx2\n"
    )
    assert parse_flags(cpuinfo) == frozenset(flags.split()), "the first CPU's flags"
    assert isa_of(parse_flags(cpuinfo)) == label


def test_this_machine_has_one_label() -> None:
    label = isa()
    assert label in ISAS or label == torch.backends.cpu.get_cpu_capability().lower()
    if cpu_flags():
        assert label == isa_of(cpu_flags())


def test_the_chart_title_names_the_isa(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    titles: list[str] = []
    original = Figure.suptitle

    def suptitle(self: Figure, text: str, **kw: Any) -> Any:
        titles.append(text)
        return original(self, text, **kw)

    monkeypatch.setattr(Figure, "suptitle", suptitle)
    result = {"bench": "startup", "machine": {"isa": "avx512_bf16"}, "rows": []}
    result["rows"] = [{"run": 1, "first_byte_s": 1.0, "exit_s": 1.5}]
    assert plots.plot(result, tmp_path / "startup.png")
    assert titles == ["tgengine bench startup (avx512_bf16)"]
