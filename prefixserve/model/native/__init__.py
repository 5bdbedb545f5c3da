"""The project's C kernels for x86 CPUs with AVX2, each a plain C file with a ctypes wrapper.

`build.py` compiles a kernel on first use into the user's cache folder; where that is not
possible (no AVX2, no C compiler, `PREFIXSERVE_NATIVE_KERNELS=0`) the wrapper's loader
returns None and callers keep their torch path.
"""
