"""``python -m tgengine bench ...`` on the tiny model: every command runs and reports numbers.

Speed is for reports, not tests: nothing here compares timings or ratios.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tgengine.cli.main import build_parser
from tgengine.kernels.isa import isa

QUICK = ["--quick", "--dtype", "float32", "--device", "cpu", "--threads", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_bench(
    command: str, model_dir: Path, out: Path, *extra: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    args = build_parser().parse_args(
        ["bench", command, "--model", str(model_dir), "--out", str(out), *QUICK, *extra]
    )
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    # Every table, JSON and chart names the ISA its figures were measured on.
    title = f"== bench {command} ({isa()}) =="
    assert title in printed
    assert title in (out / f"{command}.txt").read_text()
    for suffix in ("json", "txt", "png"):
        assert (out / f"{command}.{suffix}").stat().st_size > 0
    result: dict[str, Any] = json.loads((out / f"{command}.json").read_text())
    assert result["bench"] == command
    assert {"setup", "machine"} <= result.keys()
    assert result["machine"]["torch"] == torch.__version__
    assert result["machine"]["isa"] == isa()
    return result


def assert_roofline(result: dict[str, Any]) -> None:
    machine, model = result["roofline"]["machine"], result["roofline"]["model"]
    assert machine["matmul_flops"] > 0 and machine["memory_bandwidth"] > 0
    assert model["flops_per_token"] > 0 and model["weight_bytes"] > 0
    assert model["kv_bytes_per_token"] > 0


def test_throughput(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench("throughput", tiny_llama_dir, tmp_path, capsys=capsys)
    assert_roofline(result)
    systems = [row["system"] for row in result["rows"]]
    assert systems == ["tgengine", "hf_generate bs=2", "hf_generate bs=4", "hf_generate_batch"]
    expected_tokens = result["workload"]["output_tokens"]
    for row in result["rows"]:
        assert row["output_tokens"] == expected_tokens, row["system"]
        for key in ("wall_s", "tokens_per_s", "requests_per_s", "fraction_of_compute_floor"):
            assert row[key] > 0, (row["system"], key)
        # The roofline floor: the longer of the compute floor and the bytes' floor.
        assert row["roofline_floor_s"] == max(row["compute_floor_s"], row["memory_floor_s"])
        assert row["fraction_of_roofline_floor"] >= row["fraction_of_compute_floor"]
    ratios = result["ratios"]
    assert ratios["tgengine / hf_generate (best batch size)"] > 0
    assert ratios["tgengine / hf_generate_batch"] > 0
    details = result["details"]["tgengine"]
    assert details["num_steps"] > 0 and 0 < details["forward_fraction_of_wall"] <= 1
    # tgengine's floor takes the GEMM rate measured just before and after its run.
    tg = result["rows"][0]
    before, after = tg["matmul_flops_before_after"]
    assert before > 0 and after > 0
    assert tg["compute_floor_matmul_flops"] == pytest.approx((before + after) / 2)
    machine = result["roofline"]["machine"]
    assert result["rows"][1]["compute_floor_matmul_flops"] == machine["matmul_flops"]
    assert "matmul_flops_before_after" not in result["rows"][1]
    printed = (tmp_path / "throughput.txt").read_text()
    assert f"{before / 1e9:.0f}/{after / 1e9:.0f}" in printed
    assert "of roofline floor" in printed
    args = build_parser().parse_args(["bench", "summary", str(tmp_path)])
    assert args.handler(args) == 0
    summary = capsys.readouterr().out
    assert "tgengine fraction of roofline floor" in summary


def test_a_peer_at_n_threads_is_compared_with_tgengine_at_n_threads() -> None:
    from tgengine.bench.throughput import _ratios

    def row(system: str, tokens_per_s: float, threads: int, peer: str | None) -> dict[str, Any]:
        found = {"system": system, "tokens_per_s": tokens_per_s, "threads": threads}
        return found if peer is None else found | {"peer": peer}

    rows = [
        row("tgengine t=1", 200.0, 1, None),
        row("tgengine t=2", 350.0, 2, None),
        row("vllm t=1", 160.0, 1, "vllm"),
        row("vllm t=2", 250.0, 2, "vllm"),
        row("llamacpp t=4", 100.0, 4, "llamacpp"),
    ]
    ratios = _ratios(rows)
    assert ratios["tgengine / vllm t=1"] == pytest.approx(200 / 160)  # not 350 / 160
    assert ratios["tgengine / vllm t=2"] == pytest.approx(350 / 250)
    assert ratios["tgengine (best) / llamacpp t=4"] == pytest.approx(350 / 100)
    assert ratios["tgengine / vllm (best)"] == pytest.approx(350 / 250)
    assert ratios["tgengine / llamacpp (best)"] == pytest.approx(350 / 100)


def test_latency(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench("latency", tiny_llama_dir, tmp_path, capsys=capsys)
    assert_roofline(result)
    rows = result["rows"]
    assert {(r["system"], r["prompt_len"]) for r in rows} == {
        (system, n) for system in ("tgengine", "hf_generate bs=1") for n in (4, 16, 64)
    }
    for row in rows:
        assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["memory_floor_tokens_per_s"] > 0 and row["fraction_of_memory_floor"] > 0
    concurrent = result["concurrent"]
    assert concurrent["num_streams"] == 3 and concurrent["tokens_per_s"] > 0
    assert concurrent["ttft_s"]["p50"] > 0 and concurrent["inter_token_s"]["p99"] > 0


def test_latency_on_mp_reports_the_control_plane(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--executor", "mp", "--tensor-parallel-size", "1", "--systems", "tgengine")
    result = run_bench("latency", tiny_llama_dir, tmp_path, *extra, capsys=capsys)
    assert result["setup"]["executor"] == "mp"
    control = result["control_plane"]
    assert control["uni_step_ms"] > 0 and control["mp_step_ms"] > 0
    assert control["round_trip_minus_worker_ms"] > 0 and control["budget_ms"] >= 1.0
    assert "control plane per step" in (tmp_path / "latency.txt").read_text()


def test_lifecycle(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench("lifecycle", tiny_llama_dir, tmp_path, "--cycles", "3", capsys=capsys)
    seconds = result["seconds"]
    assert set(seconds) == {
        "pause (keep)",
        "resume",
        "pause (abort)",
        "sleep(1)",
        "wakeup after sleep(1)",
        "sleep(2)",
        "wakeup after sleep(2)",
        "stop",
    }
    assert all(v >= 0 for v in seconds.values())
    memory = result["memory"]
    for level in (1, 2):
        before = next(iter(memory[f"before sleep({level})"]["memory_stats"].values()))
        during = next(iter(memory[f"during sleep({level})"]["memory_stats"].values()))
        assert before["weights_bytes"] > 0 and before["kv_cache_bytes"] > 0
        assert during["weights_bytes"] == 0 and during["kv_cache_bytes"] == 0
        assert memory[f"before sleep({level})"]["rss_bytes"] > 0
    drift = result["drift"]
    assert drift["cycles"] == 3 and len(drift["rss_per_cycle_bytes"]) == 4
    assert drift["rss_before_bytes"] > 0 and drift["rss_after_bytes"] > 0


def test_batch32(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench("batch32", tiny_llama_dir, tmp_path, capsys=capsys)
    assert_roofline(result)
    systems = [row["system"] for row in result["rows"]]
    assert systems == ["tgengine x1", "tgengine x4", "hf_generate bs=1", "hf_generate bs=4"]
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["output_tokens"] > 0
    breakdown = result["step_breakdown"]
    assert breakdown["num_steps"] > 0 and breakdown["num_decode_rows"] == 4
    assert breakdown["step_ms"] >= breakdown["forward_ms"] > 0
    assert 0 <= breakdown["fraction_outside_forward"] < 1


def test_bench_options_are_validated() -> None:
    parser = build_parser()
    for argv in (
        ["bench", "throughput", "--systems", "vllm"],
        ["bench", "throughput", "--batch-sizes", "8,x"],
        ["bench", "latency", "--threads", "0"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def test_parity_then_summary(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench("parity", tiny_llama_dir, tmp_path, capsys=capsys)
    assert result["summary"]["float32"]["exact"], result["rows"]
    assert {r["prompt_len"] for r in result["rows"]} == {3, 9, 20}
    args = build_parser().parse_args(["bench", "summary", str(tmp_path)])
    assert args.handler(args) == 0
    table = capsys.readouterr().out
    assert "greedy tokens equal transformers (float32)" in table


def test_structured(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench("structured", tiny_llama_dir, tmp_path, capsys=capsys)
    free, constrained = result["rows"]
    assert free["num_steps"] > 0 and constrained["num_steps"] > 0
    assert free["grammar_fill_ms"] == free["grammar_mask_ms"] == 0.0
    assert constrained["grammar_fill_ms"] > 0 and constrained["grammar_mask_ms"] > 0
    assert result["constrained_finish_reasons"] == ["length"]  # the schema cannot end early
    assert {"tokenizer_preparation", "person_first", "order_cached"} <= result["compile_ms"].keys()


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-moe"), arch="qwen3_moe")


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_moe_model(
    command: str, tiny_moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench(command, tiny_moe_dir, tmp_path, capsys=capsys)
    assert_roofline(result)
    assert all(row["system"] for row in result["rows"])
    if command == "throughput":  # where the MoE forward's time went
        split = result["details"]["tgengine"]["moe_forward_split"]
        assert split.keys() == {"attention", "routing", "experts", "rest"}
        assert all(0 < share < 1 for share in split.values()), split
        assert sum(split.values()) == pytest.approx(1.0)


def test_a_workload_reads_the_weights_once_per_forward_and_each_tokens_context(
    tiny_llama_dir: Path,
) -> None:
    from tgengine.bench.roofline import MachineLimits, ModelCosts, compute_floor
    from tgengine.bench.workload import BenchRequest
    from tgengine.models import load_model_config

    costs = ModelCosts.of(load_model_config(tiny_llama_dir), torch.float32)
    w, kv = costs.weight_bytes, costs.kv_bytes_per_token
    # 4 forwards at the least (the longest output); the first request's 3 decode tokens read
    # contexts of 11, 12 and 13 tokens, the second's none (one token, from its prompt).
    requests = [BenchRequest([1] * 10, 4), BenchRequest([2] * 5, 1)]
    assert costs.workload_bytes(requests) == 4 * w + (11 + 12 + 13) * kv
    assert costs.workload_bytes([]) == 0
    # Memory-bound (a slow memory): the roofline floor is the bytes' floor, and reached at
    # twice that wall time by half.
    memory = 4 * w + 36 * kv
    limits = MachineLimits("cpu", "float32", 1, 1e15, float(memory), {}, {}, (1, 1, 1, "x"))
    found = compute_floor(costs, limits, requests, wall_s=2.0)
    assert found["memory_floor_s"] == pytest.approx(1.0)
    assert found["roofline_floor_s"] == pytest.approx(1.0)
    assert found["fraction_of_roofline_floor"] == pytest.approx(0.5)
    assert found["fraction_of_compute_floor"] < 0.01
    # Compute-bound (a slow GEMM): the compute floor.
    slow = MachineLimits("cpu", "float32", 1, 1.0, 1e15, {}, {}, (1, 1, 1, "x"))
    found = compute_floor(costs, slow, requests, wall_s=2.0)
    assert found["roofline_floor_s"] == found["compute_floor_s"] > found["memory_floor_s"]


def test_moe_costs_count_the_chosen_experts(tiny_moe_dir: Path) -> None:
    from tgengine.bench.roofline import ModelCosts
    from tgengine.models import load_model_config

    config = load_model_config(tiny_moe_dir)
    costs = ModelCosts.of(config, torch.float32)
    assert config.moe is not None and config.moe.top_k < config.moe.num_experts
    stored = costs.num_params - costs.head_params
    assert costs.layer_matmul_params < stored  # 2 of 4 experts per token, not all


def test_startup_times_fresh_cli_processes(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from process_helpers import child_pids

    before = child_pids()
    result = run_bench("startup", tiny_llama_dir, tmp_path, capsys=capsys)
    assert child_pids() == before
    (row,) = result["rows"]  # quick: one timed run (after one that warms the caches)
    assert 0 < row["first_byte_s"] <= row["exit_s"]
    assert result["summary"]["first_byte_median_s"] == row["first_byte_s"]
    assert "--threads 1" in result["command"] and str(tiny_llama_dir) in result["command"]
    args = build_parser().parse_args(["bench", "summary", str(tmp_path)])
    assert args.handler(args) == 0
    assert "first token of `generate`" in capsys.readouterr().out


def test_a_failing_start_names_its_error(tmp_path: Path) -> None:
    from tgengine.bench.startup import time_one_start

    with pytest.raises(RuntimeError, match="failed \\(2\\)"):
        time_one_start([sys.executable, "-m", "tgengine", "generate", "--no-such-option"], 60)


def test_step_splits_each_kind_of_step_into_parts_that_sum_to_it(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_bench("step", tiny_llama_dir, tmp_path, capsys=capsys)
    workload = result["workload"]
    assert workload == {
        "num_seqs": 4,
        "prompt_len": "8-24",
        "max_tokens": 6,
        "seed": 0,
        "prepack_weights": True,
    }
    rows = {row["kind"]: row for row in result["rows"]}
    assert list(rows) == ["decode", "prefill"]
    # The 4 prompts fit one step; then 5 decode steps of all 4, the last one (no forward
    # after it to end its period) not counted.
    assert rows["prefill"]["num_steps"] == 1 and 4 * 8 <= rows["prefill"]["rows"] <= 4 * 24
    assert rows["decode"]["num_steps"] == workload["max_tokens"] - 2
    assert rows["decode"]["rows"] == 4
    for kind, row in rows.items():
        parts = [row[f"{part}_ms"] for part in ("products", "attention", "rest_of_model")]
        parts += [row["sampling_ms"], row["engine_ms"]]
        assert all(p > 0 for p in parts), (kind, parts)
        assert sum(parts) == pytest.approx(row["step_ms"]), kind
        assert sum(parts[:3]) == pytest.approx(row["forward_ms"]), kind
        assert row["floor_ms"] == pytest.approx(
            max(row["floor_products_ms"], row["floor_weights_ms"]) + row["floor_kv_ms"]
        )
        assert row["floor_kv_ms"] > 0 and row["step_over_floor"] > 0
    printed = (tmp_path / "step.txt").read_text()
    assert "rest of model" in printed and "step/floor" in printed


def test_weights(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_bench("weights", tiny_llama_dir, tmp_path, capsys=capsys)
    paths = [r["path"] for r in result["rows"]]
    assert paths[:2] == ["memcpy (the limit)", "memcpy into new memory"] and len(paths) == 15
    assert any(p.startswith("asleep (level 2)") for p in paths)
    # from another process: ProcessEngine (dir, parts, asleep), HTTP to either engine
    assert sum(p.startswith("ProcessEngine") for p in paths) == 3
    http = [r for r in result["rows"] if r["path"].startswith("HTTP from another process")]
    # to either engine: each part as the body, each part's path in /dev/shm, read before
    # the answer or held until the commit
    assert len(http) == 6 and all(r["sender_peak_rss_over_bytes"] is not None for r in http)
    assert sum("paths in /dev/shm" in r["path"] for r in http) == 2
    assert sum("paths held until the commit" in r["path"] for r in http) == 2
    assert all(r["relay_peak_rss_over_bytes"] is not None for r in http[3:])  # the server
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in result["rows"])
    assert all((r["peak_rss_over_bytes"] or 0) >= 0 for r in result["rows"])
    # the whole model, once (packed weights' placeholders add a few bytes to the resident)
    assert 0 < result["update_bytes"] <= result["weights_bytes"] <= result["update_bytes"] * 1.01
    # each way ran once (quick): dir, tensors, parts, and asleep (its update, no disk read)
    assert result["weight_version"] == 4
    assert "of memcpy" in (tmp_path / "weights.txt").read_text()


def test_threads_compares_the_default_count_with_fixed_ones_over_fresh_starts(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tgengine.bench.threads import summarize

    from process_helpers import child_pids

    before = child_pids()
    result = run_bench("threads", tiny_llama_dir, tmp_path, "--fixed", "1", capsys=capsys)
    assert child_pids() == before
    rows = result["rows"]
    # quick: 2 default starts and 1 at the fixed count, interleaved, each a fresh process
    assert [(r["mode"], r["start"]) for r in rows] == [("default", 1), ("fixed", 2), ("default", 3)]
    assert rows[1]["threads"] == 1
    assert all(r["threads"] >= 1 and r["out_tok_s"] > 0 and r["tokens"] > 0 for r in rows)
    assert len({r["tokens"] for r in rows}) == 1, "every start serves the same workload"
    # a default start keeps what its probe measured: each candidate count's GFLOP/s, and the
    # count it picked is the fastest of them (no probe where there is one core)
    from tgengine.agent.cpu_threads import available_cores

    for row in (r for r in rows if r["mode"] == "default"):
        probe = row["probe_gflops"]
        if available_cores() > 1:
            assert set(probe) == {str(n) for n in range(1, min(available_cores(), 8) + 1)}
            assert max(probe, key=lambda n: probe[n]) == str(row["threads"]), probe
        else:
            assert probe == {}
    assert "probe_gflops" not in rows[1]
    summary = result["summary"]
    assert summary["best_fixed"] == 1 and summary["default_counts"] == [
        rows[0]["threads"],
        rows[2]["threads"],
    ]
    # The comparison itself, on made-up rows: one default start 10 % under the best median.
    made = [
        {"mode": "fixed", "threads": 1, "out_tok_s": 100.0},
        {"mode": "fixed", "threads": 2, "out_tok_s": 200.0},
        {"mode": "fixed", "threads": 2, "out_tok_s": 220.0},
        {"mode": "default", "threads": 2, "out_tok_s": 210.0},
        {"mode": "default", "threads": 1, "out_tok_s": 189.0},
    ]
    s = summarize(made)
    assert s["best_fixed"] == 2 and s["fixed_medians"] == {1: 100.0, 2: 210.0}
    assert s["default_min_ratio"] == pytest.approx(0.9)
    assert s["default_starts_slower_than_bound"] == 1


def test_peak_rss_is_the_high_water_mark_since_start() -> None:
    """A peak that ends before anyone looks is still counted, and one from before ``start``
    is not: the mark is reset, not sampled."""
    import os

    from tgengine.bench.peak_rss import PeakRSS

    size = 64 * 1024 * 1024
    rss = PeakRSS({"me": os.getpid()})
    before = torch.ones(size, dtype=torch.uint8)  # touched: resident
    del before
    rss.start()
    if rss.needs_sampling:
        pytest.skip("the kernel keeps no resettable peak RSS for this process (not Linux?)")
    assert rss.peaks()["me"] < size // 2  # the earlier peak does not count
    during = torch.ones(size, dtype=torch.uint8)
    del during  # gone before the peak is read, with no sampler running
    assert rss.peaks()["me"] >= size * 0.9


@pytest.mark.anyio
async def test_peak_rss_samples_a_process_without_a_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the high-water mark cannot be reset, ``watching`` reads the RSS while its block
    runs (and the mark is not used)."""
    import os

    import anyio

    from tgengine.bench import peak_rss

    monkeypatch.setattr(peak_rss, "_reset_high_water_mark", lambda pid: False)
    sampled = anyio.Event()
    sample = peak_rss.PeakRSS.sample

    def counted(self: peak_rss.PeakRSS) -> None:
        sample(self)
        sampled.set()

    monkeypatch.setattr(peak_rss.PeakRSS, "sample", counted)
    rss = peak_rss.PeakRSS({"me": os.getpid()})
    with anyio.fail_after(10):
        async with rss.watching():
            assert rss.needs_sampling
            await sampled.wait()  # the sampler runs beside the block
    assert rss.peaks()["me"] >= 0


def test_the_weights_chart_fits_its_paths(tmp_path: Path) -> None:
    """``bench weights``' paths are long: the chart wraps them, labels its left half only,
    and grows to fit (matplotlib warned "Tight layout not applied" and cut them off)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import warnings

    from matplotlib.figure import Figure

    from tgengine.bench import plots

    paths = ["memcpy (the limit)", "update_weights(dir)", "weight_update() in 35 parts"]
    for where in ("the server's process", "an engine process"):
        for how in ("35 parts", "35 paths in /dev/shm"):
            paths.append(f"HTTP from another process, engine in {where}: {how}")
    paths += [f"ProcessEngine asleep (level 2): {n} parts + wakeup" for n in range(10, 16)]
    rows = [
        {"path": p, "gb_per_s": 1.0 + i, "peak_over_weights": 1.0 + i / 10}
        for i, p in enumerate(paths)
    ]
    result = {"bench": "weights", "machine": {"isa": "avx2"}, "rows": rows}
    saved: list[Figure] = []
    original = Figure.savefig

    def savefig(self: Figure, *args: Any, **kw: Any) -> None:
        saved.append(self)
        original(self, *args, **kw)

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error")  # "Tight layout not applied" fails the test
        patch.setattr(Figure, "savefig", savefig)
        assert plots.plot(result, tmp_path / "weights.png")
    (figure,) = saved
    left, right = figure.axes
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert [label.replace("\n", " ") for label in labels] == paths
    assert max(len(line) for label in labels for line in label.split("\n")) <= 34
    assert right.yaxis.get_tick_params()["labelleft"] is False
    assert figure.get_figheight() > 4.5  # the default height: grown for 13 wrapped paths
