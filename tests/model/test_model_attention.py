"""The torch paged-attention backend against a brute-force, token-by-token reference.

The reference keeps each sequence's K/V in a plain dense list (no pool, no
blocks) and computes softmax(q k^T * scale) v one query token at a time.
"""
from __future__ import annotations

import math

import pytest
import torch

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata, attention_with_lse, \
    reference_attention_with_lse
from prefixserve.platforms.cpu.native.build import buildable

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
BLOCK_SIZE, NUM_BLOCKS = 4, 40
SCALE = 1 / math.sqrt(HEAD_DIM)


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int) -> torch.Tensor:
    """One query token [H, D] at `position` over a sequence's dense keys/values [L, KVH, D]."""
    group = HEADS // KV_HEADS
    out = torch.empty(HEADS, HEAD_DIM, dtype=torch.float64)
    for h in range(HEADS):
        k = keys[: position + 1, h // group].double()
        v = values[: position + 1, h // group].double()
        weights = torch.softmax((k @ q[h].double()) * SCALE, dim=0)
        out[h] = weights @ v
    return out


@pytest.fixture(params=["native", "torch"])
def backend(request) -> AttentionBackend:
    """The torch backend with prefill chunks and decode read straight from the pool by the C kernels,
    and without them (gather + SDPA)."""
    if request.param == "torch":
        return TorchPagedAttention(use_native=False)
    built = TorchPagedAttention(use_native=True)
    if built._decode_kernel is None or built._prefill_kernel is None:
        if buildable():
            pytest.fail("the paged attention kernels must build on a machine with AVX2 and a C compiler")
        pytest.skip("needs an x86 CPU with AVX2 and a C compiler")
    return built


def runs_kept(backend: AttentionBackend, runs: dict) -> dict:
    """The shared runs (members -> blocks) the backend's decode plan keeps: the native kernel carries a
    run's softmax state on only from the edge of one of its tiles, so runs are cut to whole tiles."""
    kernel = getattr(backend, "_decode_kernel", None)
    unit = math.lcm(BLOCK_SIZE, kernel.tile_keys) // BLOCK_SIZE if kernel is not None else 1
    cut = {members: blocks[: len(blocks) // unit * unit] for members, blocks in runs.items()}
    return {members: blocks for members, blocks in cut.items() if blocks}


class Scenario:
    """Sequences whose K/V live both in a paged pool (for the backend) and densely (for the reference)."""

    def __init__(self, seed: int, backend: AttentionBackend) -> None:
        self.backend = backend
        self.generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(NUM_BLOCKS, generator=self.generator).tolist()
        self.pool = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tables: dict[int, list[int]] = {}

    def fork(self, parent: int, child: int, blocks: int) -> None:
        """`child` starts as the first `blocks` full blocks of `parent`, sharing them physically."""
        keys, values = self.dense[parent]
        assert len(keys) >= blocks * BLOCK_SIZE
        self.dense[child] = (keys[: blocks * BLOCK_SIZE], values[: blocks * BLOCK_SIZE])
        self.tables[child] = self.tables[parent][:blocks]

    def run(self, plan: list[tuple[int, int]]) -> TorchPagedMetadata:
        """One backend call over (sequence, new tokens) pairs, checked against the reference."""
        total = sum(n for _, n in plan)
        # q/k/v as strided column views of one wider tensor, the way the model's fused qkv produces them
        q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        fused = torch.randn(total, q_size + 2 * kv_size + 3, generator=self.generator)
        q = fused[:, :q_size].view(total, HEADS, HEAD_DIM)
        k = fused[:, q_size: q_size + kv_size].view(total, KV_HEADS, HEAD_DIM)
        v = fused[:, q_size + kv_size: q_size + 2 * kv_size].view(total, KV_HEADS, HEAD_DIM)
        query_lens, seq_lens, tables = [], [], []
        start = 0
        for seq, count in plan:
            old_k, old_v = self.dense.get(seq, (torch.empty(0, KV_HEADS, HEAD_DIM),) * 2)
            new_k = torch.cat([old_k, k[start:start + count]])
            new_v = torch.cat([old_v, v[start:start + count]])
            self.dense[seq] = (new_k, new_v)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < len(new_k):
                table.append(self.free.pop())
            query_lens.append(count)
            seq_lens.append(len(new_k))
            tables.append(list(table))
            start += count
        meta = self.backend.build_metadata(AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE))
        out = self.backend.forward(q, k, v, self.pool, meta, SCALE)

        assert out.shape == q.shape and out.is_contiguous()
        start = 0
        for seq, count in plan:
            keys, values = self.dense[seq]
            first = len(keys) - count
            for i in range(count):
                expected = reference_attention(q[start + i], keys, values, first + i)
                torch.testing.assert_close(out[start + i].double(), expected, rtol=1e-5, atol=1e-5)
            # the pool holds every token's K/V at its slot
            table = self.tables[seq]
            for pos in range(len(keys)):
                block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                assert torch.equal(self.pool[0, block, offset], keys[pos])
                assert torch.equal(self.pool[1, block, offset], values[pos])
            start += count
        return meta


def test_fresh_prefills_and_decodes_match_reference(backend: AttentionBackend) -> None:
    scenario = Scenario(seed=0, backend=backend)
    scenario.run([(0, 9), (1, 1), (2, 4), (3, 13)])
    scenario.run([(3, 1), (0, 1), (2, 1), (1, 1)])


def test_chunks_over_cached_context_mixed_with_decodes_match_reference(backend: AttentionBackend) -> None:
    scenario = Scenario(seed=1, backend=backend)
    scenario.run([(0, 6), (1, 11), (2, 3)])
    # a chunk continuing a cached prefix, decodes of different lengths, a new prompt, and a
    # sequence that schedules no token this step; out of order
    scenario.run([(1, 1), (0, 7), (3, 5), (2, 1)])
    scenario.run([(2, 0), (0, 1), (1, 6), (3, 1)])
    # every token row decodes, but not every sequence has a row
    scenario.run([(0, 1), (2, 0), (3, 1), (1, 1)])


@pytest.mark.parametrize("seed", [2, 3])
def test_single_decode_matches_reference(seed: int, backend: AttentionBackend) -> None:
    scenario = Scenario(seed=seed, backend=backend)
    scenario.run([(0, 10)])
    scenario.run([(0, 1)])
    scenario.run([(0, 1)])


def test_decodes_sharing_leading_blocks_match_reference(backend: AttentionBackend) -> None:
    """Forked sequences decode together: shared runs are read once and merged with each suffix."""
    scenario = Scenario(seed=4, backend=backend)
    scenario.run([(0, 14), (1, 9)])
    scenario.fork(0, 2, blocks=3)   # shares 3 blocks with 0; its next token fills slot 12
    scenario.fork(0, 3, blocks=2)   # shares 2 with 0 and 2
    scenario.fork(1, 4, blocks=2)   # a second run, through sequence 1
    scenario.fork(0, 5, blocks=1)
    scenario.run([(2, 2), (3, 1), (4, 3)])
    meta = scenario.run([(1, 1), (0, 1), (2, 1), (3, 1), (4, 1), (5, 1)])
    runs = {tuple(r.members.tolist()): r.blocks.tolist() for r in meta.decode.shared}
    # rows: 1, 0, 2, 3, 4, 5 -> sequences 0, 2, 3, 5 share block 1 of seq 0; 1 and 4 share two blocks
    assert runs == runs_kept(backend, {(1, 2, 3, 5): scenario.tables[0][:1], (0, 4): scenario.tables[1][:2]})
    for _ in range(5):  # runs lengthen and shift as the sequences grow past block boundaries
        scenario.run([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)])


def test_decodes_with_a_chunk_and_shared_run_match_reference(backend: AttentionBackend) -> None:
    """Decode rows that are not the whole batch: gathered from and scattered back between prefill rows."""
    scenario = Scenario(seed=5, backend=backend)
    scenario.run([(0, 17)])
    scenario.fork(0, 1, blocks=4)
    scenario.fork(0, 2, blocks=4)
    scenario.run([(1, 1), (2, 3)])
    meta = scenario.run([(3, 6), (1, 1), (0, 5), (2, 1)])
    runs = {tuple(r.members.tolist()): r.blocks.tolist() for r in meta.decode.shared}
    assert runs == runs_kept(backend, {(0, 1): scenario.tables[0][:4]})


def test_attention_with_lse_kernel_matches_plain_matmuls() -> None:
    """The CPU flash kernel's (out, log-sum-exp) against the matmul path other devices take."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 2, 5, HEAD_DIM, generator=g)
    # strided k/v, as gathered from the pool
    k = torch.randn(3, 11, 2, HEAD_DIM, generator=g).transpose(1, 2)
    v = torch.randn(3, 11, 2, HEAD_DIM, generator=g).transpose(1, 2)
    bias = torch.zeros(3, 1, 1, 11)
    bias[0, ..., 7:] = float("-inf")
    out, lse = attention_with_lse(q, k, v, bias, SCALE)
    ref_out, ref_lse = reference_attention_with_lse(q, k, v, bias, SCALE)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    dense = torch.softmax((q @ k.transpose(-1, -2)) * SCALE + bias, dim=-1) @ v
    torch.testing.assert_close(ref_out, dense, rtol=1e-5, atol=1e-5)

