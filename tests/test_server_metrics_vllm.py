"""``metrics_prefix="vllm"``: every metric vLLM's published Grafana dashboard queries exists."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from server_helpers import API_KEY, TIMEOUT, completion_body, running_server

pytestmark = pytest.mark.anyio

# The series that vLLM's dashboard (vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json at 004f771f) queries.
DASHBOARD = """
vllm:e2e_request_latency_seconds_bucket vllm:e2e_request_latency_seconds_sum
vllm:e2e_request_latency_seconds_count vllm:prompt_tokens_total vllm:generation_tokens_total
vllm:time_per_output_token_seconds_bucket vllm:time_per_output_token_seconds_sum
vllm:time_per_output_token_seconds_count vllm:num_requests_running vllm:num_requests_waiting
vllm:time_to_first_token_seconds_bucket vllm:time_to_first_token_seconds_sum
vllm:time_to_first_token_seconds_count vllm:gpu_cache_usage_perc
vllm:request_prompt_tokens_bucket vllm:request_generation_tokens_bucket
vllm:request_success_total vllm:request_queue_time_seconds_sum
vllm:request_prefill_time_seconds_sum vllm:request_decode_time_seconds_sum
vllm:request_max_num_generation_tokens_sum
""".split()
# The rest of vLLM's set for a text model (its V1 metrics), as issue 10 lists them.
OTHERS = """
vllm:iteration_tokens_total_bucket vllm:request_params_n_sum vllm:request_params_max_tokens_sum
vllm:request_inference_time_seconds_sum vllm:request_time_per_output_token_seconds_sum
vllm:prefix_cache_queries_total vllm:prefix_cache_hits_total vllm:cache_config_info
vllm:kv_cache_usage_perc vllm:num_preemptions_total vllm:inter_token_latency_seconds_sum
""".split()


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match is not None, series
    return float(match.group(1))


async def test_vllm_prefix_serves_every_dashboard_metric(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(
            tiny_llama_dir, api_key=API_KEY, metrics_prefix="vllm"
        ) as running:
            async with running.client(API_KEY) as client:
                body = completion_body(list(range(3, 30)), max_tokens=4, n=2, ignore_eos=True)
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            async with running.client() as anonymous:  # /metrics is open
                text = (await anonymous.get("/metrics")).text
    missing = [name for name in DASHBOARD + OTHERS if not re.search(rf"^{name}[{{ ]", text, re.M)]
    assert not missing
    assert "tgengine:" not in text
    assert value(text, "vllm:request_params_n_sum") == 2
    assert value(text, "vllm:request_generation_tokens_sum") == 8
    assert value(text, "vllm:request_max_num_generation_tokens_sum") == 4
    assert value(text, "vllm:prefix_cache_hits_total") == 24  # the 2nd sequence: 6 blocks of 4
    assert value(text, "vllm:prefix_cache_queries_total") == 2 * 27
    assert value(text, "vllm:iteration_tokens_total_sum") == 2 * (27 + 4)  # as vLLM counts
