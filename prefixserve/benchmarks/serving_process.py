"""`prefixserve serve` as a child process on a free loopback port, the way a user starts it.

A context manager: the server is always stopped on leaving (SIGINT, as from a terminal, then a
kill if it does not exit), and its output goes to a file whose tail every error carries.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Optional, Sequence

import prefixserve

# The package folder's parent: the child imports the same prefixserve as this process, installed or not.
_SOURCE_ROOT = Path(prefixserve.__file__).resolve().parents[1]
_TAIL_BYTES = 4000
_STOP_TIMEOUT_S = 30.0
_PORT_ATTEMPTS = 5
# No proxy from the environment may sit between us and a loopback server.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerProcessError(RuntimeError):
    """The server failed to start, died, or answered wrongly; the message ends with its output's tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_open(url: str, body: Optional[bytes] = None, timeout: float = 60.0):
    """A urllib response (a context manager); JSON body when given. Bypasses proxies."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    return _OPENER.open(request, timeout=timeout)


class ServerProcess:
    def __init__(self, serve_args: Sequence[str], *, startup_timeout_s: float = 300.0) -> None:
        """serve_args: `prefixserve serve` options other than --host and --port, which this class picks."""
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        for flag in ("--host", "--port"):
            if flag in serve_args:
                raise ValueError(f"serve_args must not set {flag}: the server runs on a free loopback port")
        self.serve_args = tuple(serve_args)
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self._proc: Optional[subprocess.Popen] = None
        self._log: Optional[IO[bytes]] = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the server is not started")
        return self._proc.pid

    def __enter__(self) -> ServerProcess:
        # A free port can only be found, not kept: the child binds it seconds after free_port()
        # released it, and another process may take it in between. The child then exits with
        # "address already in use", and is started again on another port.
        for attempt in range(_PORT_ATTEMPTS):
            self._start(free_port())
            try:
                self._wait_ready()
                return self
            except ServerProcessError:
                taken = self.returncode is not None and "address already in use" in self.output_tail().lower()
                self.stop()
                if not taken or attempt == _PORT_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start(self, port: int) -> None:
        self.port = port
        if self._log is not None:
            self._log.close()
        self._log = tempfile.TemporaryFile()
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": str(_SOURCE_ROOT) + (os.pathsep + path if path else "")}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "prefixserve.entrypoints.cli", "serve", *self.serve_args,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise self.error(f"the server exited with status {self._proc.returncode} before it was ready")
            try:
                with http_open(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass   # not listening yet, or its engine not up
            if time.monotonic() > deadline:
                raise self.error(f"the server was not ready within {self.startup_timeout_s:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Safe to call twice; returns once the process is gone."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def returncode(self) -> Optional[int]:
        """None while it runs (or before it started)."""
        return None if self._proc is None else self._proc.poll()

    def output_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        size = self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, size - _TAIL_BYTES))
        return self._log.read().decode("utf-8", "replace")

    def error(self, message: str) -> ServerProcessError:
        return ServerProcessError(f"{message}\n--- last output of `prefixserve serve` ---\n{self.output_tail()}")
