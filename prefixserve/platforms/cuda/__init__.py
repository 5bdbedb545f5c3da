"""The CUDA platform: Triton kernels for paged attention and the fused pointwise ops, GEMMs through torch.

Triton is imported only when a kernel is first needed (triton_runtime.py), so the package imports where
Triton is not installed. The same kernels run on CPU tensors under Triton's interpreter, which is how CI
tests them and how `attention_backend="triton"` runs on device="cpu" (slowly, for tests).
"""
