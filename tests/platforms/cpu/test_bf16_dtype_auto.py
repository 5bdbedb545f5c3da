"""dtype="auto": bfloat16 where the CPU multiplies bfloat16 faster (AMX, avx512_bf16 on an AMD CPU, or
avx512_bf16 measured clearly faster), float32 elsewhere, an explicit dtype always; the choice and its
reason are logged and reported."""
from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import torch

from prefixserve import LLM, EngineConfig, LLMEngine
from prefixserve.engine import with_concrete_dtype
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.platforms.cpu import dtype_choice
from prefixserve.platforms.cpu.dtype_choice import CpuBf16Support, choose_dtype
from live_server import LiveServer

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


def test_an_amd_cpu_with_avx512_bf16_takes_bfloat16_without_timing(monkeypatch) -> None:
    """Its avx512_bf16 is the vector units' own (Zen 4 and Zen 5): no timing to land on the wrong side of
    the line on a busy machine, so every start of a server on it chooses alike. An Intel CPU without AMX
    still times (a hypervisor can withhold AMX and leave a slow bfloat16 path)."""
    def no_timing():
        raise AssertionError("timed a matmul")
    monkeypatch.setattr(dtype_choice, "cpu_probe", lambda name: name == "_is_avx512_bf16_supported")
    monkeypatch.setattr(dtype_choice, "measure_bf16_speedup", no_timing)
    monkeypatch.setattr(dtype_choice, "cpu_vendor", lambda: "AuthenticAMD")
    support = CpuBf16Support.detect()
    assert support == CpuBf16Support(False, True, None, "AuthenticAMD")
    choice = choose_dtype("auto", CPU, support)
    assert choice.dtype == "bfloat16" and "AMD" in choice.reason
    monkeypatch.setattr(dtype_choice, "cpu_vendor", lambda: "GenuineIntel")
    with pytest.raises(AssertionError, match="timed a matmul"):
        CpuBf16Support.detect()
    with pytest.raises(ValueError, match="needs bf16_speedup"):
        choose_dtype("auto", CPU, CpuBf16Support(False, True, None, "GenuineIntel"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_wins_over_the_cpu(dtype: str) -> None:
    for support in (CpuBf16Support(False, False), CpuBf16Support(True, True)):
        assert choose_dtype(dtype, CPU, support).dtype == dtype


def test_auto_off_the_cpu_keeps_the_checkpoints_dtype() -> None:
    assert choose_dtype("auto", torch.device("cuda"), CpuBf16Support(True, True)).dtype is None


@pytest.fixture()
def flip_flopping_timing(monkeypatch):
    """A CPU with avx512_bf16 and no AMX whose timing reads bfloat16 2x faster, then no faster, then 2x
    again...: the busy machine on which one test process once made a bfloat16 engine and a float32 one.
    The process's detection is forgotten before and after, so other tests see this machine's own."""
    readings = iter([2.0, 1.0] * 8)
    monkeypatch.setattr(dtype_choice, "cpu_probe", lambda name: name == "_is_avx512_bf16_supported")
    monkeypatch.setattr(dtype_choice, "cpu_vendor", lambda: "GenuineIntel")        # a CPU auto times
    monkeypatch.setattr(dtype_choice, "measure_bf16_speedup", lambda: next(readings))
    dtype_choice.detected_support.cache_clear()
    yield
    dtype_choice.detected_support.cache_clear()


def test_auto_is_decided_once_a_process(flip_flopping_timing) -> None:
    """Every engine of a process answers in the dtype the first one chose, however the timing moves."""
    assert [choose_dtype("auto", CPU).dtype for _ in range(3)] == ["bfloat16"] * 3
    engines = [LLMEngine(EngineConfig(model="random:qwen3-tiny", dtype="auto", num_kv_blocks=16)) for _ in range(2)]
    assert [e.info.dtype for e in engines] == ["bfloat16", "bfloat16"]
    assert engines[0].loaded.identity == engines[1].loaded.identity


def test_replicas_take_the_dtype_their_service_resolved(flip_flopping_timing) -> None:
    """Replicas are handed a concrete dtype, resolved once by the service, instead of each timing its own."""
    config = EngineConfig(model="random:qwen3-tiny", dtype="auto")
    resolved, choice = with_concrete_dtype(config)
    assert resolved.dtype == choice.dtype == "bfloat16" and choice.requested == "auto"
    assert resolved == EngineConfig(model="random:qwen3-tiny", dtype="bfloat16")
    assert with_concrete_dtype(resolved)[0] == resolved            # explicit stays explicit
    assert with_concrete_dtype(EngineConfig(model="random:qwen3-tiny", dtype="float32"))[0].dtype == "float32"


def _cpu_field(name: str) -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/cpuinfo lists no {name}")


def _cpu_flags() -> set[str]:
    return set(_cpu_field("flags").split())


def test_detection_agrees_with_the_kernel_s_cpu_flags() -> None:
    """The oracle is the OS's own list: a feature torch reports must be one the kernel lists
    (AMX may be listed yet withheld from the process, so only that direction is exact for it)."""
    flags, support = _cpu_flags(), CpuBf16Support.detect()
    assert support.avx512_bf16 == ("avx512_bf16" in flags)
    assert support.vendor == _cpu_field("vendor_id")
    assert not support.amx_bf16 or "amx_bf16" in flags


def test_engine_resolves_auto_logs_it_and_reports_it(caplog) -> None:
    support = CpuBf16Support.detect()
    with caplog.at_level(logging.INFO, logger="prefixserve.engine.llm_engine"):
        llm = LLM("random:qwen3-tiny", dtype="auto", num_kv_blocks=16)
    # without AMX, on an Intel CPU, the choice rests on a timing: check it is one the features allow
    allowed = ({"bfloat16"} if support.amx_bf16 or (support.avx512_bf16 and support.vendor == "AuthenticAMD")
               else {"bfloat16", "float32"} if support.avx512_bf16 else {"float32"})
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
