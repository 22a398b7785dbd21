"""Which change moves the tokens of tests/test_graph_decode.py::test_captured_graphs_give_the_eager_tokens_on_gpu
(GPU): graphed vs eager vs masked reference, for the current defaults and with each new piece turned off."""
import functools
import sys

import torch

sys.path.insert(0, "tests")
import oscar_hf.kernels.triton.backend as kb  # noqa: E402
import oscar_hf.layer  # noqa: E402
from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.graph_decode import graphed_generate  # noqa: E402
from oscar_hf.kernels.triton.launch_plan import LaunchConfig  # noqa: E402
from test_graph_decode import _left_padded, _reference_tokens, _tiny_qwen3  # noqa: E402

OLD = LaunchConfig(num_warps=2, programs_per_sm=6, block_n_dense=32, block_m=8, token_major=True,
                   fold_key_offsets=True)
real_merge = kb.merge_splits


def use_variant(launch, short, columns):
    """Route every layer to a backend with these settings."""
    backend = kb.TritonBackend(launch=launch, short_splits_on_small_grids=short)
    oscar_hf.layer.backend_for = lambda device, chunk=4096: backend
    kb.merge_splits = real_merge if columns is None else functools.partial(real_merge, column_programs=columns)


def first_diff(a, b):
    d = (a != b).nonzero()
    return "equal" if d.numel() == 0 else f"first differences (row, col): {d[:3].tolist()}"


for dtype in (torch.bfloat16, torch.float32):
    model = _tiny_qwen3(head_dim=128, layers=3, device="cuda").to(dtype)
    ids, mask = _left_padded((3000, 2500, 2950), seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    options = dict(sink_tokens=64, recent_tokens=256, demote_block=8)
    for name, *settings in [("new defaults", None, True, None), ("no short splits", None, False, None),
                            ("merge columns 1", None, True, 1), ("old launch", OLD, True, None),
                            ("all old", OLD, False, 1)]:
        use_variant(*settings)
        eager = graphed_generate(model, ids, OscarCache(model, rotations="hadamard", **options), 120,
                                 attention_mask=mask, use_graphs=False)
        graphed = graphed_generate(model, ids, OscarCache(model, rotations="hadamard", **options), 120,
                                   attention_mask=mask)
        ref, _ = _reference_tokens(model, ids, 120, options, attention_mask=mask, min_new_tokens=120)
        print(f"{dtype} {name}: graphed vs eager {first_diff(graphed, eager)}; graphed vs reference "
              f"{first_diff(graphed, ref)}", flush=True)
