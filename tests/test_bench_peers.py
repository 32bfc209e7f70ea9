"""``bench throughput`` / ``bench latency`` with peers, against fake vLLM and llama.cpp.

The fakes (tests/fake_peers) speak the same protocol as the real ones: a fake ``vllm``
package run by the real driver (``vllm_driver.py``) under a wrapper "python", and a fake
``llama-server`` that records its command line and answers ``/health`` and ``/completion``.
No timings are compared; the tests check what each peer was asked to do, what came back,
and that no peer process outlives a run.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tgengine.bench.peers import (
    PeerSpec,
    PeerSpecError,
    parse_peer,
    parse_threads,
    with_gguf,
)
from tgengine.bench.peers.llamacpp_peer import server_command
from tgengine.bench.peers.vllm_peer import cpu_binding, peer_env
from tgengine.cli.main import build_parser

FAKES = Path(__file__).parent / "fake_peers"
QUICK = ["--quick", "--dtype", "float32", "--device", "cpu", "--threads", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Fake peer executables, a GGUF placeholder, and the file the fakes record into."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_PEER_RECORD", str(record))
    python = _script(tmp_path / "vllm-python", f'PYTHONPATH={FAKES} exec {sys.executable} "$@"')
    server = _script(
        tmp_path / "llama-server", f'exec {sys.executable} {FAKES / "fake_llama_server.py"} "$@"'
    )
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return {"python": python, "server": server, "gguf": str(gguf), "record": record}


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _bench(command: str, model_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    args = build_parser().parse_args(
        ["bench", command, "--model", str(model_dir), "--out", str(out), *QUICK, *extra]
    )
    assert args.handler(args) == 0
    result: dict[str, Any] = json.loads((out / f"{command}.json").read_text())
    assert (out / f"{command}.png").stat().st_size > 0
    return result


# -- options ---------------------------------------------------------------------------


def test_peer_options_are_parsed() -> None:
    assert parse_peer("vllm=/venv/bin/python") == PeerSpec("vllm", "/venv/bin/python")
    assert parse_peer("llamacpp=/b/llama-server,/m.gguf") == PeerSpec(
        "llamacpp", "/b/llama-server", "/m.gguf"
    )
    peers = with_gguf([parse_peer("llamacpp=/s"), parse_peer("vllm=/p")], "/g.gguf")
    assert peers == [PeerSpec("llamacpp", "/s", "/g.gguf"), PeerSpec("vllm", "/p")]
    assert with_gguf([parse_peer("llamacpp=/s,/own.gguf")], "/g.gguf")[0].gguf == "/own.gguf"
    assert parse_threads("1,2") == (1, 2)
    assert parse_threads("default, 2,2") == ("default", 2)
    assert PeerSpec("vllm", "x").label(2) == "vllm t=2"
    assert PeerSpec("vllm", "x").label("default") == "vllm default"
    for bad in ("sglang=/x", "vllm", "vllm=", "=x"):
        with pytest.raises(PeerSpecError):
            parse_peer(bad)
    for bad in ("0", "x", "", "1,-2"):
        with pytest.raises(PeerSpecError):
            parse_threads(bad)


def test_peer_cli_options() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "latency", "--peer", "vllm=/p", "--peer", "llamacpp=/s", "--peer-gguf", "/g"]
    )
    assert args.peer == [PeerSpec("vllm", "/p"), PeerSpec("llamacpp", "/s")]
    assert args.peer_gguf == "/g" and args.peer_threads == (1, 2)
    assert parser.parse_args(["bench", "throughput", "--peer-threads", "2"]).peer_threads == (2,)
    for argv in (
        ["bench", "throughput", "--peer", "tgi=/x"],
        ["bench", "throughput", "--peer-threads", "0"],
        ["bench", "lifecycle", "--peer", "vllm=/p"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def test_missing_peer_files_are_refused(
    tiny_llama_dir: Path, tmp_path: Path, fakes: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(PeerSpecError, match="not an executable"):
        PeerSpec("vllm", str(tmp_path / "nope")).check()
    with pytest.raises(PeerSpecError, match="GGUF"):
        PeerSpec("llamacpp", fakes["server"]).check()
    with pytest.raises(PeerSpecError, match="does not exist"):
        PeerSpec("llamacpp", fakes["server"], str(tmp_path / "nope.gguf")).check()
    args = build_parser().parse_args(
        [
            *("bench", "throughput", "--model", str(tiny_llama_dir), *QUICK),
            *("--systems", "tgengine", "--peer", f"llamacpp={fakes['server']}"),
        ]
    )
    assert args.handler(args) == 1
    assert "needs a GGUF file" in capsys.readouterr().err


def test_each_peer_is_told_its_threads() -> None:
    first = sorted(os.sched_getaffinity(0))[0]
    assert cpu_binding(1) == str(first)
    assert cpu_binding("default") == "auto"
    env = peer_env(1)
    assert "PYTHONPATH" not in env and env["VLLM_HOST_IP"] == "127.0.0.1"
    job = {"mode": "throughput", "threads": 2, "max_model_len": 100, "requests": [{}] * 3}
    command = server_command(PeerSpec("llamacpp", "/s", "/g"), job, 8080)
    assert command[:3] == ["/s", "-m", "/g"]
    assert " ".join(command[3:]) == (
        "--host 127.0.0.1 --port 8080 -np 3 -c 300 --cont-batching -t 2 -tb 2"
    )
    latency = {**job, "mode": "latency", "threads": "default"}
    assert "-t" not in server_command(PeerSpec("llamacpp", "/s", "/g"), latency, 1)


# -- whole runs with the fakes --------------------------------------------------------


def test_throughput_with_peers(tiny_llama_dir: Path, tmp_path: Path, fakes: dict[str, Any]) -> None:
    before = _descendants()
    result = _bench(
        "throughput",
        tiny_llama_dir,
        tmp_path / "out",
        "--systems",
        "tgengine",
        "--tgengine-threads",
        "1,2",
        "--peer",
        f"vllm={fakes['python']}",
        "--peer",
        f"llamacpp={fakes['server']},{fakes['gguf']}",
        "--peer-logs",
        str(tmp_path / "logs"),
    )
    assert _descendants() == before
    assert torch.get_num_threads() == 1  # the bench's --threads again
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == [
        "tgengine t=1",
        "tgengine t=2",
        "vllm t=1",
        "vllm t=2",
        "llamacpp t=1",
        "llamacpp t=2",
    ]
    num_requests = result["workload"]["num_requests"]
    for row in rows.values():
        assert row["output_tokens"] == result["workload"]["output_tokens"], row["system"]
        assert row["tokens_per_s"] > 0 and row["fraction_of_compute_floor"] > 0
        assert all(rate > 0 for rate in row["matmul_flops_before_after"]), row["system"]
    ratios = result["ratios"]
    assert ratios["tgengine / vllm (best)"] > 0 and ratios["tgengine / llamacpp (best)"] > 0
    assert ratios["best vllm threads"] in (1, 2) and ratios["best tgengine threads"] in (1, 2)
    assert {"tgengine t=1", "tgengine t=2"} <= result["details"].keys()
    assert result["peers"]["vllm t=2"]["version"] == "0.0.fake"
    assert result["peers"]["llamacpp t=1"]["version"] == "b0-fake"
    assert (tmp_path / "out" / "throughput.txt").read_text().count("(best)") == 2

    records = _records(fakes["record"])
    llms = [r for r in records if "llm" in r]
    assert [r["bind"] for r in llms] == [cpu_binding(1), cpu_binding(2)]
    assert all(r["host_ip"] == "127.0.0.1" for r in llms)
    assert llms[0]["llm"]["dtype"] == "float32" and not llms[0]["llm"]["enable_prefix_caching"]
    assert llms[0]["llm"]["model"] == str(tiny_llama_dir)
    assert all(_gone(r["engine_core_pid"]) for r in llms)  # the driver's group was killed
    timed = [r["generate"] for r in records if len(r.get("generate", [])) == num_requests]
    assert len(timed) == 2  # every request in one generate call, once per thread count
    argvs = [r["argv"] for r in records if "argv" in r]
    assert [a[a.index("-t") + 1] for a in argvs] == ["1", "2"]
    assert all(a[a.index("-np") + 1] == str(num_requests) for a in argvs)
    assert max(r["max_in_flight"] for r in records if "max_in_flight" in r) == num_requests
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "llamacpp-throughput-t1.log",
        "llamacpp-throughput-t2.log",
        "vllm-throughput-t1.log",
        "vllm-throughput-t2.log",
    ]


def test_latency_with_peers(tiny_llama_dir: Path, tmp_path: Path, fakes: dict[str, Any]) -> None:
    before = _descendants()
    result = _bench(
        "latency",
        tiny_llama_dir,
        tmp_path,
        "--systems",
        "tgengine",
        "--peer",
        f"vllm={fakes['python']}",
        "--peer",
        f"llamacpp={fakes['server']}",
        "--peer-gguf",
        fakes["gguf"],
        "--peer-threads",
        "default",
    )
    assert _descendants() == before
    systems = {(r["system"], r["prompt_len"]) for r in result["rows"]}
    assert systems == {
        (s, n) for s in ("tgengine", "vllm default", "llamacpp default") for n in (4, 16, 64)
    }
    for row in result["rows"]:
        assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0, row
        assert row["fraction_of_memory_floor"] > 0
    for kind in ("vllm", "llamacpp"):
        assert result["ratios"][f"decode tgengine / {kind} (best) @ prompt 16"] > 0
        assert result["ratios"][f"TTFT {kind} (best) / tgengine @ prompt 64"] > 0
    records = _records(fakes["record"])
    assert [r["bind"] for r in records if "llm" in r] == ["auto"]
    (argv,) = [r["argv"] for r in records if "argv" in r]
    assert "-t" not in argv and argv[argv.index("-np") + 1] == "1"
    # Each single stream: a 1-token request, then the whole one, on the same prompt.
    completions = [r["completion"] for r in records if "completion" in r][2:]  # after warm-up
    assert completions[:2] == [[4, 1], [4, 6]]


def test_a_failing_peer_is_reported_and_the_bench_goes_on(
    tiny_llama_dir: Path,
    tmp_path: Path,
    fakes: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FAKE_PEER_FAIL", "1")
    before = _descendants()
    result = _bench(
        "throughput",
        tiny_llama_dir,
        tmp_path,
        "--systems",
        "tgengine",
        "--peer",
        f"llamacpp={fakes['server']},{fakes['gguf']}",
        "--peer-threads",
        "1",
    )
    assert _descendants() == before
    assert [r["system"] for r in result["rows"]] == ["tgengine"]
    error = result["peers"]["llamacpp t=1"]["error"]
    assert "status 3" in error and "failing on purpose" in error
    assert "peer llamacpp t=1: FAILED" in capsys.readouterr().out


# -- bench memory with the fake vLLM ----------------------------------------------------


def _memory_bench(
    model_dir: Path, tmp_path: Path, tokens: int, *extra: str
) -> tuple[int, dict[str, Any]]:
    """``bench memory --quick`` (its own tiny synthetic model) with tgengine only; ``--model``
    only picks the bench's setup."""
    out = tmp_path / "out"
    memory = ["bench", "memory", "--model", str(model_dir), "--model-dir", str(tmp_path / "m")]
    options = ["--systems", "tgengine", "--decode-tokens", str(tokens), "--out", str(out)]
    args = build_parser().parse_args([*memory, *QUICK, *options, *extra])
    code = args.handler(args)
    result = json.loads((out / "memory.json").read_text()) if code == 0 else {}
    return code, result


def test_memory_bench_runs_the_vllm_peer(
    tiny_llama_dir: Path, tmp_path: Path, fakes: dict[str, Any]
) -> None:
    from tgengine.bench.memory_probe import BATCH_SIZE, PROMPT

    before = _descendants()
    code, result = _memory_bench(
        tiny_llama_dir,
        tmp_path,
        3,
        "--peer",
        f"vllm={fakes['python']}",
        "--peer-logs",
        str(tmp_path / "logs"),
    )
    assert code == 0
    assert _descendants() == before
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["tgengine", "vllm t=1"]  # the peer at the bench's --threads
    tg, vllm = rows["tgengine"], rows["vllm t=1"]
    assert vllm["peer"] == "vllm" and vllm["threads"] == 1 and tg["threads"] == 1
    assert vllm["kv_cache_bytes"] == tg["kv_cache_bytes"] > 0
    # The driver and the fake's engine core, each a python with its imports: summed.
    assert vllm["processes"] >= 2
    assert vllm["steady_rss_bytes"] > 1.5 * vllm["python_rss_bytes"] > 0
    assert vllm["load_peak_rss_bytes"] >= vllm["loaded_rss_bytes"] > 0
    assert vllm["peak_rss_bytes"] >= vllm["load_peak_rss_bytes"]
    assert vllm["steady_pss_bytes"] > 0
    assert vllm["output_tokens"] == BATCH_SIZE * 3
    assert vllm["batch_tokens_per_s"] > 0 and vllm["decode_tokens_per_s"] > 0
    assert result["peers"]["vllm t=1"]["version"] == "0.0.fake"
    assert (tmp_path / "logs" / "vllm-memory-t1.log").is_file()

    records = _records(fakes["record"])
    llm = next(r for r in records if "llm" in r)
    assert llm["llm"]["kv_cache_memory_bytes"] == tg["kv_cache_bytes"]
    assert llm["llm"]["max_num_seqs"] == BATCH_SIZE
    assert llm["kvcache_space"] is None  # unset: vLLM would let it win over the job's size
    assert llm["bind"] == cpu_binding(1)
    assert _gone(llm["engine_core_pid"])
    generates = [r["generate"] for r in records if "generate" in r]
    # The same prompts and decode tokens as tgengine's rows: the batch, then the single
    # stream as a 1-token request and the whole one.
    assert generates[-3:] == [
        [[len(PROMPT) + 1, 3]] * BATCH_SIZE,
        [[len(PROMPT), 1]],
        [[len(PROMPT), 3]],
    ]
    text = (tmp_path / "out" / "memory.txt").read_text()
    assert "vllm t=1" in text and "sums over its 2 processes" in text


def test_memory_bench_takes_only_vllm_peers(
    tiny_llama_dir: Path, tmp_path: Path, fakes: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    before = _descendants()
    code, _ = _memory_bench(
        tiny_llama_dir, tmp_path, 3, "--peer", f"llamacpp={fakes['server']},{fakes['gguf']}"
    )
    assert code != 0 and _descendants() == before
    assert "only vllm peers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
