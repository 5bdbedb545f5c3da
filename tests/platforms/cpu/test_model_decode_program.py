"""The decode program (platforms/cpu/decode_program.py) against the model's module path, its oracle: every
decode-only step of a run gives the modules' final hidden states bit for bit, and where it does not
apply the runner has none or does not use it."""
from __future__ import annotations

import random

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.platforms.cpu.decode_program import DecodeProgram
from prefixserve.platforms.cpu.native import decode_loop, packed_gemm
from prefixserve.platforms.cpu.native.build import buildable, enabled
from prefixserve.platforms.cpu.native.isa import AVX2, best_isa

# where the CPU runs the packed kernel, a kernel that fails to load fails these tests instead of skipping them
RUNS_PACKED = enabled() and buildable() and best_isa() != AVX2
pytestmark = pytest.mark.skipif(not RUNS_PACKED, reason="the program runs packed projections: needs AVX-512, "
                                                        "a C compiler and the native kernels on")
# the packed kernel also runs on AVX-512 CPUs without avx512_bf16, with its float32 body only
PACKED = packed_gemm.runnable_dtypes() if RUNS_PACKED else ()
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(getattr(torch, dtype) not in PACKED,
                                                       reason=f"no packed {dtype} body on this CPU"))
          for dtype in ("bfloat16", "float32")]
# the other tests take the dtype the program serves on this CPU
DTYPE = "bfloat16" if torch.bfloat16 in PACKED else "float32"


def _llm(path, dtype: str = DTYPE, **kwargs) -> LLM:
    return LLM(str(path), dtype=dtype, block_size=16, num_kv_blocks=96, max_num_batched_tokens=96, **kwargs)


def _held_to_the_modules(llm: LLM) -> list[tuple[int, int, bool]]:
    """Has every run of the program also run the modules on the same step and compare; returns the list
    each compared step appends (tokens, shared runs, every sequence in a run) to."""
    runner = llm.engine.runner
    program, model = runner.decode_program, runner.model
    assert program is not None
    steps: list[tuple[int, int, bool]] = []
    run = program.run

    def compared(input_ids, positions, meta):
        got = run(input_ids, positions, meta)
        # the modules write the same K/V into the same slots, then must give the same hidden states
        want = model(input_ids, positions, runner.kv_caches, meta)
        assert torch.equal(got, want), f"step of {input_ids.numel()} tokens: {(got.float() - want.float()).abs().max()}"
        steps.append((input_ids.numel(), len(meta.decode.shared), meta.decode.runs_cover_all))
        return got

    program.run = compared
    return steps


def _prompts(seed: int, shared: int, suffixes: list[int], solo: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 8000) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(10, 8000) for _ in range(n)] for n in suffixes]
    return prompts + ([[rng.randrange(10, 8000) for _ in range(solo)]] if solo else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_every_decode_step_gives_the_module_path_bits(tiny_checkpoint, arch: str, dtype: str) -> None:
    """Sequences sharing a 70-token prefix (a shared run of whole softmax tiles in the native tables, some
    steps with every sequence in a run, others with a solo prompt beside them) and lone prompts; qwen2 adds
    q/k/v biases, qwen3 q/k norms, llama untied heads and scaled rope. In both dtypes the program runs
    (bfloat16 widens the queries and narrows the attention output between the kernels; float32 does not)."""
    llm = _llm(tiny_checkpoint(arch), dtype)
    steps = _held_to_the_modules(llm)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, 70, [3, 9, 20, 1], solo=30)], params)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(2, 140, [5, 12])], params)
    llm.generate([{"prompt_token_ids": [7] * 40}], params)
    # lone sequences, runs beside a sequence in none, runs covering every sequence
    assert {(1, 0, False), (5, 1, False), (2, 1, True)} <= set(steps)
    assert llm.stats().blocks_in_use == 0


def test_outputs_match_a_runner_without_the_program(tiny_checkpoint) -> None:
    """Tokens and log-probabilities, with prefix caching on, equal those of the same engine with the
    program taken away (mixed prefill and decode steps run the modules either way)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, 50, [4, 17, 33], solo=21)]
    results = []
    for keep in (True, False):
        llm = _llm(tiny_checkpoint("qwen3"))
        if not keep:
            llm.engine.runner.decode_program = None
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
    assert results[0] == results[1]


def test_not_built_where_it_does_not_apply(tiny_checkpoint, monkeypatch) -> None:
    """A projection left row-major, a backend other than the torch one, one without the native decode
    kernel and a process without the loop kernel keep the modules."""
    runner = _llm(tiny_checkpoint("qwen3")).engine.runner
    # one projection row-major, as a shape the kernel cannot take is left
    mlp = runner.model.layers[1].mlp
    packed = mlp.down_proj
    del mlp.down_proj
    mlp.down_proj = torch.nn.Parameter(packed.unpacked(), requires_grad=False)
    try:
        assert DecodeProgram.build(runner.model, runner.kv_caches, runner.kv_layout) is None
    finally:
        del mlp.down_proj
        mlp.down_proj = packed
    assert DecodeProgram.build(runner.model, runner.kv_caches, runner.kv_layout) is not None
    with monkeypatch.context() as patch:
        patch.setattr(decode_loop, "default_kernel", lambda: None)
        assert DecodeProgram.build(runner.model, runner.kv_caches, runner.kv_layout) is None
    # a backend deriving from the torch one may attend otherwise in its forward, which the program skips
    backend = runner.model.attention_backend
    with monkeypatch.context() as patch:
        patch.setattr(backend, "__class__", type("Derived", (type(backend),), {}))
        assert DecodeProgram.build(runner.model, runner.kv_caches, runner.kv_layout) is None
    monkeypatch.setattr(runner.model.attention_backend, "_decode_kernel", None)
    assert DecodeProgram.build(runner.model, runner.kv_caches, runner.kv_layout) is None
    # pools of different shapes cannot share one set of checked arguments
    caches = list(runner.kv_caches)
    caches[1] = caches[1][:, :-1].contiguous()
    assert DecodeProgram.build(runner.model, caches, runner.kv_layout) is None


def test_applies_only_to_decode_only_steps_and_rejects_other_input(tiny_checkpoint) -> None:
    llm = _llm(tiny_checkpoint("qwen3"))
    runner = llm.engine.runner
    program = runner.decode_program
    seen = []
    execute_model = runner.model.forward

    def forward(input_ids, positions, kv_caches, meta):
        # the runner runs the modules only for steps the program does not apply to
        seen.append(program.applies(meta, input_ids.numel()))
        with pytest.raises(ValueError):
            program.run(input_ids, positions, meta)
        return execute_model(input_ids, positions, kv_caches, meta)

    runner.model.forward = forward
    llm.generate([{"prompt_token_ids": p} for p in _prompts(4, 20, [5, 6])],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert seen and not any(seen)
