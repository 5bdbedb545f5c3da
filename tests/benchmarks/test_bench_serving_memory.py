"""The memory a serving process holds: the engine's count of its weights, and a real `prefixserve serve`
process measured against weights + KV pool + 1 GiB.

Oracles: the tensors a checkpoint folder stores (written by transformers, or by the bench's exporter),
the KV pool's size worked out by hand from the model's shape, and the peak of a fresh interpreter that
imports what the server imports."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from prefixserve import EngineConfig, LLMEngine
from prefixserve.benchmarks.checkpoint import checkpoint_folder
from prefixserve.benchmarks.serving_memory import (HEADROOM_BYTES, TARGET_NAME, ServingMemory, measure_serving_memory,
                                                   memory_target)
from prefixserve.benchmarks.serving_process import ServerProcess, ServerProcessError, http_open
from prefixserve.benchmarks.workloads import BenchRequest, Workload

KV_POOL = (8 << 20) + 5000   # not a whole number of blocks: the pool rounds down


def stored_tensors(folder: Path) -> dict[str, list[int]]:
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    return shapes


def checkpoint_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Every tensor the folder stores, once, at `dtype`'s size, plus the rotary inverse frequencies:
    head_dim / 2 float32 values computed from the config, a buffer no checkpoint stores."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    numel = sum(math.prod(shape) for shape in stored_tensors(folder).values())
    return numel * torch.tensor([], dtype=dtype).element_size() + head_dim // 2 * 4


@pytest.mark.parametrize("arch, tied", [("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_bytes_counts_each_stored_tensor_once(tiny_checkpoint, arch: str, tied: bool, dtype: str) -> None:
    folder = tiny_checkpoint(arch)
    # transformers stores a tied head once, as the embedding: the oracle counts it once too
    assert ("lm_head.weight" in stored_tensors(folder)) is not tied
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, num_kv_blocks=16))
    assert engine.stats().weights_bytes == checkpoint_bytes(folder, getattr(torch, dtype))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_folder("random:qwen3-tiny", "float32", 0, tmp_path_factory.mktemp("bench_cache"))


def small_workload() -> Workload:
    doc = tuple(range(100, 164))
    first = (BenchRequest("a", doc + (7, 8, 9), 5, shared_prefix_len=64),
             BenchRequest("b", doc + (10, 11), 5, shared_prefix_len=64))
    return Workload("small", "a 64-token document asked twice, then once more", 0,
                    (first, (BenchRequest("c", doc + (12,), 3, shared_prefix_len=64),)))


def kv_pool_bytes(folder: Path, pool: int) -> int:
    """Whole blocks of 16 tokens: K and V of every layer, float32."""
    c = json.loads((folder / "config.json").read_text())
    per_block = c["num_hidden_layers"] * 2 * 16 * c["num_key_value_heads"] * c["head_dim"] * 4
    return pool // per_block * per_block


def import_baseline_bytes() -> int:
    """Peak RSS of a fresh interpreter that has imported the server, torch and the engine, and done nothing."""
    code = ("import prefixserve.entrypoints.cli, prefixserve.entrypoints.server.app, prefixserve.engine.llm_engine\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1024


def child_pids() -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                children.add(int(entry.name))
    return children


def test_a_real_server_fits_weights_plus_pool_plus_one_gib(tiny_folder: Path) -> None:
    before = child_pids()
    memory = measure_serving_memory(tiny_folder, small_workload(), dtype="float32", threads=1,
                                    kv_cache_memory=KV_POOL)
    assert child_pids() == before                      # the server is gone
    assert memory.requests == 3 and memory.workload == "small"
    assert memory.weights_bytes == checkpoint_bytes(tiny_folder, torch.float32)
    assert memory.kv_cache_bytes == kv_pool_bytes(tiny_folder, KV_POOL)
    assert memory.budget_bytes == memory.weights_bytes + memory.kv_cache_bytes + (1 << 30)
    assert memory.peak_rss_bytes >= memory.weights_bytes + import_baseline_bytes()
    assert memory.peak_rss_bytes <= memory.budget_bytes
    target = memory_target(memory)
    assert (target.name, target.measured, target.met) == (TARGET_NAME, memory.ratio, True)


def test_server_process_stops_cleanly_and_frees_its_port(tiny_folder: Path) -> None:
    with ServerProcess(["--model", str(tiny_folder), "--num-kv-blocks", "64", "--log-level", "warning"]) as server:
        pid, port = server.pid, server.port
        with http_open(server.base_url + "/health") as resp:
            assert resp.status == 200
    assert server.returncode == 0                      # SIGINT: a clean shutdown, not a kill
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # A new server can listen there (SO_REUSEADDR, as uvicorn binds: closed connections may linger in TIME_WAIT).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_port_taken_before_the_server_binds_it_is_left_for_another(tiny_folder: Path, monkeypatch) -> None:
    """The race free_port() cannot close: another process listens on the port first. The server
    exits with "address already in use" and is started again on another free port."""
    from prefixserve.benchmarks import serving_process
    real = serving_process.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        monkeypatch.setattr(serving_process, "free_port", lambda: next(picks, None) or real())
        with ServerProcess(["--model", str(tiny_folder), "--num-kv-blocks", "64", "--log-level", "warning"]) as server:
            assert server.port != taken.getsockname()[1]
            with http_open(server.base_url + "/health") as resp:
                assert resp.status == 200


def test_a_failing_server_is_reported_with_its_output_and_stopped(tmp_path: Path) -> None:
    before = child_pids()
    with pytest.raises(ServerProcessError) as info:
        measure_serving_memory(tmp_path / "no-such-checkpoint", small_workload(), dtype="float32", threads=1,
                               kv_cache_memory=KV_POOL)
    message = str(info.value)
    assert "exited with status 2 before it was ready" in message
    assert "prefixserve serve: error:" in message and "no-such-checkpoint" in message   # the server's stderr
    assert child_pids() == before


def test_a_failing_request_is_reported_with_the_server_stopped(tiny_folder: Path) -> None:
    too_long = Workload("too-long", "one prompt past the model's 4096 positions", 0,
                        ((BenchRequest("long", tuple(range(100, 100 + 5000)), 2),),))
    before = child_pids()
    with pytest.raises(ServerProcessError, match="request long: HTTP 400") as info:
        measure_serving_memory(tiny_folder, too_long, dtype="float32", threads=1, kv_cache_memory=KV_POOL)
    assert "last output of `prefixserve serve`" in str(info.value)
    assert child_pids() == before


def test_serving_memory_is_validated_and_judged_against_its_budget() -> None:
    with pytest.raises(ValueError, match="peak_rss_bytes"):
        ServingMemory(0, 1, 1, "w", 1)
    over = ServingMemory(peak_rss_bytes=3 << 30, weights_bytes=1 << 30, kv_cache_bytes=1 << 29, workload="w",
                         requests=1)
    assert over.budget_bytes == (1 << 30) + (1 << 29) + HEADROOM_BYTES and over.ratio == 1.2
    assert memory_target(over).met is False and memory_target(over).wanted == "<= 1x"
    assert memory_target(None).measured is None and memory_target(None).met is None
