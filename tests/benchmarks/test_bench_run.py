"""A --quick benchmark run on random:qwen3-tiny: it finishes, every engine runs the same weights, and
prefix-cached outputs equal uncached ones (and transformers' greedy outputs)."""
from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from prefixserve import LLM, SamplingParams
from prefixserve.benchmarks.checkpoint import checkpoint_folder
from prefixserve.benchmarks.gguf_export import gguf_path_for
from prefixserve.benchmarks.report import to_json, to_markdown, write_plots
from prefixserve.benchmarks.runner import BenchConfig, machine_info, run_benchmark
from prefixserve.benchmarks.serving_memory import TARGET_NAME
from prefixserve.entrypoints.cli import main
from prefixserve.platforms.cpu.native.isa import cpu_probe


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("bench_cache")
    config = BenchConfig(model="random:qwen3-tiny", workloads=("long-doc-qa",),
                         engines=("prefixserve", "hf-padded", "hf-reuse"), quick=True, cache_dir=cache)
    return run_benchmark(config)


def _outputs(results, engine: str) -> dict[str, list[int]]:
    run = next(r for r in results.runs if r.engine == engine)
    return {r.request_id: r.output_token_ids for r in run.records}


def test_cached_outputs_equal_uncached_and_transformers(results) -> None:
    cached = _outputs(results, "prefixserve")
    assert len(cached) == len(results.workloads["long-doc-qa"].requests)
    assert all(len(ids) == 4 for ids in cached.values())
    for other in ("prefixserve-nocache", "prefixserve-warm", "hf-padded", "hf-reuse"):
        assert _outputs(results, other) == cached, other


def test_prefix_caching_computes_the_document_once(results) -> None:
    w = results.workloads["long-doc-qa"]
    runs = {r.engine: r for r in results.runs}
    assert runs["prefixserve"].computed_prompt_tokens == w.ideal_computed_tokens()
    assert runs["prefixserve-nocache"].computed_prompt_tokens == w.prompt_tokens
    assert runs["hf-reuse"].computed_prompt_tokens == w.ideal_computed_tokens()
    assert runs["prefixserve-warm"].computed_prompt_tokens < len(w.requests) * 40


CPUINFO = Path("/proc/cpuinfo")


def test_the_report_names_the_cpu_generation_and_its_bfloat16_features(results) -> None:
    """A VM may call its CPU only "AMD EPYC": family and model tell Zen 4 from Zen 5, and the bfloat16
    features (as /proc/cpuinfo lists them, where there is one) what the bfloat16 figures mean."""
    info = machine_info(2)
    if CPUINFO.is_file():
        first = CPUINFO.read_text().split("\n\n")[0]
        family = re.search(r"^cpu family\s*:\s*(\S+)", first, re.M)
        model = re.search(r"^model\s*:\s*(\S+)", first, re.M)
        flags = re.search(r"^flags\s*:(.*)$", first, re.M)[1].split()
        if family and model:
            assert info["cpu"].endswith(f"(family {family[1]}, model {model[1]})")
        assert ("no avx512_bf16" not in info["cpu_features"]) == ("avx512_bf16" in flags)
        if "amx_tile" not in flags:
            assert "no AMX" in info["cpu_features"]
        elif cpu_probe("_is_amx_tile_supported") and "amx_bf16" in flags:
            # the packed GEMM runs bfloat16 on the tiles wherever the CPU and the OS grant them
            assert "AMX, bfloat16 projections on its tiles" in info["cpu_features"]
    assert f"Machine: {results.machine['cpu']} ({results.machine['cpu_features']}), " in to_markdown(results)


def test_long_doc_qa_run_is_judged_at_limits_read_around_it(results) -> None:
    """The kept long-doc-qa run carries the readings taken around it and the report shows them; its TPOT is
    reported at those and at the run's best readings; the paired batched-decode steps are in the report."""
    run = next(r for r in results.runs if (r.engine, r.workload) == ("prefixserve", "long-doc-qa"))
    around = run.extra["limits_around"]
    assert around["matmul_flops"] > 0 and around["bandwidth_bytes"] > 0
    text = to_markdown(results)
    assert f"{around['bandwidth_bytes'] / 1e9:.1f} GB/s |" in text
    names = [t["name"] for t in to_json(results)["targets"]]
    assert sum(n.startswith("long-doc-qa: TPOT p50 vs the batched-decode bound") for n in names) == 2
    batched = results.roofline["batched_decode"]
    assert batched["steps"] == 6 and batched["sequences"] == 4 and batched["ratio"] > 0
    assert results.roofline["decode_b1"]["steps"] == 8       # the 9 quick tokens after the first, paired
    assert f"| {batched['ratio']:.2f}x |" in text


def test_report_renders_every_run(results, tmp_path: Path) -> None:
    text = to_markdown(results)
    for engine in ("prefixserve", "prefixserve-warm", "prefixserve-nocache", "hf-padded", "hf-reuse"):
        assert f"| {engine} |" in text
    assert "## Targets" in text and "llama.cpp" not in {t["name"] for t in to_json(results)["targets"]}
    doc = json.loads(json.dumps(to_json(results)))
    assert {f["engine"] for f in doc["figures"]} >= {"prefixserve", "hf-padded"}
    assert [p.name for p in write_plots(results, tmp_path)] == ["wall_time.png", "ttft_p50.png",
                                                              "computed_tokens.png"]


def test_report_has_the_serving_process_memory(results) -> None:
    memory = results.serving_memory
    assert memory.workload == "long-doc-qa" and memory.requests == len(results.workloads["long-doc-qa"].requests)
    on = next(r for r in results.runs if r.engine == "prefixserve")
    assert memory.kv_cache_bytes == on.extra["kv_cache_bytes"]     # the bench's own pool, in one server
    text = to_markdown(results)
    assert "## Serving process memory" in text and f"| peak / budget | {memory.ratio:.2f}x |" in text
    doc = json.loads(json.dumps(to_json(results)))
    assert doc["serving_memory"] == {**asdict(memory), "budget_bytes": memory.budget_bytes, "ratio": memory.ratio}
    target = next(t for t in doc["targets"] if t["name"] == TARGET_NAME)
    assert target["measured"] == memory.ratio and target["met"] is True


def test_exported_checkpoint_holds_the_random_models_weights(results) -> None:
    folder = checkpoint_folder("random:qwen3-tiny", "float32", 0, results.config.cache_dir)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    from_folder = LLM(str(folder), dtype="float32").generate(prompt, params)[0].outputs[0].token_ids
    from_preset = LLM("random:qwen3-tiny", dtype="float32").generate(prompt, params)[0].outputs[0].token_ids
    assert from_folder == from_preset


def exported(results, quant: str | None, *names: str):
    """The bench's GGUF export of the tiny checkpoint (float32, or `quant`): its reader, its tensors by
    name, the checkpoint's own tensors `names`, and how many tensors the checkpoint holds."""
    folder = checkpoint_folder("random:qwen3-tiny", "float32", 0, results.config.cache_dir)
    reader = gguf.GGUFReader(str(gguf_path_for(folder) if quant is None else gguf_path_for(folder, quant)))
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as st:
        return reader, {t.name: t for t in reader.tensors}, [st.get_tensor(n) for n in names], len(list(st.keys()))


def test_gguf_export_holds_every_tensor_unchanged(results) -> None:
    reader, tensors, checkpoint, count = exported(results, None, "model.embed_tokens.weight",
                                                  "model.layers.1.self_attn.q_proj.weight")
    embed, q = checkpoint
    assert len(tensors) == count
    assert np.array_equal(np.asarray(tensors["token_embd.weight"].data), embed.numpy())
    assert np.array_equal(np.asarray(tensors["blk.1.attn_q.weight"].data), q.numpy())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == embed.shape[0]
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert embed.dtype == torch.float32


def test_q8_0_export_quantizes_every_matrix_within_its_block_scale(results) -> None:
    """Q8_0 stores each block of 32 weights as int8 times the block's absmax / 127, that scale kept in
    float16: every dequantized weight is within half a step, plus up to 127 steps times the scale's
    rounding (2^-11 relative), of the original; norms stay exact."""
    reader, tensors, checkpoint, count = exported(results, "Q8_0", "model.layers.1.self_attn.q_proj.weight",
                                                  "model.layers.1.input_layernorm.weight")
    q, norm = checkpoint
    assert len(tensors) == count
    stored = tensors["blk.1.attn_q.weight"]
    assert stored.tensor_type == gguf.GGMLQuantizationType.Q8_0
    deq = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(q.shape).copy())
    step = q.view(q.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (deq.view_as(step.expand(-1, -1, 32)) - q.view(q.shape[0], -1, 32)).abs()
    assert bool((err <= step * (0.5 + 127 * 2 ** -11) + 1e-7).all())
    assert float(err.mean()) < float(step.mean()) / 3    # rounding to nearest: a quarter step on average
    assert np.array_equal(np.asarray(tensors["blk.1.attn_norm.weight"].data), norm.numpy())
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_cli_rejects_unknown_workload(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
