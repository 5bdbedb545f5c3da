"""Compiling and loading a kernel of this folder: once per source, compiler and flags, cached.

The libraries are plain C with no torch headers (about a second to build). Their
OpenMP loops bind to the runtime torch already loaded (the same soname), so kernels and
torch share one thread pool.

Loading a shared object runs its code in this process, so a library is only loaded from a
folder no other user can write to:

- The cache folder (`$XDG_CACHE_HOME/prefixserve/kernels`) and every folder between it and
  the cache root are created with mode 0700 and, before every load, opened one component at
  a time without following symbolic links and checked through the open descriptor: a
  directory, owned by this process's user, not writable by group or others. The cached
  file is opened the same way and must be a regular file with the same owner and bits.
  The library is then loaded through that folder's descriptor (`/proc/self/fd/N/name`), so
  renaming folders along the path after the check cannot swap it for another.
- A cached file is named `<kernel>-<key>-<sha256 of its contents>.so`, the key covering the
  source, the compiler (path and version) and the flags. Its contents are hashed before it
  is loaded; a file that does not match its name is removed and rebuilt. The digest lives
  in the name rather than beside it because a rename is atomic and a pair of files is not.
- Where the cache folder cannot be used (not a directory, read-only, full, unsafe owner or
  bits, any OSError), the library is written into a fresh `tempfile.mkdtemp` folder (0700,
  unpredictable name), loaded from there through the same checks, and the folder removed
  (a loaded library stays mapped). Where that fails too, the kernel falls back to torch.
- The compiler runs with a timeout (`PREFIXSERVE_KERNEL_BUILD_TIMEOUT`, seconds, default
  120) in its own process group, killed whole on timeout; a compiler that timed out once is
  not tried again in this process.
- Nothing about a kernel raises at start-up: every failure (missing symbol, failed probe,
  unloadable file) becomes a `KernelStatus` with a reason, one log line, and the torch path.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

from prefixserve.platforms.cpu.native.isa import AVX2, best_isa

logger = logging.getLogger(__name__)
K = TypeVar("K")

FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
HERE = Path(__file__).parent
TIMEOUT_ENV = "PREFIXSERVE_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0

# Why a kernel is not active (KernelStatus.reason): stable strings for stats() and /health.
DISABLED = "disabled"                     # PREFIXSERVE_NATIVE_KERNELS=0
NO_AVX2 = "no_avx2"                       # the CPU cannot run the kernels
NO_AVX512 = "no_avx512"                   # the CPU cannot run a kernel made of AVX-512 multiply-adds
NO_COMPILER = "no_compiler"               # no C compiler found
BUILD_FAILED = "build_failed"             # the compiler failed or could not be run
BUILD_TIMEOUT = "build_timeout"           # the compiler ran past the timeout
NO_PRIVATE_FOLDER = "no_private_folder"   # neither the cache folder nor a private temp folder could be used
LOAD_FAILED = "load_failed"               # the library did not load, or loading it raised
MISSING_SYMBOL = "missing_symbol"         # the library lacks a function the wrapper needs
PROBE_FAILED = "probe_failed"             # the kernel disagreed with torch on its probe, or the probe raised
NOT_LOADED = "not_loaded"                 # not asked for yet (kernels load on first use)
REASONS = (DISABLED, NO_AVX2, NO_AVX512, NO_COMPILER, BUILD_FAILED, BUILD_TIMEOUT, NO_PRIVATE_FOLDER, LOAD_FAILED,
           MISSING_SYMBOL, PROBE_FAILED, NOT_LOADED)

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class KernelStatus:
    """Whether a kernel is in use and, where it is not, why."""
    name: str
    active: bool
    reason: str | None = None       # one of REASONS where not active, else None
    detail: str = ""                # human-readable: what happened
    library: str | None = None      # the file loaded (in a temp folder: removed once loaded)
    note: str | None = None         # e.g. why the cache folder was passed over for a temp folder

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class UnsafeFolder(OSError):
    """A folder or file that another user could have written, or that is not what it claims to be."""


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def cache_root() -> Path:
    # the XDG spec has relative paths ignored: they would depend on the working directory
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache"))


def cache_dir() -> Path:
    return cache_root() / "prefixserve" / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def cpu_supported() -> bool:
    """This CPU runs AVX2 + FMA code (the kernels' only instruction-set requirement)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def buildable() -> bool:
    """The kernels can be built and run here: a supported CPU and a C compiler."""
    return cpu_supported() and compiler() is not None


def turned_off() -> bool:
    return os.environ.get("PREFIXSERVE_NATIVE_KERNELS", "1") == "0"


def enabled() -> bool:
    """This CPU can run the kernels and the user has not turned them off."""
    return not turned_off() and cpu_supported()


_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    # four kernels share one cache folder and one compiler: say a problem with either once
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def build_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
        _log_once(logging.WARNING, f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; "
                                   f"using {DEFAULT_TIMEOUT_S:g}")
    return DEFAULT_TIMEOUT_S


# A compiler that hung once would hang for every kernel: start-up pays its timeout once, not per kernel.
_timed_out: set[str] = set()


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, output) of the compiler command `cmd`, killed with all its children after `timeout` s.

    Output goes to a file, not a pipe: a killed compiler's orphaned children could hold a pipe
    open and block the read. umask 077 keeps what it writes from being writable by anyone else.
    """
    if cmd[0] in _timed_out:
        raise KernelUnavailable(BUILD_TIMEOUT, f"{cmd[0]} timed out earlier in this process")
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, umask=0o077)
        except OSError as exc:
            raise KernelUnavailable(BUILD_FAILED, f"cannot run {cmd[0]}: {exc}") from exc
        try:
            code = proc.wait(timeout)
        except BaseException as exc:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                _timed_out.add(cmd[0])
                raise KernelUnavailable(BUILD_TIMEOUT, f"{cmd[0]} did not finish within {timeout:g} s "
                                                       f"(set {TIMEOUT_ENV} to allow longer)") from None
            raise
        out.seek(0)
        return code, out.read().decode(errors="replace")


def compile_flags(defines: tuple[str, ...] = ()) -> list[str]:
    """FLAGS and `-D` for each of `defines` (a variant of a kernel's source, such as one emulating an
    instruction set this CPU lacks, for tests)."""
    return [*FLAGS, *(f"-D{define}" for define in defines)]


def cache_key(name: str, cc: str, defines: tuple[str, ...] = ()) -> str:
    """The part of a cached library's name fixed by its source, the folder's headers, compiler and flags."""
    try:
        source = (HERE / f"{name}.c").read_bytes()
    except OSError as exc:
        raise KernelUnavailable(BUILD_FAILED, f"cannot read the kernel's source: {exc}") from exc
    code, version = _run([cc, "--version"], build_timeout())
    if code != 0:
        raise KernelUnavailable(BUILD_FAILED, f"{cc} --version exited with {code}: {version.strip()[-500:]}")
    # every header of the folder: a kernel's includes are not parsed, and there are few
    try:
        headers = [h.name.encode() + b"\0" + h.read_bytes() for h in sorted(HERE.glob("*.h"))]
    except OSError as exc:
        raise KernelUnavailable(BUILD_FAILED, f"cannot read the kernels' headers: {exc}") from exc
    flags = [flag.encode() for flag in compile_flags(defines)]
    parts = [source, *headers, os.path.realpath(cc).encode(), version.encode(), *flags]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(name: str, cc: str, defines: tuple[str, ...] = ()) -> bytes:
    """The library built from `<name>.c`, compiled in a private temp folder removed afterwards."""
    # a first start compiles every kernel, seconds with nothing else to show for them
    logger.info("compiling CPU kernel %s (once; later starts load it from the cache)", name)
    try:
        scratch = tempfile.mkdtemp(prefix="prefixserve-build-")
    except OSError as exc:
        raise KernelUnavailable(BUILD_FAILED, f"no temp folder to compile in: {exc}") from exc
    try:
        target = os.path.join(scratch, f"{name}.so")
        code, output = _run([cc, *compile_flags(defines), str(HERE / f"{name}.c"), "-o", target, "-lm"],
                            build_timeout())
        if code != 0:
            raise KernelUnavailable(BUILD_FAILED, f"{cc} exited with {code}: {output.strip()[-2000:]}")
        try:
            with open(target, "rb") as f:
                return f.read()
        except OSError as exc:
            raise KernelUnavailable(BUILD_FAILED, f"{cc} wrote no library: {exc}") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_private(st: os.stat_result, what: str, want_dir: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise UnsafeFolder(f"{what} is not a {'directory' if want_dir else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise UnsafeFolder(f"{what} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise UnsafeFolder(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _private_parts(folder: Path) -> tuple[Path, tuple[str, ...]]:
    """The root to open as given and the components below it to create and check one by one.

    Under the cache root: every folder below it (prefixserve/, kernels/). Elsewhere (tests,
    temp folders): the folder itself. The root itself may be shared (/tmp as XDG_CACHE_HOME):
    only folders we create are held to the private rules, and those are what make it safe.
    """
    root = cache_root()
    try:
        below = folder.relative_to(root).parts
    except ValueError:
        below = ()
    if below:
        return root, below
    return folder.parent, (folder.name,)


@contextmanager
def _private_folder(folder: Path) -> Iterator[int]:
    """A descriptor of `folder`, created where missing, checked private; raises OSError where it is not."""
    folder = Path(os.path.abspath(folder))
    root, parts = _private_parts(folder)
    os.makedirs(root, mode=0o700, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for part in parts:
            where = where / part
            try:
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:  # another process made it first
                        pass
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                        os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise UnsafeFolder(f"folder {where} is a symbolic link") from None
                raise
            os.close(fd)
            fd = child
            _check_private(os.fstat(fd), f"folder {where}", want_dir=True)
        yield fd
    finally:
        os.close(fd)


def _read_private(dfd: int, entry: str, folder: Path) -> bytes:
    fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        _check_private(os.fstat(fd), f"file {folder / entry}", want_dir=False)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _find_cached(dfd: int, prefix: str, folder: Path) -> str | None:
    """The name of a verified library for `prefix` in the folder; others of that name pattern are removed."""
    for entry in sorted(os.listdir(dfd)):
        if not (entry.startswith(prefix) and entry.endswith(".so")):
            continue
        try:
            if hashlib.sha256(_read_private(dfd, entry, folder)).hexdigest() == entry[len(prefix):-3]:
                return entry
            problem = "its contents do not match the digest in its name"
        except OSError as exc:
            problem = _describe(exc)
        logger.warning("not loading cached kernel %s (%s); removing it", folder / entry, problem)
        try:
            os.unlink(entry, dir_fd=dfd)
        except OSError:
            pass
    return None


def _install(dfd: int, prefix: str, data: bytes) -> str:
    """Write `data` into the folder under its digest name, atomically; the name written."""
    final = f"{prefix}{hashlib.sha256(data).hexdigest()}.so"
    # a dot name never matches a cache prefix, so a half-written file is never taken for a library
    partial = f".{final}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700,
                 dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, final, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(partial, dir_fd=dfd)
        except OSError:
            pass
        raise
    return final


def _dlopen(dfd: int, entry: str, folder: Path) -> ctypes.CDLL:
    """Load `entry` through the checked folder's descriptor: the path's folders may change, that one cannot.

    glibc takes an already-loaded library by name; the name ends in the file's digest, so a
    match is the same bytes even when a descriptor number is reused.
    """
    through_fd = f"/proc/self/fd/{dfd}"
    path = f"{through_fd}/{entry}" if os.path.isdir(through_fd) else str(folder / entry)
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise KernelUnavailable(LOAD_FAILED, f"cannot load {folder / entry}: {exc}") from exc


def _describe(exc: OSError) -> str:
    if isinstance(exc, UnsafeFolder) or exc.errno is None:
        return str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}{where}"


def _ensure_cached(dfd: int, name: str, cc: str, folder: Path, prefix: str, built: list[bytes],
                   defines: tuple[str, ...] = ()) -> str:
    entry = _find_cached(dfd, prefix, folder)
    if entry is None:
        if not built:
            built.append(_compile(name, cc, defines))
        entry = _install(dfd, prefix, built[0])
    return entry


def build(name: str, cc: str, out_dir: Path) -> Path:
    """Compile `<name>.c` into out_dir unless a verified copy is there, and return the library's path.

    Raises UnsafeFolder / OSError where out_dir cannot be used, KernelUnavailable where the build fails.
    """
    folder = Path(os.path.abspath(out_dir))
    prefix = f"{name}-{cache_key(name, cc)}-"
    with _private_folder(folder) as dfd:
        return folder / _ensure_cached(dfd, name, cc, folder, prefix, [])


def _open_library(name: str, cc: str, out_dir: Path,
                  defines: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, str, str | None]:
    """(library, file loaded, why out_dir was passed over or None); raises KernelUnavailable."""
    folder = Path(os.path.abspath(out_dir))
    prefix = f"{name}-{cache_key(name, cc, defines)}-"
    built: list[bytes] = []          # compiled once, even where the cache folder fails after compiling
    try:
        with _private_folder(folder) as dfd:
            entry = _ensure_cached(dfd, name, cc, folder, prefix, built, defines)
            return _dlopen(dfd, entry, folder), str(folder / entry), None
    except OSError as exc:
        note = f"cache folder {folder} unusable ({_describe(exc)})"
    _log_once(logging.WARNING, f"kernel {note}: building in a private temp folder instead")
    if not built:
        built.append(_compile(name, cc, defines))
    try:
        temp = Path(tempfile.mkdtemp(prefix="prefixserve-kernels-"))
    except OSError as exc:
        raise KernelUnavailable(NO_PRIVATE_FOLDER, f"{note}; no private temp folder either "
                                                   f"({_describe(exc)})") from exc
    try:
        with _private_folder(temp) as dfd:
            entry = _install(dfd, prefix, built[0])
            return _dlopen(dfd, entry, temp), str(temp / entry), note
    except OSError as exc:
        raise KernelUnavailable(NO_PRIVATE_FOLDER, f"{note}; temp folder {temp} unusable too "
                                                   f"({_describe(exc)})") from exc
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def try_load_kernel(name: str, cc: str | None, out_dir: Path, wrap: Callable[[ctypes.CDLL], K],
                    probe: Callable[[K], bool], needs_avx512: bool = False,
                    defines: tuple[str, ...] = ()) -> tuple[K | None, KernelStatus]:
    """Build, load and wrap kernel `name`, and check it against torch with `probe`: (kernel or None, status).
    needs_avx512: the kernel is nothing but AVX-512 multiply-adds (not even its probe runs without).
    defines: macros to build the source with (`compile_flags`), a variant cached apart from the plain build.

    Never raises for a kernel's sake; every inactive outcome but an unsupported CPU is logged.
    """
    if not cpu_supported():
        return None, KernelStatus(name, False, NO_AVX2,
                                  f"CPU capability {torch.backends.cpu.get_cpu_capability()}, not AVX2")
    if needs_avx512 and best_isa() == AVX2:
        return None, KernelStatus(name, False, NO_AVX512,
                                  f"CPU capability {torch.backends.cpu.get_cpu_capability()}, not AVX-512")
    if cc is None:
        kernel, status = None, KernelStatus(name, False, NO_COMPILER, "no C compiler found ($CC, cc or gcc)")
    else:
        try:
            kernel, status = _load_checked(name, cc, out_dir, wrap, probe, defines)
        except Exception as exc:  # noqa: BLE001 - a kernel must never stop start-up
            kernel, status = None, KernelStatus(name, False, LOAD_FAILED, f"unexpected error: {exc!r}")
    if kernel is None:
        logger.warning("%s kernel unavailable (%s), falling back to torch (slower): %s",
                       name, status.reason, status.detail)
    return kernel, status


def _load_checked(name: str, cc: str, out_dir: Path, wrap: Callable[[ctypes.CDLL], K],
                  probe: Callable[[K], bool], defines: tuple[str, ...] = ()) -> tuple[K | None, KernelStatus]:
    try:
        library, path, note = _open_library(name, cc, out_dir, defines)
    except KernelUnavailable as exc:
        return None, KernelStatus(name, False, exc.reason, exc.detail)
    try:
        kernel = wrap(library)
    except AttributeError as exc:
        return None, KernelStatus(name, False, MISSING_SYMBOL, f"{path} lacks an expected function: {exc}",
                                  path, note)
    except Exception as exc:  # noqa: BLE001
        return None, KernelStatus(name, False, LOAD_FAILED, f"wrapping {path} raised {exc!r}", path, note)
    try:
        agrees = bool(probe(kernel))
    except Exception as exc:  # noqa: BLE001
        return None, KernelStatus(name, False, PROBE_FAILED, f"the probe against torch raised {exc!r}", path, note)
    if not agrees:
        return None, KernelStatus(name, False, PROBE_FAILED, "disagrees with torch on a probe", path, note)
    where = "a private temp folder (removed once loaded)" if note else "the cache folder"
    return kernel, KernelStatus(name, True, None, f"loaded from {where}", path, note)


def load_kernel(name: str, cc: str | None, out_dir: Path, wrap: Callable[[ctypes.CDLL], K],
                probe: Callable[[K], bool], needs_avx512: bool = False, defines: tuple[str, ...] = ()) -> K | None:
    """Build, load and wrap kernel `name`, and check it against torch with `probe`; None where any step fails."""
    return try_load_kernel(name, cc, out_dir, wrap, probe, needs_avx512, defines)[0]


_statuses: dict[str, KernelStatus] = {}


def load_default(name: str, wrap: Callable[[ctypes.CDLL], K], probe: Callable[[K], bool],
                 needs_avx512: bool = False) -> K | None:
    """The process's kernel `name` from the user's cache folder, its status recorded for `kernel_status`."""
    if turned_off():
        kernel, status = None, KernelStatus(name, False, DISABLED, "turned off by PREFIXSERVE_NATIVE_KERNELS=0")
    else:
        kernel, status = try_load_kernel(name, compiler(), cache_dir(), wrap, probe, needs_avx512)
    _statuses[name] = status
    return kernel


def kernel_status(name: str) -> KernelStatus | None:
    """The outcome of the last `load_default(name, ...)` in this process; None before the first."""
    return _statuses.get(name)
