"""Importing tgengine before torch makes OpenMP's threads sleep at barriers (``PASSIVE``),
unless the user chose a policy; the benches' peers get the user's environment back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tgengine import openmp_policy

SHOW = "import os, {first}; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy_after(first: str, env_policy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    code = SHOW.format(first=first)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize(
    ("first", "env_policy", "want"),
    [
        ("tgengine", None, "PASSIVE"),  # before torch: set
        ("tgengine", "active", "active"),  # the user's choice stays
        ("torch, tgengine", None, "None"),  # torch first: too late, left alone
    ],
)
def test_the_policy_is_set_only_where_it_still_matters(
    first: str, env_policy: str | None, want: str
) -> None:
    assert _policy_after(first, env_policy) == want


def test_peers_get_the_environment_without_tgengines_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as if not loaded yet
    monkeypatch.setattr(openmp_policy, "_set_here", False)
    assert openmp_policy.prefer_passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in openmp_policy.user_environ()
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's own: passed on
    assert not openmp_policy.prefer_passive_wait()
    assert openmp_policy.user_environ()["OMP_WAIT_POLICY"] == "active"
