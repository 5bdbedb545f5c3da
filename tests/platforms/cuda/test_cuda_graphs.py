"""What only a GPU runs: decode steps replayed as CUDA graphs against the same engine run eagerly
(--enforce-eager), the Triton kernels in bfloat16 against the torch backend on the same GPU, the
batched sampler on the device against the per-row one, and a mem:// store under a GPU pool (pinned host
buffers, side-stream copies) giving back the blocks the pool evicted. Skipped without a CUDA device."""
from __future__ import annotations

import random

import pytest
import torch

from kv_store_helpers import BLOCK, PARAMS, POOL_BLOCKS, documents, full_blocks
from prefixserve import LLM, SamplingParams
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.torch_paged import TorchPagedAttention
from prefixserve.sampling_params import SamplingParams as Params
from prefixserve.worker.batched_sampler import BatchedSampler
from prefixserve.worker.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs, streams and bfloat16 Triton "
                                "kernels need a CUDA device")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 4000) for _ in range(40)]
    return [{"prompt_token_ids": shared + [rng.randrange(10, 4000) for _ in range(rng.randrange(1, 30))]}
            for _ in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_give_the_eager_tokens(dtype):
    from prefixserve.platforms.cuda.graphs import DecodeGraphs
    batch = prompts(11, seed=1)
    graphs = LLM("random:qwen3-tiny", device="cuda", dtype=dtype, max_num_seqs=16, num_kv_blocks=256)
    eager = LLM("random:qwen3-tiny", device="cuda", dtype=dtype, max_num_seqs=16, num_kv_blocks=256,
                enforce_eager=True)
    assert isinstance(graphs.engine.runner.decode_program, DecodeGraphs)
    assert eager.engine.runner.decode_program is None
    got = [o.outputs[0].token_ids for o in graphs.generate(batch, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(batch, GREEDY)]


def test_bfloat16_kernels_follow_the_torch_backend():
    from prefixserve.platforms.cuda.attention import TritonPagedAttention
    torch.manual_seed(0)
    block, blocks = 16, 64
    query_lens, seq_lens = [37, 1, 1, 1, 9], [37, 300, 301, 90, 140]
    order = torch.randperm(blocks).tolist()
    tables = []
    for length in seq_lens:
        tables.append([order.pop() for _ in range(-(-length // block))])
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block, "cuda")
    tokens = sum(query_lens)
    pool = torch.randn(2, blocks, block, 2, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, 2, 128, device="cuda", dtype=torch.bfloat16)
    reference = TorchPagedAttention(use_native=False, device="cuda")
    expected = reference.forward(q, k, v, pool.clone(), reference.build_metadata(meta), 128 ** -0.5)
    backend = TritonPagedAttention(device="cuda")
    got = backend.forward(q, k, v, pool, backend.build_metadata(meta), 128 ** -0.5)
    # bfloat16 rounding of P before P @ V: a few parts in a thousand of the outputs' scale
    assert (got.float() - expected.float()).abs().max().item() < 3e-2


def test_batched_sampler_on_the_device_matches_the_per_row_sampler_for_greedy_rows():
    torch.manual_seed(1)
    logits = torch.randn(32, 151936, device="cuda")
    rows = [SamplingRow(Params(temperature=0.0, presence_penalty=0.5, logprobs=2), [1, 2], [3, 3]) for _ in range(32)]
    expected = Sampler(device="cuda")(logits.clone(), rows)
    got = BatchedSampler(device="cuda")(logits, rows)
    assert got.token_ids == expected.token_ids
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_a_memory_store_under_a_gpu_pool_gives_back_what_the_pool_evicted(tiny_checkpoint):
    model = str(tiny_checkpoint("qwen3"))
    docs = documents()
    assert len(docs) * len(docs[0]) // BLOCK > 2 * POOL_BLOCKS   # the pool cannot hold them
    reference = LLM(model, dtype="float32", device="cuda", enable_prefix_caching=False, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": d} for d in docs], PARAMS)]
    llm = LLM(model, dtype="float32", device="cuda", num_kv_blocks=POOL_BLOCKS, kv_stores=["mem://?size=64MiB"])
    for round_ in range(2):
        outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
        assert [o.outputs[0].token_ids for o in outs] == want
        cached = [o.num_cached_tokens for o in outs]
        assert cached == ([0] * len(docs) if round_ == 0 else [full_blocks(d) for d in docs])
    llm.close()
