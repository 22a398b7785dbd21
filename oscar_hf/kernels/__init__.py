"""Kernel backends of the cache: the operations they offer (`interface`), the choice per device (`select`), the
PyTorch reference that defines the semantics (`reference`), Triton kernels (`triton`) and the hand-written CUDA
history kernel (`cuda`). Nothing here imports the cache."""
