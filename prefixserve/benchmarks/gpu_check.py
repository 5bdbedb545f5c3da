"""The GPU figures of issue 52, each from one run on one device (scripts/device_check.sh runs them all):

    python -m prefixserve.benchmarks.gpu_check {peak,decode,prefill,long-doc-qa,throughput} --out DIR

- peak: the bf16 matmul peak of this GPU (torch.mm, n = 8192), the bound prefill is judged against.
- decode: median decode step times at batch 1, 16 sequences over a 1,024-token shared prefix and 64
  sequences (graphs on, and eager for comparison).
- prefill: one 8,192-token prompt's tokens/s and its FLOP/s as a share of the peak measured in this run.
- long-doc-qa: the benchmark workload (16 questions over one 1,024-token document) on the engine against
  HF transformers on the same GPU without reuse (each request generated on its own), greedy tokens compared.
- throughput: nano-vllm's benchmark shape: 256 requests, input and output lengths uniform in 100-1024,
  ignore_eos, output tokens/s.
Each writes DIR/<name>.json. Model: random:qwen3-0.6b in bfloat16 unless --model says otherwise.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from prefixserve import LLM, SamplingParams
from prefixserve.benchmarks.workloads import long_doc_qa

MODEL = "random:qwen3-0.6b"


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak(args: argparse.Namespace) -> dict:
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        _sync()
        times.append(time.perf_counter() - start)
    return {"bf16_mm_tflops": 2 * n ** 3 / min(times) / 1e12, "n": n}


def _llm(args: argparse.Namespace, **overrides) -> LLM:
    options = dict(device=DEVICE, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
                   num_kv_blocks=args.kv_blocks, max_model_len=4096)
    options.update(overrides)
    return LLM(args.model, **options)


def _decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> list[float]:
    """Step times (s) of decode-only steps once every prompt is prefilled."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    for _ in range(4):   # prefill and the first decodes (graphs warm)
        engine.step()
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        engine.step()
        _sync()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def decode(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    shared = [rng.randrange(10, 8000) for _ in range(1024)]
    cases = {
        "batch1": [[rng.randrange(10, 8000) for _ in range(128)]],
        "16_shared_1024": [shared + [rng.randrange(10, 8000) for _ in range(32)] for _ in range(16)],
        "64": [[rng.randrange(10, 8000) for _ in range(256)] for _ in range(64)],
    }
    result = {}
    for eager in (False, True):
        llm = _llm(args, enforce_eager=eager)
        if not eager:
            # the shared prefix computed once, as in the target (a cached document)
            llm.generate({"prompt_token_ids": shared + [5]}, SamplingParams(max_tokens=1))
        for name, prompts in cases.items():
            times = _decode_steps(llm, prompts, 48)
            result[f"{name}{'_eager' if eager else ''}_ms"] = 1000 * statistics.median(times)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return result


def prefill(args: argparse.Namespace) -> dict:
    tokens = args.prefill_tokens
    llm = _llm(args, max_model_len=tokens + 8, max_num_batched_tokens=tokens)
    config = llm.engine.model_config
    rng = random.Random(1)
    times = []
    for trial in range(3):
        prompt = [rng.randrange(10, 8000) for _ in range(tokens)]
        _sync()
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
        _sync()
        times.append(time.perf_counter() - start)
    seconds = min(times[1:])
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token_params = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                                 + 3 * hidden * config.intermediate_size)
    # GEMMs, plus causal attention (QK^T and PV over half the square), plus one LM-head row
    flops = 2 * per_token_params * tokens + 2 * layers * heads * head_dim * tokens * tokens + \
        2 * hidden * config.vocab_size
    measured_peak = peak(args)["bf16_mm_tflops"]
    achieved = flops / seconds / 1e12
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tflops": achieved,
            "bf16_mm_peak_tflops": measured_peak, "share_of_peak": achieved / measured_peak}


def long_doc(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from prefixserve.benchmarks.checkpoint import checkpoint_folder
    workload = long_doc_qa(quick=False)
    requests = workload.requests
    folder = checkpoint_folder(args.model, "bfloat16", 0)
    llm = LLM(str(folder), device=DEVICE, dtype="bfloat16", num_kv_blocks=args.kv_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=requests[0].max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))    # warm-up (compiles), then a fresh cache
    llm.reset_prefix_cache()
    _sync()
    start = time.perf_counter()
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    _sync()
    ours_s = time.perf_counter() - start
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()
    theirs = []
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]["prompt_token_ids"]], device=DEVICE), max_new_tokens=2,
                    do_sample=False)
        _sync()
        start = time.perf_counter()
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids], device=DEVICE)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_tokens,
                              min_new_tokens=r.max_tokens, do_sample=False)
            theirs.append(out[0, ids.shape[1]:].tolist())
        _sync()
    hf_s = time.perf_counter() - start
    equal = sum(a == b for a, b in zip(ours, theirs))
    return {"requests": len(requests), "prefixserve_s": ours_s, "hf_no_reuse_s": hf_s, "speedup": hf_s / ours_s,
            "greedy_equal": f"{equal}/{len(requests)}"}


def throughput(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    llm = _llm(args, max_model_len=2048)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(rng.randint(100, 1024))]}
               for _ in range(256)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(100, 1024), ignore_eos=True) for _ in prompts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "output_tokens": generated, "seconds": seconds,
            "output_tokens_per_s": generated / seconds}


CHECKS = {"peak": peak, "decode": decode, "prefill": prefill, "long-doc-qa": long_doc, "throughput": throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    # cpu: a smoke run of the checks' code on a small model (--model random:qwen3-tiny), no figures
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    # 36,000 blocks of 16 tokens: the throughput run's 256 x 2,048 tokens at most (66 GB in bfloat16)
    parser.add_argument("--kv-blocks", type=int, default=36000)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    result = CHECKS[args.check](args)
    result["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    (args.out / f"{args.check}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(args.check, json.dumps(result))


if __name__ == "__main__":
    main()
