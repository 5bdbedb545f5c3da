"""Building and loading the native kernels safely (`platforms/cpu/native/build.py`) and the kernel report.

Real compilers and real files throughout: libraries planted where another user could have
written them, cache folders that cannot be used, a library without the kernel's functions,
a compiler that hangs. Every case must end in a fresh build or the torch path, never in
loading the planted file or an exception, and the report must name what happened.

These tests run as root here, where permission checks by access() pass for everything:
what is checked is ownership and mode bits, and "unusable" is a file where a folder
should be (which fails for root too).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from native_kernel_build import needs_kernel
from prefixserve.platforms.cpu.native import build, fused_pointwise, packed_gemm, paged_decode_attention, \
    paged_prefill_attention, row_argmax, decode_loop
from prefixserve.platforms.cpu.native import report, small_m_gemm
from prefixserve.platforms.cpu.native.isa import AVX2, best_isa
from prefixserve.platforms.cpu.native.small_m_gemm import SmallMGemm, _agrees_with_torch

NAME = "small_m_gemm"   # the quickest kernel to build
DEFAULTS = (small_m_gemm, packed_gemm, paged_decode_attention, paged_prefill_attention, fused_pointwise, row_argmax,
            decode_loop)
# packed_gemm is made of AVX-512 multiply-adds: elsewhere it is reported as such and nothing of it runs
RUNNABLE = {module.__name__.rsplit(".", 1)[1] for module in DEFAULTS} - (
    set() if best_isa() != AVX2 else {"packed_gemm"})


def reason_here(name: str, reason: str) -> str:
    """`reason` for a kernel this CPU runs; the missing instruction set for one it cannot."""
    return reason if name in RUNNABLE else build.NO_AVX512


@pytest.fixture
def fresh_defaults():
    """The process's default kernels and their statuses forgotten before and after the test."""
    def forget() -> None:
        for module in DEFAULTS:
            module.default_kernel.cache_clear()
        build._statuses.clear()
    forget()
    yield
    forget()


@pytest.fixture
def private_temp(tmp_path, monkeypatch) -> Path:
    """The system temp folder for this test, to see what the fallback leaves behind (nothing)."""
    temp = tmp_path / "systemp"
    temp.mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    return temp


def try_load(folder: Path, **kw):
    return build.try_load_kernel(NAME, kw.pop("cc", build.compiler()), folder, kw.pop("wrap", SmallMGemm),
                                 kw.pop("probe", _agrees_with_torch))


def compile_impostor(tmp_path: Path) -> bytes:
    """A real shared library that is not the kernel: it lacks `small_m_gemm`."""
    source = tmp_path / "impostor.c"
    source.write_text("int not_the_kernel(void) { return 42; }\n")
    out = tmp_path / "impostor.so"
    subprocess.run([build.compiler(), "-shared", "-fPIC", str(source), "-o", str(out)], check=True)
    return out.read_bytes()


def plant(folder: Path, data: bytes, mode: int = 0o700, digest: str | None = None) -> Path:
    """`data` under the exact name a cached small_m_gemm library has (digest: its own unless given)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = build.cache_key(NAME, build.compiler())
    target = folder / f"{NAME}-{key}-{digest or hashlib.sha256(data).hexdigest()}.so"
    target.write_bytes(data)
    os.chmod(target, mode)
    return target


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_kernel
def test_cache_folders_are_made_private_and_the_file_named_by_its_digest(tmp_path, monkeypatch, fresh_defaults):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = os.umask(0)   # the worst umask: nothing we create may come out writable by others anyway
    try:
        kernel = small_m_gemm.default_kernel()
    finally:
        os.umask(old)
    assert kernel is not None
    for folder in (tmp_path / "cache", tmp_path / "cache" / "prefixserve", build.cache_dir()):
        assert mode_of(folder) == 0o700, folder
    [library] = build.cache_dir().iterdir()
    assert library.name.endswith(f"-{hashlib.sha256(library.read_bytes()).hexdigest()}.so")
    assert mode_of(library) & 0o022 == 0
    status = build.kernel_status(NAME)
    assert status.active and status.library == str(library) and status.note is None


@needs_kernel
def test_a_build_is_announced_and_a_cache_hit_is_not(tmp_path, caplog):
    """A first start spends seconds compiling: one line per kernel says so before each build, and
    a start that finds the library cached says nothing."""
    announced = f"compiling CPU kernel {NAME}"
    with caplog.at_level(logging.INFO, logger=build.__name__):
        first, _ = try_load(tmp_path / "kernels")
        built = [r for r in caplog.records if announced in r.message]
        caplog.clear()
        again, status = try_load(tmp_path / "kernels")
    assert first is not None and again is not None and status.active
    assert [r.levelno for r in built] == [logging.INFO]
    assert not any("compiling" in r.message for r in caplog.records)


@needs_kernel
def test_planted_library_in_a_world_writable_folder_is_not_loaded(tmp_path, private_temp, caplog):
    folder = tmp_path / "kernels"
    planted = plant(folder, compile_impostor(tmp_path))
    os.chmod(folder, 0o777)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        kernel, status = try_load(folder)
    # the impostor lacks the kernel's function: had it been loaded, this would be missing_symbol
    assert kernel is not None and status.active
    assert "writable by group or others (mode 0777)" in status.note
    assert not status.library.startswith(str(folder))
    assert list(folder.iterdir()) == [planted]          # a folder we do not trust is left alone
    assert list(private_temp.iterdir()) == []           # the private temp folder went once loaded
    assert sum("building in a private temp folder" in r.message for r in caplog.records) == 1


@needs_kernel
def test_planted_group_writable_file_is_replaced_by_a_fresh_build(tmp_path, caplog):
    folder = tmp_path / "kernels"
    planted = plant(folder, compile_impostor(tmp_path), mode=0o770)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        kernel, status = try_load(folder)
    assert kernel is not None and status.active and status.note is None
    assert not planted.exists()
    [library] = folder.iterdir()
    assert status.library == str(library) and library != planted
    assert any("writable by group or others" in r.message and "removing it" in r.message for r in caplog.records)


@needs_kernel
def test_a_file_that_does_not_match_its_digest_is_rebuilt(tmp_path):
    """A file swapped in (or cut short) after the build is caught by the digest in its name."""
    folder = tmp_path / "kernels"
    good = build.build(NAME, build.compiler(), folder)
    good.write_bytes(compile_impostor(tmp_path))
    kernel, status = try_load(folder)
    assert kernel is not None and status.active
    [library] = folder.iterdir()
    assert status.library == str(library) and hashlib.sha256(library.read_bytes()).hexdigest() in library.name


@needs_kernel
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_owned_by_another_user_is_not_used(tmp_path, private_temp):
    folder = tmp_path / "kernels"
    plant(folder, compile_impostor(tmp_path))
    os.chown(folder, 65534, 65534)
    kernel, status = try_load(folder)
    assert kernel is not None and status.active and "owned by uid 65534" in status.note


@needs_kernel
def test_a_symlinked_cache_folder_is_not_followed(tmp_path, private_temp):
    elsewhere = tmp_path / "elsewhere"
    plant(elsewhere, compile_impostor(tmp_path))
    (tmp_path / "kernels").symlink_to(elsewhere)
    kernel, status = try_load(tmp_path / "kernels")
    assert kernel is not None and status.active and "symbolic link" in status.note


@needs_kernel
@pytest.mark.parametrize("case", ["cache root is a file", "kernels is a file", "read-only folder"])
def test_an_unusable_cache_folder_falls_back_to_a_temp_folder(case, tmp_path, monkeypatch, private_temp,
                                                               fresh_defaults):
    root = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    if case == "cache root is a file":
        root.write_text("")
    elif case == "kernels is a file":
        build.cache_dir().parent.mkdir(parents=True, mode=0o700)
        build.cache_dir().write_text("")
    else:
        build.cache_dir().mkdir(parents=True, mode=0o700)
        os.chmod(build.cache_dir(), 0o500)   # stops everyone but root from writing
    assert small_m_gemm.default_kernel() is not None
    status = report.kernel_report()[NAME]
    assert status["active"] and status["reason"] is None
    if case != "read-only folder" or os.geteuid() != 0:
        assert "unusable" in status["note"] and "temp folder" in status["detail"]
    assert list(private_temp.iterdir()) == []


@needs_kernel
def test_a_failing_write_into_the_cache_falls_back_without_compiling_twice(tmp_path, monkeypatch, private_temp):
    """ENOSPC (or any OSError) while writing into the cache folder: the library already compiled
    is loaded from a private temp folder instead."""
    real_install, real_compile = build._install, build._compile
    calls = {"install": 0, "compile": 0}

    def full_once(dfd, prefix, data):
        calls["install"] += 1
        if calls["install"] == 1:
            raise OSError(28, "No space left on device")
        return real_install(dfd, prefix, data)

    def counted(name, cc, defines=()):
        calls["compile"] += 1
        return real_compile(name, cc, defines)

    monkeypatch.setattr(build, "_install", full_once)
    monkeypatch.setattr(build, "_compile", counted)
    kernel, status = try_load(tmp_path / "kernels")
    assert kernel is not None and "ENOSPC" in status.note and calls == {"install": 2, "compile": 1}


@needs_kernel
def test_a_library_without_the_kernels_function_falls_back_to_torch(tmp_path, monkeypatch, fresh_defaults):
    """A file of the exact cache name, owned and mode-checked like ours, that is not the kernel."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    build.cache_dir().parent.mkdir(parents=True, mode=0o700)
    planted = plant(build.cache_dir(), compile_impostor(tmp_path))
    os.chmod(build.cache_dir(), 0o700)
    assert small_m_gemm.default_kernel() is None       # no exception
    status = report.kernel_report()[NAME]
    assert status["reason"] == build.MISSING_SYMBOL and not status["active"]
    assert status["library"] == str(planted) and "small_m_gemm" in status["detail"]


@needs_kernel
@pytest.mark.parametrize("outcome", ["disagrees", "raises", "wrapper raises"])
def test_a_failing_probe_falls_back_to_torch(outcome, tmp_path_factory):
    folder = tmp_path_factory.getbasetemp() / "probe-kernels"   # one build for the three cases

    def probe(kernel):
        if outcome == "raises":
            raise RuntimeError("probe blew up")
        return False

    def wrap(library):
        if outcome == "wrapper raises":
            raise ValueError("wrapper blew up")
        return SmallMGemm(library)

    kernel, status = try_load(folder, probe=probe, wrap=wrap)
    assert kernel is None and not status.active
    want = {"disagrees": (build.PROBE_FAILED, "disagrees with torch"),
            "raises": (build.PROBE_FAILED, "probe blew up"),
            "wrapper raises": (build.LOAD_FAILED, "wrapper blew up")}[outcome]
    assert status.reason == want[0] and want[1] in status.detail


def hanging_compiler(tmp_path: Path, answers_version: bool) -> tuple[Path, Path]:
    """A `cc` that sleeps (in a child, as a real compiler driver's children would) and records the child."""
    script, pids = tmp_path / "hanging-cc", tmp_path / "pids"
    version = 'if [ "$1" = --version ]; then echo "hanging-cc 1.0"; exit 0; fi\n' if answers_version else ""
    script.write_text(f"#!/bin/sh\n{version}sleep 600 &\necho $! >> {pids}\nwait\n")
    script.chmod(0o755)
    return script, pids


def gone(pid: int) -> bool:
    """The process has ended (a zombie has: nobody may be left to reap it in a container). Its
    `sleep 600` would still run after this wait: a kill, not the sleep's end, ended one gone sooner."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] in "ZX":
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("hangs_on", ["--version", "compile"])
def test_a_hung_compiler_times_out_and_falls_back_to_torch(hangs_on, tmp_path, monkeypatch, fresh_defaults):
    if not build.cpu_supported():
        pytest.skip("without AVX2 no compiler is run")
    cc, pids = hanging_compiler(tmp_path, answers_version=hangs_on == "compile")
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(build.TIMEOUT_ENV, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = report.load_all()
    # each hanging run records its child: one run hung, the other kernels did not run it again
    # (counted, not timed: a wall-clock bound would race the machine's load)
    assert len(pids.read_text().split()) == 1, "the compiler's timeout is paid once, not once per kernel"
    assert all(entry["reason"] == reason_here(name, build.BUILD_TIMEOUT) and not entry["active"]
               for name, entry in result.items())
    assert "did not finish within 1 s" in result[NAME]["detail"]
    assert all(gone(int(pid)) for pid in pids.read_text().split()), "the compiler's children are killed too"


def test_no_compiler_broken_compiler_and_turned_off_are_reported(tmp_path, monkeypatch, fresh_defaults):
    if not build.cpu_supported():
        pytest.skip("without AVX2 no compiler is looked for")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(empty / "no-such-cc"))
    monkeypatch.setenv("PATH", str(empty))
    assert report.load_all()[NAME]["reason"] == build.NO_COMPILER

    failing = empty / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    small_m_gemm.default_kernel.cache_clear()
    assert small_m_gemm.default_kernel() is None
    entry = report.kernel_report()[NAME]
    assert entry["reason"] == build.BUILD_FAILED and "internal error" in entry["detail"]

    monkeypatch.setenv("PREFIXSERVE_NATIVE_KERNELS", "0")
    for module in DEFAULTS:
        module.default_kernel.cache_clear()
    assert {entry["reason"] for entry in report.load_all().values()} == {build.DISABLED}


def test_a_cpu_without_avx2_is_reported(monkeypatch, fresh_defaults):
    monkeypatch.setattr(build, "cpu_supported", lambda: False)
    assert report.load_all()[NAME]["reason"] == build.NO_AVX2


def test_report_before_any_kernel_is_used(fresh_defaults):
    result = report.kernel_report()
    assert set(result) == {"small_m_gemm", "packed_gemm", "paged_decode_attention", "paged_prefill_attention",
                           "fused_pointwise", "row_argmax", "decode_loop"}
    assert all(entry["reason"] == build.NOT_LOADED and not entry["active"] for entry in result.values())


@needs_kernel
def test_load_all_builds_every_kernel_into_the_cache(tmp_path, monkeypatch, fresh_defaults):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = report.load_all()
    assert all(entry["active"] == (name in RUNNABLE) for name, entry in result.items()), result
    assert result.get("packed_gemm", {}).get("reason") == reason_here("packed_gemm", None)
    assert sorted(p.name.split("-")[0] for p in build.cache_dir().iterdir()) == sorted(RUNNABLE)
    assert report.load_all() == result   # each kernel is built once per process


def test_build_timeout_setting(monkeypatch):
    monkeypatch.delenv(build.TIMEOUT_ENV, raising=False)
    assert build.build_timeout() == build.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(build.TIMEOUT_ENV, "2.5")
    assert build.build_timeout() == 2.5
    monkeypatch.setenv(build.TIMEOUT_ENV, "soon")
    assert build.build_timeout() == build.DEFAULT_TIMEOUT_S


@needs_kernel
def test_a_changed_header_changes_the_cache_key(tmp_path, monkeypatch):
    """Kernels include the folder's headers: editing one must not load a library built from the old one."""
    for name in ("small_m_gemm.c", "simd.h"):
        (tmp_path / name).write_bytes((build.HERE / name).read_bytes())
    monkeypatch.setattr(build, "HERE", tmp_path)
    before = build.cache_key("small_m_gemm", build.compiler())
    (tmp_path / "simd.h").write_bytes((tmp_path / "simd.h").read_bytes() + b"\n/* edited */\n")
    assert build.cache_key("small_m_gemm", build.compiler()) != before
