"""Shared pytest fixtures.

Checkpoint fixtures are session-scoped: each tiny HF checkpoint is written once
per test session into a temporary folder and must be treated as read-only by
tests (copy it with shutil.copytree before modifying anything).

- tiny_checkpoints: {"qwen3": Path, "qwen2": Path, "llama": Path}; each folder holds config.json,
  model.safetensors and the project's tokenizer files. qwen3 and qwen2 tie the LM head to the
  embeddings; llama has an untied head and Llama 3 rope scaling. Shapes: tests/checkpoint_factory.py.
- tiny_checkpoint: tiny_checkpoint("qwen2") -> Path, the same folders by architecture name.
- tiny_sharded_checkpoint: the qwen3 checkpoint's exact weights saved as several shards plus
  model.safetensors.index.json.
- redis_server: a real redis-server (Debian's package) on a free port in the test's tmp_path,
  killed afterwards (tests/redis_server.py).
- client, claude: the official OpenAI and Anthropic clients on the module's `server` (the default
  one is tests/entrypoints/server/conftest.py's; a module may define its own).

What several test modules share lives beside this file, never in a test module (no test module
imports another: tests/test_test_tree.py): live_server.py (LiveServer, the shared ENGINE and
MODEL, assert_pool_idle, metrics), tool_fixtures.py, bad_inputs.py, diagnose_logs.py,
cache_reuse_oracle.py, routing_oracle.py, replica_service.py, prefix_caching_oracle.py,
bf16_reference.py, waiting.py (wait_until), checkpoint_factory.py, redis_server.py, serve_process.py,
kv_store_helpers.py, native_kernel_build.py, import_graph.py, kernel_device.py, sim_worker.py
and vl_oracle.py. Fixtures a folder shares sit in its conftest.py
(entrypoints/server/: server, http; replicas/: cluster).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernels (prefixserve/platforms/cuda) are tested on the CPU under Triton's
# interpreter, a mode Triton fixes when it is first imported, and transformers imports it (through
# torch._dynamo) below: choose it now. With a GPU they are tested compiled, on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoint_factory import ARCHITECTURES, write_tiny_checkpoint
from redis_server import RedisServer

# No property test has a deadline, nor the health check of how fast examples are generated: both are
# wall-clock thresholds (Hypothesis's default deadline is 200 ms an example, with "unreliable timings"
# when a rerun is faster), which a loaded CI machine fails without a bug.
settings.register_profile("prefixserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("prefixserve")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=0) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints: dict[str, Path]) -> Callable[[str], Path]:
    def by_arch(arch: str) -> Path:
        if arch not in tiny_checkpoints:
            raise ValueError(f"no tiny checkpoint for {arch!r}; have {sorted(tiny_checkpoints)}")
        return tiny_checkpoints[arch]
    return by_arch


@pytest.fixture(scope="session")
def tiny_sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_sharded") / "qwen3"
    return write_tiny_checkpoint(folder, "qwen3", seed=0, max_shard_size="400KB")


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture()
def client(server):
    """The official OpenAI client on the module's `server` (a LiveServer)."""
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def claude(server):
    """The official Anthropic client on the module's `server` (a LiveServer)."""
    import anthropic
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
