"""An engine's load read from its `/metrics` text (vLLM's names and labels)."""

from __future__ import annotations

from narwhal.placement.load import EngineLoad, parse_load

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_waiting_by_reason{reason="x"} 99
process_start_time_seconds 1.7e9
"""


def test_queues_add_up_over_ranks_and_kv_usage_is_the_fullest() -> None:
    assert parse_load(VLLM, at=5.0) == EngineLoad(waiting=8, running=5, kv_usage=0.5, at=5.0)


def test_a_page_without_a_queue_is_no_load() -> None:
    assert parse_load(b"process_start_time_seconds 1.7e9\n", at=0.0) is None
    assert parse_load(b"", at=0.0) is None


def test_nan_and_out_of_range_values_are_not_believed() -> None:
    text = b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 1.7\n"
    load = parse_load(text + b"vllm:num_requests_waiting 2\n", at=0.0)
    assert load is not None
    assert (load.waiting, load.kv_usage) == (2, 1.0)


def test_a_load_goes_stale() -> None:
    load = EngineLoad(1, 1, 0.1, at=10.0)
    assert load.fresh(14.0, stale_s=5.0)
    assert not load.fresh(15.5, stale_s=5.0)


def test_the_cache_size_is_its_blocks_times_block_size_over_the_ranks() -> None:
    info = (
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",'
        b'enable_prefix_caching="True"} 1.0\n'
        b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="500"} 1.0\n'
    )
    load = parse_load(VLLM + info, at=0.0)
    assert load is not None and load.capacity_tokens == 1500 * 16
    assert parse_load(VLLM, at=0.0) == EngineLoad(8, 5, 0.5, 0.0, capacity_tokens=None)
    unprofiled = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    load = parse_load(VLLM + unprofiled, at=0.0)
    assert load is not None and load.capacity_tokens is None
