"""Triton's mode is fixed when it is first imported: a fresh process running the Triton backend on the CPU
turns the interpreter on itself (no environment variable), and a process whose Triton was imported
compiled is told why the CPU cannot run the kernels, instead of failing inside Triton. Each case runs in
its own interpreter, without the test session's TRITON_INTERPRET."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILD = ("from prefixserve import LLM\n"
         "llm = LLM('random:qwen3-tiny', device='cpu', dtype='float32', attention_backend='triton', num_kv_blocks=32)\n"
         "print(type(llm.engine.loaded.model.attention_backend).__name__)\n")


def run(source: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=240)


def test_a_fresh_process_interprets_on_the_cpu_by_itself():
    result = run(BUILD)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "TritonPagedAttention"


def test_a_process_already_compiling_says_why_the_cpu_cannot_run_the_kernels():
    result = run("import triton.language\n" + BUILD)
    assert result.returncode != 0
    assert "only under Triton's interpreter" in result.stderr and "TRITON_INTERPRET=1" in result.stderr
