"""Importing tgengine before torch shortens OpenMP's spin at barriers (``GOMP_SPINCOUNT``),
unless the user chose a policy; the benches' peers get the user's environment back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tgengine.runtime import openmp_policy

SHOW = "import os, {first}; print(os.environ.get('GOMP_SPINCOUNT'))"
VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _spin_after(first: str, **chosen: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env.update(chosen)
    code = SHOW.format(first=first)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize(
    ("first", "chosen", "want"),
    [
        ("tgengine", {}, openmp_policy.SPIN_COUNT),  # before torch: set
        ("tgengine", {"GOMP_SPINCOUNT": "5"}, "5"),  # the user's choice stays
        ("tgengine", {"OMP_WAIT_POLICY": "passive"}, "None"),  # a policy chosen: left alone
        ("torch, tgengine", {}, "None"),  # torch first: too late, left alone
    ],
)
def test_the_spin_is_shortened_only_where_it_still_matters(
    first: str, chosen: dict[str, str], want: str
) -> None:
    assert _spin_after(first, **chosen) == want


def test_peers_get_the_environment_without_tgengines_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as if not loaded yet
    monkeypatch.setattr(openmp_policy, "_set_here", False)
    assert openmp_policy.shorten_openmp_spin()
    assert os.environ["GOMP_SPINCOUNT"] == openmp_policy.SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in openmp_policy.user_environ()
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the user's own: passed on
    assert not openmp_policy.shorten_openmp_spin()
    assert openmp_policy.user_environ()["GOMP_SPINCOUNT"] == "7"
