"""What padding projection rows to `linear.onednn_rows` costs: unpadded (every row count its own oneDNN
primitive, as before) against padded, interleaved round by round in one process, best of the rounds.

    python scripts/onednn_padding_ab.py [--rounds 5] [--big random:qwen3-0.6b] [--tiny random:qwen3-tiny]

Prints, per case, the best time of each and the ratio padded / unpadded (below 1: padded is faster):
  prefill of one sequence (the big model's products are too large to be padded; the tiny model's
  are padded: 300 -> 320, 520 -> 576, 1000 -> 1024 rows),
  decode steps on the tiny model (1 sequence: the small-M kernel, untouched; 40 sequences: padded to 48),
  and an LLMEngine on the tiny model serving prompts of lengths it has not seen (primitive creation
  included, which is what the padding saves).
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import prefixserve.platforms.cpu.linear as linear_mod
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.loader import load_model
from prefixserve.sampling_params import SamplingParams

BLOCK = 16
PADDED = linear_mod.onednn_rows


def set_padding(on: bool) -> None:
    linear_mod.onednn_rows = PADDED if on else (lambda m, k=1, n=1: m)


class Forward:
    """One forward of `seqs` sequences of `query_len` new tokens over `context` tokens each."""

    def __init__(self, loaded, seqs: int, query_len: int, context: int) -> None:
        self.lm, config = loaded.model, loaded.config
        blocks_per_seq = -(-context // BLOCK)
        self.caches = [torch.zeros(kv_cache_shape(config, seqs * blocks_per_seq, BLOCK))
                       for _ in range(config.num_hidden_layers)]
        tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(seqs)]
        self.meta = AttentionMetadata.build([query_len] * seqs, [context] * seqs, tables, BLOCK)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 4096, (seqs * query_len,), generator=gen)
        self.positions = torch.arange(context - query_len, context).repeat(seqs)

    @torch.inference_mode()
    def __call__(self) -> None:
        hidden = self.lm(self.ids, self.positions, self.caches, self.meta)
        self.lm.compute_logits(hidden[-1:])


def engine_run(engine: LLMEngine, lengths: list[int], tag: str) -> None:
    rng = random.Random(tag)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for i, length in enumerate(lengths):
        engine.add_request(f"{tag}-{i}", [rng.randrange(10, 4000) for _ in range(length)], params)
        while engine.has_unfinished_requests():
            engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--big", default="random:qwen3-0.6b")
    parser.add_argument("--tiny", default="random:qwen3-tiny")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    big, tiny = load_model(args.big), load_model(args.tiny)
    cases = {f"prefill {n} tokens, {args.big}": Forward(big, 1, n, n) for n in (512, 520, 1000)}
    cases.update({f"prefill {n} tokens, {args.tiny}": Forward(tiny, 1, n, n) for n in (300, 520, 1000)})
    cases[f"decode step, 1 sequence, {args.tiny}"] = Forward(tiny, 1, 1, 300)
    cases[f"decode step, 40 sequences, {args.tiny}"] = Forward(tiny, 40, 1, 300)

    engine = LLMEngine(EngineConfig(model=args.tiny, enable_prefix_caching=False))
    engine_lengths = list(range(33, 1033))
    random.Random(0).shuffle(engine_lengths)
    per_round = len(engine_lengths) // (2 * (args.rounds + 1))
    engine_name = f"engine, {per_round} prompts of unseen lengths 33-1032, {args.tiny}"

    def timed(fn, repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    # modes alternate within each case, first one then the other, so both see the same moments of a
    # shared machine; the first round of each case warms the primitives its fixed shapes need
    best: dict[tuple[str, bool], float] = {}
    for name, fn in cases.items():
        prefill = name.startswith("prefill") and args.big in name
        for r in range(args.rounds + 1):
            for padded in ((False, True) if r % 2 else (True, False)):
                set_padding(padded)
                elapsed = timed(fn, 1 if prefill else 200)
                if r:
                    best[name, padded] = min(elapsed, best.get((name, padded), float("inf")))
    for r in range(args.rounds + 1):
        for padded in ((False, True) if r % 2 else (True, False)):
            set_padding(padded)
            chunk = engine_lengths[:per_round]
            del engine_lengths[:per_round]
            elapsed = timed(lambda: engine_run(engine, chunk, f"{r}-{padded}"), 1)
            if r:
                best[engine_name, padded] = min(elapsed, best.get((engine_name, padded), float("inf")))
    set_padding(True)

    load = Path('/proc/loadavg').read_text().split()[:3]
    print(f"load average at the end: {load} (timings on a busy machine mean little)")
    print(f"{'case':<58} {'unpadded':>10} {'padded':>10} {'padded/unpadded':>16}")
    for name in [*cases, engine_name]:
        before, after = best[name, False], best[name, True]
        print(f"{name:<58} {before * 1e3:>8.2f}ms {after * 1e3:>8.2f}ms {after / before:>16.3f}")


if __name__ == "__main__":
    main()
