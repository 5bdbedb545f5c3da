#!/usr/bin/env bash
# Regenerates docs/benchmarks.md (+ docs/benchmarks/<dtype>/*.png, docs/benchmarks/results-<dtype>.json) on this machine.
#   scripts/regen_benchmarks.sh            # full run, random:qwen3-0.6b in float32 then bfloat16, 2 threads
#   scripts/regen_benchmarks.sh --quick    # extra arguments go to `prefixserve bench`
# Run it on an otherwise idle machine: every figure is a timing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=docs/benchmarks
mkdir -p "$OUT"
start=$(date +%s)
"$PY" -m prefixserve.entrypoints.cli bench --model random:qwen3-0.6b --dtype float32 --dtype bfloat16 --threads 2 \
    --json "$OUT/results.json" --plot "$OUT" --markdown "$OUT/report.md" "$@"
"$PY" -m prefixserve.benchmarks.tenants_flood --repeats 3 --markdown "$OUT/tenants-flood.md"
minutes=$(( ($(date +%s) - start + 59) / 60 ))
{
  echo "# Benchmarks"
  echo
  echo "Regenerate with \`scripts/regen_benchmarks.sh\` (about ${minutes} min on this machine; \`--quick\` for a"
  echo "short run). What each workload, engine and column means: see the end of this page."
  echo
  cat "$OUT/report.md"
  echo
  for dir in "$OUT"/*/; do
    dtype=$(basename "$dir")
    echo "Charts, $dtype:"
    echo
    echo "![wall time, $dtype](benchmarks/$dtype/wall_time.png)"
    echo "![TTFT p50, $dtype](benchmarks/$dtype/ttft_p50.png)"
    echo "![prompt tokens computed, $dtype](benchmarks/$dtype/computed_tokens.png)"
    echo
  done
  echo
  echo "## Tenants under a flood (\`tenants-flood\`)"
  echo
  echo "\`prefixserve bench --workload tenants-flood\` (prefixserve/benchmarks/tenants_flood.py; docs/tenants.md)."
  echo
  cat "$OUT/tenants-flood.md"
  echo
  cat <<'METHOD'
## Method

- **Same weights everywhere.** `random:qwen3-0.6b` (the exact shape of Qwen3-0.6B, seeded random weights) is
  written once as a Hugging Face checkpoint folder (sharded safetensors, config.json, the project tokenizer);
  prefixserve and transformers load that folder, and `scripts/export_gguf.py` writes the same tensors, same
  dtype, to the GGUF file llama.cpp loads. Timings of a forward pass do not depend on weight values.
- **Prompts are token ids** from fixed seeds (`prefixserve/benchmarks/workloads.py`), so no tokenizer can make
  engines see different prompts. Every request generates exactly its `max_tokens` greedily (end-of-sequence is
  ignored by all engines), so all engines do the same work; the report counts how many outputs agree.
- **Engines.** `prefixserve`: the engine through its public `LLMEngine` API, every request of a round added at
  once, cache reset before the run (cold). `prefixserve-warm`: the same run again on the still-filled cache.
  `prefixserve-nocache`: prefix caching off. `hf-padded`: transformers `generate` over a left-padded batch per
  round, nothing reused. `hf-reuse`: the best reuse a careful transformers user can write: each shared prefix
  (system prompt, document, conversation so far) is prefilled once into a `DynamicCache`, deep-copied per
  request, only the request's suffix is prefilled, requests one at a time. `llama.cpp`: llama-cpp-python on the
  GGUF export, one request at a time, with its prompt cache on (the context's common-prefix reuse plus a
  `LlamaRAMCache` of saved states, the steps `create_completion` takes), KV in float32, weights in the
  benchmark's dtype (F32 or BF16 GGUF). `llama.cpp-q8_0`: the same on a Q8_0 export (matrices quantized,
  norms kept in float32, as llama.cpp's converter does), reported alongside with no target.
- **Dtypes.** The whole benchmark runs once per dtype, each against the limits measured in that dtype; the
  tables of each dtype follow each other on this page, then prefixserve's wall time per workload in both
  (bfloat16 against float32), with the target for CPUs with AMX (long-doc-qa in bfloat16 at least 3x faster
  than in float32), judged only where the CPU has AMX.
- **Rounds.** All requests of a round arrive at its start; TTFT and end-to-end latency count from there, so a
  one-at-a-time engine's queueing shows in its latencies. Multi-turn rounds are turns; each waits for the
  previous one.
- **Limits.** In the same process, before the engines: matmul FLOP/s in the benchmark dtype, the faster of
  `torch.mm` and the oneDNN linear the model uses (best of n =
  1024, 2048) and read bandwidth (sum over 1 GiB). Ideal prefill tokens/s = peak / FLOPs per token (2 x body
  parameters + attention + one LM-head row per prompt); ideal decode steps/s = bandwidth / bytes read per step
  (every weight once + the KV of every sequence). A workload's ideal time computes only tokens no earlier
  request computed, at the matmul peak, and decodes each round as one batch at the limit. On this machine both
  limits drift within minutes (bandwidth 39-77 GB/s in one run), so a ratio is set against limits read next to
  what it times: the single-request prefill against the best peak read before each of its rounds and after
  the last; long-doc-qa's fraction of its ideal time against the better of a reading just before and one just
  after prefixserve's kept run. Decode pairs steps with readings: each step (32 of one sequence; 24 of
  long-doc-qa's requests decoding together) is timed right after a quick reading of both limits (n = 1024
  product, sum over 256 MiB) and set against its bound at that reading, and the median of those ratios is
  judged. long-doc-qa's own TPOT p50 is reported against its bound
  at the readings around its run and at the best of the whole run; the workload tables' "% of ideal" uses
  those best readings for every engine.
- **Peak RSS** in the workload tables is the bench process's resident high-water mark during the run (reset
  through `/proc/self/clear_refs`); it includes the weights and, for prefixserve, its preallocated KV pool. For
  prefixserve's runs on the default pool that process holds both the cache-on and the cache-off engine (each its
  own weights and KV pool), so the figure is not one server's. The single-server figure is "Serving process
  memory": a `prefixserve serve` process started on the same checkpoint, dtype, threads and KV pool, sent
  long-doc-qa over HTTP (each round's requests at once), its VmHWM read from `/proc/<pid>/status` (whole life,
  loading included; the render process it spawns is not counted) and set against weights + KV pool + 1 GiB, both
  from its `/metrics`.
- **Repeats.** long-doc-qa and no-sharing run three back-to-back pairs of prefixserve with caching on and off;
  the tables show each engine's fastest run (and its limits read around it), and no-sharing's cost of caching
  is the median of the three paired ratios. The warm-TTFT row alternates its two kinds of request (the cached
  prefix with a new suffix, the suffix alone) three times and sets the fastest of each against the other.
  Every other run is one run.
- The machine is a shared 2-vCPU VM: expect run-to-run drift of 10-20 %; compare ratios within one run.
METHOD
} > docs/benchmarks.md
rm "$OUT/report.md"
echo "wrote docs/benchmarks.md in ${minutes} min"
