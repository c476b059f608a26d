"""The Triton kernels run here through Triton's interpreter, on the CPU.

Triton picks interpreter or compiler form for its own library functions when
`triton.language` is first imported, so the variable is set before anything in
this process imports Triton (the root conftest sets it too, for workers that
collect other folders first). On a CUDA machine these tests still run on CPU
tensors, through the interpreter; the compiled kernels are checked by the gpu
tests.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
