"""dtype="auto": bfloat16 where the CPU multiplies bfloat16 faster (AMX, or avx512_bf16 measured
clearly faster), float32 elsewhere, an explicit dtype always; the choice and its reason are logged
and reported."""
from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import torch

from prefixserve import LLM, EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.model.dtype_choice import CpuBf16Support, choose_dtype
from test_server_api import LiveServer

CPU = torch.device("cpu")


@pytest.mark.parametrize("amx, avx512_bf16, speedup, expected", [
    (True, True, None, "bfloat16"), (True, False, None, "bfloat16"), (False, True, 2.5, "bfloat16"),
    (False, True, 0.55, "float32"), (False, True, 1.1, "float32"), (False, False, None, "float32")])
def test_auto_follows_the_cpu_features(amx: bool, avx512_bf16: bool, speedup, expected: str) -> None:
    choice = choose_dtype("auto", CPU, CpuBf16Support(amx_bf16=amx, avx512_bf16=avx512_bf16,
                                                      bf16_speedup=speedup))
    assert choice.dtype == expected
    expected_reason = "AMX" if amx else f"{speedup:.2f}x" if avx512_bf16 else "neither AMX nor avx512_bf16"
    assert expected_reason in choice.reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_wins_over_the_cpu(dtype: str) -> None:
    for support in (CpuBf16Support(False, False), CpuBf16Support(True, True)):
        assert choose_dtype(dtype, CPU, support).dtype == dtype


def test_auto_off_the_cpu_keeps_the_checkpoints_dtype() -> None:
    assert choose_dtype("auto", torch.device("cuda"), CpuBf16Support(True, True)).dtype is None


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo lists no flags")


def test_detection_agrees_with_the_kernel_s_cpu_flags() -> None:
    """The oracle is the OS's own list: a feature torch reports must be one the kernel lists
    (AMX may be listed yet withheld from the process, so only that direction is exact for it)."""
    flags, support = _cpu_flags(), CpuBf16Support.detect()
    assert support.avx512_bf16 == ("avx512_bf16" in flags)
    assert not support.amx_bf16 or "amx_bf16" in flags


def test_engine_resolves_auto_logs_it_and_reports_it(caplog) -> None:
    support = CpuBf16Support.detect()
    with caplog.at_level(logging.INFO, logger="prefixserve.engine.llm_engine"):
        llm = LLM("random:qwen3-tiny", dtype="auto", num_kv_blocks=16)
    # without AMX the choice rests on a timing: check it is one the features allow, and says so
    allowed = {"bfloat16"} if support.amx_bf16 else {"bfloat16", "float32"} if support.avx512_bf16 \
        else {"float32"}
    expected = llm.engine.info.dtype
    assert expected in allowed
    assert llm.engine.info.dtype == llm.stats().dtype == expected
    assert llm.engine.info.dtype_reason.startswith("auto: ")
    assert next(llm.engine.loaded.model.parameters()).dtype == getattr(torch, expected)
    assert llm.engine.loaded.identity.endswith(":" + expected)  # cached K/V never crosses dtypes
    assert any(f"dtype {expected} (auto: " in r.getMessage() for r in caplog.records)


def test_health_shows_the_dtype_and_why() -> None:
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", dtype="float32", num_kv_blocks=16))
    with LiveServer(build_app(engine, ServerConfig())) as live:
        health = httpx.get(live.base_url + "/health", timeout=60).json()
    assert health["status"] == "ok"
    assert health["dtype"] == "float32" and health["dtype_reason"] == "asked for explicitly"
