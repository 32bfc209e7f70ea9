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


def _release_in_a_fresh_process(release: bool) -> list[int]:
    """Threads of a fresh process: before a 2-thread product, after it, and after releasing
    (or not) the calling thread's OpenMP team."""
    code = f"""
import os, torch
from tgengine.runtime.openmp_policy import release_openmp_threads
count = lambda: len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
counts = [count()]
a = torch.randn(256, 256)
for _ in range(20):
    a @ a
counts.append(count())
assert release_openmp_threads() if {release} else True
counts.append(count())
print(*counts)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [int(n) for n in result.stdout.split()]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team")
def test_releasing_lets_the_calling_threads_openmp_team_go() -> None:
    before, during, after = _release_in_a_fresh_process(release=True)
    assert during > before, "the product started a team of OpenMP threads"
    assert after < during, "released"
    kept = _release_in_a_fresh_process(release=False)
    assert kept[2] == kept[1], "without the release the team stays"
