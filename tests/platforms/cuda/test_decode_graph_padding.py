"""What the CUDA decode graphs do on the host, checked without a GPU: which captured size a step takes,
and that the rows padding a step up to it are harmless. A decode step of n sequences padded to its size
the graphs' way (every padded row repeating row 0) is run through the model, against the same step
unpadded as the oracle: the real rows' hidden states and the whole KV pool come out the same. The
capture and replay themselves need a GPU (test_cuda_graphs.py)."""
from __future__ import annotations

import random

import pytest
import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.loader import load_model
from prefixserve.platforms.cuda.graphs import LADDER, batch_ladder, bucket_for, padded_index

BLOCK = 8


def test_the_ladder_ends_at_the_engine_limit_and_every_step_finds_the_smallest_fit():
    for max_batch in (1, 3, 16, 64, 100, 256):
        ladder = batch_ladder(max_batch)
        assert ladder[-1] == max_batch and list(ladder) == sorted(set(ladder))
        assert set(ladder[:-1]) <= set(LADDER)
        for n in range(1, max_batch + 1):
            size = bucket_for(n, ladder)
            assert size is not None and size >= n
            assert all(b < n for b in ladder if b < size)
        assert bucket_for(max_batch + 1, ladder) is None
    with pytest.raises(ValueError):
        batch_ladder(0)


@pytest.mark.parametrize("n,size", [(3, 4), (5, 8), (1, 1)])
def test_padded_rows_change_no_real_row_and_no_block(n, size):
    loaded = load_model("random:qwen3-tiny", dtype=torch.float32)
    model, config = loaded.model, loaded.config
    rng = random.Random(n)
    blocks = list(range(1, 40))
    rng.shuffle(blocks)
    contexts = [rng.randrange(1, 30) for _ in range(n)]
    tables = [[blocks.pop() for _ in range(-(-(length + 1) // BLOCK))] for length in contexts]
    ids = torch.tensor([rng.randrange(10, 500) for _ in range(n)])
    pool = [torch.randn(kv_cache_shape(config, 40, BLOCK)) for _ in range(config.num_hidden_layers)]

    def step(rows: list[int], caches: list[torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata.build([1] * len(rows), [contexts[r] + 1 for r in rows], [tables[r] for r in rows],
                                       BLOCK)
        with torch.inference_mode():
            return model(ids[rows], torch.tensor([contexts[r] for r in rows]), caches, meta)

    unpadded_pool = [c.clone() for c in pool]
    expected = step(list(range(n)), unpadded_pool)
    source = padded_index(n, torch.arange(size)).tolist()
    assert source[:n] == list(range(n)) and set(source[n:]) <= {0}
    got = step(source, pool)
    assert torch.allclose(got[:n], expected, atol=1e-5)
    for a, b in zip(pool, unpadded_pool):
        assert torch.equal(a, b)
