"""GPU experiments on the decode kernels: whole decode calls with the stage-2 merge's launch options varied."""
