"""The project's C kernels for x86 CPUs with AVX2, each a plain C file with a ctypes wrapper.

`build.py` compiles a kernel on first use into a private folder of the user's cache (or a
private temp folder) and loads it only after checking that no other user could have written
it; where that is not possible (no AVX2, no C compiler, `PREFIXSERVE_NATIVE_KERNELS=0`, a
failed build or probe) the wrapper's loader returns None and callers keep their torch path.
`report.py` says which kernels are active and why the others are not, and loads them all
at start-up (`load_all()`).
"""
