"""A real redis-server (the OS package) on a free port in a temporary directory, per test."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from prefixserve.benchmarks.serving_process import free_port


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs the redis-server "
                               "package; or: apt-get install -y redis-server)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # free_port() only finds a port free now: another process can bind it before redis-server
        # does, which then exits. Then it is started again on another port, not reported as broken.
        for _ in range(5):
            self.proc = subprocess.Popen(
                [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                 "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120   # a loaded 2-core CI machine starts processes slowly
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self._answers():
                        return
                except OSError:
                    time.sleep(0.05)
            if self.proc.poll() is None:
                break
            self.port = free_port()
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _answers(self) -> bool:
        """Our redis-server answers on the port (its INFO names its process: not another's server)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    return False
                reply += chunk
        return reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0] == str(self.proc.pid).encode()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
