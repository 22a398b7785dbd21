"""GPU experiments on the decode kernels: the stage-2 merge and the CUDA history kernel under ncu."""
