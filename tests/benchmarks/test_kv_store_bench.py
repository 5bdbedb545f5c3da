"""The working-set workload of `prefixserve bench`: its shape, and the store's effect on what
is computed (an invariant against the workload's brute-force ideal, not a timing)."""
from __future__ import annotations

from prefixserve.benchmarks.kv_store_bench import StoreBenchConfig, run_working_set, working_set_prompts


def test_the_working_set_needs_four_pools():
    prompts, pool_blocks, ideal = working_set_prompts(quick=True, seed=1)
    distinct_prefix_blocks = len({tuple(p[:256]) for p in prompts}) * 256 // 16
    assert distinct_prefix_blocks == 4 * pool_blocks
    assert ideal < sum(map(len, prompts)) / 2


def test_with_a_mem_store_the_working_set_computes_its_ideal():
    result = run_working_set(StoreBenchConfig(model="random:qwen3-tiny", quick=True))
    assert result["mem"]["computed"] <= 1.1 * result["ideal"]
    # Without a store the pool's LRU evicts every prefix before it comes back.
    assert result["no-store"]["computed"] == result["prompt_tokens"]
