"""Compiling and loading a kernel of this folder: once per source, compiler and flags, cached.

The libraries are plain C with no torch headers (about a second to build). Their
OpenMP loops bind to the runtime torch already loaded (the same soname), so kernels and
torch share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

import torch

logger = logging.getLogger(__name__)
K = TypeVar("K")

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
HERE = Path(__file__).parent


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixserve" / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cpu_supported() -> bool:
    """This CPU runs AVX2 + FMA code (the kernels' only instruction-set requirement)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def buildable() -> bool:
    """The kernels can be built and run here: a supported CPU and a C compiler."""
    return cpu_supported() and compiler() is not None


def enabled() -> bool:
    """This CPU can run the kernels and the user has not turned them off."""
    return os.environ.get("PREFIXSERVE_NATIVE_KERNELS", "1") != "0" and cpu_supported()


def build(name: str, cc: str, out_dir: Path) -> Path:
    """Compile `<name>.c` into out_dir unless already there, and return the library's path.

    Written under a temporary name and renamed, so concurrent processes never load a half-written file.
    """
    source = HERE / f"{name}.c"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), version, *FLAGS]).encode()).hexdigest()[:16]
    target = out_dir / f"{name}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(name: str, cc: str | None, out_dir: Path) -> ctypes.CDLL | None:
    """The compiled library, or None (logged once by the caller's loader) where it cannot be built."""
    if cc is None:
        logger.warning("no C compiler found: %s falls back to torch (slower)", name)
        return None
    # a read-only home (some containers) must not cost the kernels: build in a private temp folder instead
    fallback = Path(tempfile.gettempdir()) / f"prefixserve-kernels-{os.getuid()}"
    for folder in (out_dir, fallback):
        try:
            return ctypes.CDLL(str(build(name, cc, folder)))
        except PermissionError as exc:
            logger.info("cannot build %s in %s (%s)", name, folder, exc)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("%s kernel unavailable, falling back to torch: %s", name, exc)
            return None
    logger.warning("%s kernel unavailable, falling back to torch: no writable folder to build in", name)
    return None


def load_kernel(name: str, cc: str | None, out_dir: Path, wrap: Callable[[ctypes.CDLL], K],
                probe: Callable[[K], bool]) -> K | None:
    """Build, load and wrap kernel `name`, and check it against torch with `probe`; None where any step fails."""
    if not cpu_supported():
        return None
    library = load_library(name, cc, out_dir)
    if library is None:
        return None
    kernel = wrap(library)
    if not probe(kernel):
        logger.warning("%s kernel disagrees with torch on a probe; not used", name)
        return None
    return kernel
