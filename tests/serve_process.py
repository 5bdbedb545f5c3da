"""`prefixserve serve` as a child process, as a user runs it, on a free loopback port, up and
answering /health (tests/entrypoints/test_server_cli.py, test_server_strict_fields.py,
tests/kv/stores/test_kv_store_server.py).

A free port can only be found, not kept: free_port() binds a port, reads its number and releases
it, and the child binds it seconds later, after its imports and the model. Another process that
binds it in between makes the child exit with "address already in use"; the child is then
started again on another port, rather than the test failing for it.
"""
from __future__ import annotations

import subprocess
import time
from typing import Optional

import httpx

from prefixserve.benchmarks.serving_process import free_port

START_TIMEOUT_S = 300.0   # imports and a model on a loaded 2-core machine
ATTEMPTS = 5


def start_serving(argv: list[str], *, env: Optional[dict] = None, cwd=None) -> tuple[subprocess.Popen, str]:
    """(the child, its base URL) for `argv` (a `prefixserve serve` command without --port), once it
    answers /health. Its output (stdout and stderr) is a text pipe, read by the caller at the end."""
    for _ in range(ATTEMPTS):
        port = free_port()
        proc = subprocess.Popen([*argv, "--port", str(port)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"server did not come up within {START_TIMEOUT_S:g} s:\n"
                                     + proc.communicate()[0])
            time.sleep(0.2)
        output = proc.communicate()[0]
        if "address already in use" not in output.lower():
            raise AssertionError(f"server exited with status {proc.returncode}:\n{output}")
    raise AssertionError(f"every one of {ATTEMPTS} free ports was taken before the server bound it")
