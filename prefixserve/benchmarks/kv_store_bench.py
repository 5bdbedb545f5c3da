"""The KV store workloads of `prefixserve bench`: `restart` and `working-set`.

restart: a document of 4k tokens (1k with --quick) is asked once by a first process, which
measures its TTFT cold (nothing cached) and again with the document in its pool, then exits
cleanly (the pool is flushed to a file store). Fresh processes then ask it again: three with the
store's files in the OS page cache (a process restart; the files are read just before each, and
the restart with the median ratio is reported), one after they were dropped from it
(fsync + POSIX_FADV_DONTNEED on each file: as after a reboot, without touching anything else
on the machine). Each also times the document in its own pool. The disk's sequential read
bandwidth is measured in the same run (a 1 GiB file, written, dropped from the page cache,
read in 8 MiB reads), next to what the store reached while loading (bytes / load seconds).
Every process serves one short unrelated request before the timed ones.

working-set: K shared prefixes whose blocks need 4x the KV pool, asked in tile order
(p1 p2 .. pK p1 p2 ..), one request at a time. Without stores the pool's LRU evicts each
prefix before it comes back; with mem:// the evicted blocks return from host memory. Computed
prompt tokens are compared with the ideal (every shared prefix computed once, Workload's trie).

Only the public API (LLM, stats) is used. Each figure comes from this one run; ratios are
what to compare across machines.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STORE_WORKLOADS = ("restart", "working-set")
_WARM_RESTARTS = 3
_TOKEN_LOW, _TOKEN_HIGH = 64, 8000


@dataclass(frozen=True)
class StoreBenchConfig:
    model: str = "random:qwen3-0.6b"
    dtype: str = "float32"
    quick: bool = False
    threads: int = 2
    seed: int = 0
    workdir: Optional[Path] = None   # where the file store and the bandwidth probe go

    @property
    def doc_len(self) -> int:
        return 1024 if self.quick else 4096


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_TOKEN_LOW, _TOKEN_HIGH) for _ in range(n)]


# ---------------------------------------------------------------- child processes
def _child(args: dict) -> dict:
    import torch

    from prefixserve import LLM, SamplingParams
    torch.set_num_threads(args["threads"])
    rng = random.Random(args["seed"])
    doc = _tokens(rng, args["doc_len"])
    questions = [_tokens(rng, 32) for _ in range(6)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm = LLM(args["model"], dtype=args["dtype"], seed=args["model_seed"],
              kv_cache_memory=args["kv_cache_memory"], kv_stores=args["stores"])

    def ttft(q: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": doc + q}, one)[0]
        return time.perf_counter() - t0, out.num_cached_tokens

    # One unrelated short request first, so the timed ones do not pay the process's one-time
    # costs (first forward, allocator growth), which neither stores nor the pool change.
    llm.generate({"prompt_token_ids": _tokens(random.Random(-1), 64)}, one)
    result: dict = {}
    if args["phase"] == "first":
        result["cold_s"], result["cold_cached"] = ttft(questions[0])
    else:
        result["store_s"], result["store_cached"] = ttft(questions[0])
    pool = [ttft(q) for q in questions[1:4]]
    result["pool_s"] = sorted(t for t, _ in pool)[1]   # the median of three
    result["pool_cached"] = pool[0][1]
    t0 = time.perf_counter()
    stats = llm.stats().kv_stores
    llm.close()
    result["close_s"] = time.perf_counter() - t0
    result["stores"] = [vars(s) for s in stats]
    return result


def _llama_child(args: dict) -> dict:
    """llama.cpp's slot save / restore (what --slot-save-path does) through llama-cpp-python:
    the document's state saved to a file by one process and restored by a fresh one."""
    import ctypes

    import llama_cpp
    from llama_cpp import Llama
    rng = random.Random(args["seed"])
    doc = _tokens(rng, args["doc_len"])
    questions = [_tokens(rng, 32) for _ in range(6)]
    kv_type = 0 if args["dtype"] == "float32" else 1   # GGML_TYPE_F32 / F16
    llm = Llama(model_path=args["gguf"], n_ctx=args["doc_len"] + 128, n_batch=512, n_ubatch=512,
                n_threads=args["threads"], n_threads_batch=args["threads"], type_k=kv_type,
                type_v=kv_type, verbose=False)
    ctx = llm._ctx.ctx

    def first_token(tail: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        llm.eval(tail)
        token = llm.sample(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        return time.perf_counter() - t0, int(token)

    first_token(_tokens(random.Random(-1), 64))   # the same warm-up as prefixserve's
    llm.n_tokens = 0
    result: dict = {}
    if args["phase"] == "llama-save":
        result["cold_s"], result["token"] = first_token(doc + questions[0])
        llm.n_tokens = len(doc)            # the next eval drops the KV past the document
        pool = []
        for q in questions[1:4]:
            pool.append(first_token(q)[0])
            llm.n_tokens = len(doc)
        result["context_s"] = sorted(pool)[1]
        tokens = (llama_cpp.llama_token * len(doc))(*doc)
        written = llama_cpp.llama_state_seq_save_file(ctx, args["state"].encode(), 0, tokens, len(doc))
        result["state_bytes"] = int(written)
    else:
        t0 = time.perf_counter()
        cap = args["doc_len"] + 128
        tokens = (llama_cpp.llama_token * cap)()
        count = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(ctx, args["state"].encode(), 0, tokens, cap,
                                                   ctypes.byref(count))
        n = count.value
        llm.input_ids[:n] = tokens[:n]
        llm.n_tokens = n
        load_s = time.perf_counter() - t0
        ttft, token = first_token(questions[0])
        result.update(restore_s=load_s + ttft, load_s=load_s, token=token, read_bytes=int(read),
                      restored_tokens=n)
    return result


def run_llama_restore(config: StoreBenchConfig) -> dict:
    from prefixserve.benchmarks.checkpoint import checkpoint_folder
    from prefixserve.benchmarks.gguf_export import gguf_path_for
    gguf = gguf_path_for(checkpoint_folder(config.model, config.dtype, config.seed,
                                           config.workdir or Path(tempfile.gettempdir())))
    root = Path(tempfile.mkdtemp(prefix="prefixserve-llama-", dir=config.workdir))
    try:
        base = dict(gguf=str(gguf), dtype=config.dtype, seed=1234, threads=config.threads,
                    doc_len=config.doc_len, state=str(root / "slot.bin"))
        saved = _run_child({**base, "phase": "llama-save"})
        restored = _run_child({**base, "phase": "llama-restore"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"cold_s": saved["cold_s"], "context_s": saved["context_s"],
            "restore_s": restored["restore_s"], "load_s": restored["load_s"],
            "state_bytes": saved["state_bytes"], "restored_tokens": restored["restored_tokens"],
            "same_first_token": saved["token"] == restored["token"]}


def _run_child(args: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "prefixserve.benchmarks.kv_store_bench",
                           json.dumps(args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the disk
def _drop_from_page_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_into_page_cache(paths) -> None:
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def disk_read_bandwidth(folder: Path, size: int = 1 << 30) -> float:
    """Bytes/s of one sequential read of a file not in the page cache."""
    path = folder / "read-bandwidth.bin"
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
    _drop_from_page_cache([path])
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    seconds = time.perf_counter() - t0
    path.unlink()
    return total / seconds


# ---------------------------------------------------------------- workloads
def run_restart(config: StoreBenchConfig) -> dict:
    root = Path(tempfile.mkdtemp(prefix="prefixserve-restart-", dir=config.workdir))
    try:
        store = root / "store"
        kv_mem = (3 << 29) if not config.quick else (1 << 30)
        base = dict(model=config.model, dtype=config.dtype, model_seed=config.seed, seed=1234,
                    threads=config.threads, doc_len=config.doc_len, kv_cache_memory=kv_mem,
                    stores=[f"file://{store}"])
        first = _run_child({**base, "phase": "first"})
        files = [p for p in store.rglob("*.kvb")]

        def restart_warm() -> dict:
            # The case is "files in the page cache": make it so. A host may page out file pages
            # idle for a minute (this project's VMs run DAMON reclaim with a 60 s minimum age),
            # which made later restarts read part of the store from disk.
            _read_into_page_cache(files)
            return _run_child({**base, "phase": "restart"})
        # Repeated, and the restart with the median ratio (its store TTFT over its own in-pool
        # TTFT) reported with all the ratios beside it: one restart swung 1.42-1.65x on a shared VM.
        restarts = sorted((restart_warm() for _ in range(_WARM_RESTARTS)),
                          key=lambda run: run["store_s"] / run["pool_s"])
        warm = restarts[len(restarts) // 2]
        _drop_from_page_cache(files)
        cold_cache = _run_child({**base, "phase": "restart"})
        disk = disk_read_bandwidth(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    st = cold_cache["stores"][0]
    store_bw = st["bytes_read"] / st["load_seconds"] if st["load_seconds"] else 0.0
    return {
        "doc_len": config.doc_len, "records": len(files),
        "cold_s": first["cold_s"], "pool_s_first": first["pool_s"],
        "store_s_page_cache": warm["store_s"], "pool_s_page_cache": warm["pool_s"],
        "store_s_disk": cold_cache["store_s"], "pool_s_disk": cold_cache["pool_s"],
        "cached_tokens": [first["cold_cached"], warm["store_cached"], cold_cache["store_cached"]],
        "restart_ratios": [run["store_s"] / run["pool_s"] for run in restarts],
        "flush_s": first["close_s"],
        "store_bytes_read": st["bytes_read"], "store_load_s": st["load_seconds"],
        "store_read_bw": store_bw, "disk_read_bw": disk,
    }


def working_set_prompts(quick: bool, seed: int) -> tuple[list[list[int]], int, int]:
    """(prompts in tile order, the pool in blocks, ideal computed prompt tokens)."""
    from prefixserve.benchmarks.workloads import BenchRequest, Workload
    rng = random.Random(seed)
    n_prefix, prefix_len, q_len, rounds = (8, 256, 16, 3) if quick else (8, 512, 16, 2)
    prefixes = [_tokens(rng, prefix_len) for _ in range(n_prefix)]
    prompts = [prefixes[p] + _tokens(rng, q_len) for _ in range(rounds) for p in range(n_prefix)]
    # The prefixes need 4x the pool, which still holds a whole request.
    pool_blocks = n_prefix * prefix_len // 16 // 4
    assert pool_blocks >= (prefix_len + q_len) // 16 + 3
    reqs = tuple(BenchRequest(f"ws-{i}", tuple(p), 1, shared_prefix_len=prefix_len)
                 for i, p in enumerate(prompts))
    ideal = Workload("working-set", "", seed, (reqs,)).ideal_computed_tokens()
    return prompts, pool_blocks, ideal


def run_working_set(config: StoreBenchConfig) -> dict:
    import gc

    import torch

    from prefixserve import LLM, SamplingParams
    torch.set_num_threads(config.threads)
    prompts, pool_blocks, ideal = working_set_prompts(config.quick, config.seed + 7)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "ideal": ideal,
           "pool_blocks": pool_blocks}
    for label, stores in (("no-store", []), ("mem", ["mem://?size=4GiB"])):
        llm = LLM(config.model, dtype=config.dtype, seed=config.seed, num_kv_blocks=pool_blocks,
                  kv_stores=stores)
        t0 = time.perf_counter()
        for p in prompts:
            llm.generate({"prompt_token_ids": p}, one)
        wall = time.perf_counter() - t0
        s = llm.stats()
        out[label] = {"computed": s.computed_prompt_tokens, "wall_s": wall,
                      "store_hits": sum(st.hits for st in s.kv_stores)}
        llm.close()
        del llm
        gc.collect()
    return out


def to_markdown(config: StoreBenchConfig, info: dict, restart: Optional[dict],
                working: Optional[dict]) -> str:
    lines = [f"KV store benchmarks: {config.model} ({config.dtype}), {info['cpu']}, "
             f"{config.threads} threads.", ""]
    if restart is not None:
        r = restart
        gb = 1e9
        lines += [
            f"restart: one {r['doc_len']}-token document + a 32-token question, TTFT (max_tokens=1)",
            "", "| case | TTFT s | vs in-pool | cached tokens |", "|---|---|---|---|",
            f"| cold (first process, nothing cached) | {r['cold_s']:.3f} | "
            f"{r['cold_s'] / r['pool_s_page_cache']:.1f}x | {r['cached_tokens'][0]} |",
            f"| in the pool (restarted process, median of 3) | {r['pool_s_page_cache']:.3f} | 1.0x | |",
            f"| file store after restart, files in page cache (the median of {len(r['restart_ratios'])} "
            f"restarts: {', '.join(f'{x:.2f}x' for x in r['restart_ratios'])}) | {r['store_s_page_cache']:.3f} | "
            f"{r['store_s_page_cache'] / r['pool_s_page_cache']:.2f}x | {r['cached_tokens'][1]} |",
            f"| file store after restart, files dropped from page cache | {r['store_s_disk']:.3f} | "
            f"{r['store_s_disk'] / r['pool_s_disk']:.2f}x | {r['cached_tokens'][2]} |",
            "",
            f"targets: warm file store <= 1.5x in-pool: {r['store_s_page_cache'] / r['pool_s_page_cache']:.2f}x "
            f"(page cache), {r['store_s_disk'] / r['pool_s_disk']:.2f}x (disk); cold / warm file store >= 5x: "
            f"{r['cold_s'] / r['store_s_page_cache']:.1f}x (page cache), {r['cold_s'] / r['store_s_disk']:.1f}x (disk)",
            f"file store load {r['store_read_bw'] / gb:.2f} GB/s ({r['store_bytes_read'] / gb:.2f} GB in "
            f"{r['store_load_s']:.3f} s, read + verify) vs disk sequential read {r['disk_read_bw'] / gb:.2f} GB/s: "
            f"{r['store_read_bw'] / r['disk_read_bw']:.2f} of it (target >= 0.5); "
            f"flush at exit {r['flush_s']:.2f} s for {r['records']} blocks",
            _llama_line(r.get("llama")), ""]
    if working is not None:
        w = working
        lines += [
            f"working-set: {w['requests']} requests, shared prefixes needing 4x the {w['pool_blocks']}-block pool, "
            f"tile order; ideal computed prompt tokens {w['ideal']} of {w['prompt_tokens']}", "",
            "| stores | computed prompt tokens | vs ideal | store block hits | wall s |", "|---|---|---|---|---|"]
        for label in ("no-store", "mem"):
            c = w[label]
            lines.append(f"| {label} | {c['computed']} | {c['computed'] / w['ideal']:.2f}x | {c['store_hits']} | "
                         f"{c['wall_s']:.1f} |")
        lines += ["", f"target: mem:// <= 1.1x ideal: {w['mem']['computed'] / w['ideal']:.2f}x", ""]
    return "\n".join(lines)


def _llama_line(llama: Optional[dict]) -> str:
    if llama is None:
        return "llama.cpp slot save / restore: not run (llama-cpp-python is not installed)"
    return (f"llama.cpp slot save / restore (llama-cpp-python, same weights as GGUF, same document): "
            f"cold {llama['cold_s']:.3f} s, document in its context {llama['context_s']:.3f} s, restored "
            f"from a {llama['state_bytes'] / 1e9:.2f} GB state file by a fresh process {llama['restore_s']:.3f} s "
            f"(load {llama['load_s']:.3f} s, {llama['restored_tokens']} tokens restored, same first token as "
            f"cold: {'yes' if llama['same_first_token'] else 'NO'})")


def _llama_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run_store_benchmarks(config: StoreBenchConfig, workloads: tuple[str, ...]) -> tuple[str, dict]:
    from prefixserve.benchmarks.runner import machine_info
    info = machine_info(config.threads)
    restart = run_restart(config) if "restart" in workloads else None
    if restart is not None and _llama_available():
        restart["llama"] = run_llama_restore(config)
    working = run_working_set(config) if "working-set" in workloads else None
    return to_markdown(config, info, restart, working), {"machine": info, "restart": restart,
                                                          "working_set": working}


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    print(json.dumps(_llama_child(_args) if _args["phase"].startswith("llama") else _child(_args)))
