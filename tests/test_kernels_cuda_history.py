"""The CUDA history kernel (`oscar_hf/kernels/cuda/history_partials.cu`).

On CPU: its source compiles (NVRTC, when libnvrtc is installed: `pip install nvidia-cuda-nvrtc`) for sm_80 and
sm_90 without spilling registers, and its split rule. On a CUDA device: decode steps through it against the Triton
kernel and the reference (same tolerances as tests/test_kernels_attention.py), pinned histories, graph capture.
"""

import ctypes
import os
import re
import subprocess
import tempfile
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels need triton")

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.history import QuantizedHistory  # noqa: E402
from oscar_hf.kernels.cuda import history as cuda_history  # noqa: E402
from oscar_hf.kernels.cuda import nvrtc  # noqa: E402
from oscar_hf.kernels.reference.backend import ReferenceBackend  # noqa: E402
from oscar_hf.kernels.triton.launch_plan import SplitPlan  # noqa: E402

from conftest import poisoned_output_backend  # noqa: E402

ON_GPU = torch.cuda.is_available()


def _nvrtc_missing() -> bool:
    try:
        nvrtc.load_nvrtc()
    except OSError:
        return True
    return False


def _resources(cubin: bytes) -> dict[str, dict[str, int]]:
    """Per kernel: registers, stack and local bytes (`cuobjdump -res-usage`, Triton's bundled copy)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = re.findall(r"Function (\w+):\s+REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return {name: dict(registers=int(r), stack=int(s), local=int(lo)) for name, r, s, lo in found}


@pytest.mark.skipif(_nvrtc_missing(), reason="needs libnvrtc (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", [pytest.param(80, marks=pytest.mark.quick), 90])
@pytest.mark.parametrize("config", [cuda_history.CudaHistoryConfig(),
                                    cuda_history.CudaHistoryConfig(stages=5, magic_planes=0)])
@pytest.mark.parametrize("bits", cuda_history.CODE_BITS + (cuda_history.RUNS,))
def test_source_compiles_without_spills(arch, config, bits):
    """Each module: the kernels of 2-bit codes, of 4-bit codes, and of runs of both (`RUNS`)."""
    resources = _resources(cuda_history.compile_cubin(arch, config, bits))
    assert set(resources) == {cuda_history.kernel_name(d, r, pairs, bits) for d in (64, 128) for r in (4, 8)
                              for pairs in (torch.float16, torch.uint8)}
    for name, r in resources.items():
        assert r["stack"] == 0 and r["local"] == 0, f"{name} spills: {r}"
        assert r["registers"] * 32 * config.min_warps_per_sm <= 65536, f"{name}: {r['registers']} registers"


def _declarations(text: str) -> list[tuple[str, str]]:
    """(name, C type without `const` or spaces) of each `type name` of a comma- or semicolon-separated list."""
    found = []
    for declaration in re.split(r"[,;]", text):
        if declaration.strip():
            declared_type, name = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", declaration).groups()
            found.append((name, re.sub(r"\bconst\b|\s", "", declared_type)))
    return found


def _kernel_parameters(source: str, macro: str) -> list[tuple[str, str]]:
    """The parameters of the `extern "C" __global__` kernel signature in the source's macro `macro` (which every
    kernel of its kind instantiates)."""
    text = source.replace("\\\n", " ")
    body = text[text.index(f"#define {macro}("):]
    signature = re.search(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?\w+\(([^)]*)\)', body)
    return _declarations(signature.group(1))


def _ctypes_of(declared: list[tuple[str, str]], structs: dict) -> list[tuple[str, type]]:
    ctype_of = {"int": ctypes.c_int, "float": ctypes.c_float, **structs}
    return [(name, ctypes.c_void_p if c_type.endswith("*") else ctype_of[c_type]) for name, c_type in declared]


@pytest.mark.quick
def test_launch_arguments_match_the_kernel_signature_in_name_type_and_order():
    with open(cuda_history.SOURCE) as f:
        source = f.read()
    declared = _kernel_parameters(source, "HISTORY_KERNEL")
    expected = _ctypes_of(declared, {})
    assert list(cuda_history.PARAMETERS) == expected
    assert list(cuda_history.ARG_TYPES) == [ctype for _, ctype in expected]
    # the kernels of runs, and the struct they take by value, field for field
    assert list(cuda_history.RUNS_PARAMETERS) == _ctypes_of(_kernel_parameters(source, "HISTORY_RUNS_KERNEL"),
                                                           {"HistoryRuns": cuda_history.HistoryRuns})
    fields = []  # `type a, b, c;` declares three fields of one type
    for statement in re.search(r"struct HistoryRun \{([^}]*)\}", source).group(1).split(";"):
        if statement.strip():
            (first, c_type), *more = _declarations(statement)
            fields += [(first, c_type)] + [(name, c_type) for name, _ in more]
    assert cuda_history.HistoryRun._fields_ == _ctypes_of(fields, {})
    assert re.search(r"#define MAX_RUNS (\d+)", source).group(1) == str(cuda_history.MAX_RUNS)
    values = {name: i for i, (name, _) in enumerate(declared)}
    assert cuda_history.kernel_arguments(**values) == list(range(len(declared)))
    with pytest.raises(TypeError, match="'wait_at_end' has no value"):
        cuda_history.kernel_arguments(**{k: v for k, v in values.items() if k != "wait_at_end"})
    with pytest.raises(TypeError, match="no parameters \\['stride'\\]"):
        cuda_history.kernel_arguments(**values, stride=1)


@pytest.mark.quick
def test_history_plan_cuts_whole_tiles_and_fills_one_wave():
    base = SplitPlan(8, 1, 128, 2, 192, 9, 512)
    config = cuda_history.CudaHistoryConfig()
    for tokens in (1, 63, 64, 65, 5000, 100_000):
        for rows in (8, 64, 256):
            plan = cuda_history.plan_history(base, tokens, rows, 1056, config)
            assert (plan.dense_splits, plan.dense_split_len) == (2, 192)
            assert plan.block_n_history == 64 and plan.history_split_len % 64 == 0
            assert plan.history_splits * plan.history_split_len >= tokens
            assert (plan.history_splits - 1) * plan.history_split_len < tokens
            assert rows * plan.history_splits <= max(1056, rows)  # never a partial second wave
            assert plan.history_splits <= config.max_splits
    assert cuda_history.plan_history(base, 100_000, 64, 1056, config).history_splits == 16
    assert cuda_history.plan_history(base, 0, 64, 1056, config).history_splits == 0


@pytest.mark.quick
def test_cpu_calls_do_not_qualify():
    history = QuantizedHistory(1, 2, 64, 64, OscarConfig(), torch.device("cpu"))
    history.append(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), None, None, ReferenceBackend())
    assert not cuda_history.history_kernel_supports(torch.zeros(1, 4, 1, 64), history.kernel_view(), None, None, 2)


@pytest.mark.parametrize("tokens", [1, 3001, 4095])
def test_compact_pairs_of_every_history_start_on_a_word(tokens):
    """The kernel stages each KV head's compact pairs 4 bytes at a time: a history of any length (first appends
    and growth) keeps its heads' pairs word-aligned, so compact histories qualify like float16 ones."""
    history = QuantizedHistory(2, 3, 64, 64, OscarConfig(scale_dtype="compact"), torch.device("cpu"))
    for _ in range(2):
        history.append(torch.randn(2, 3, tokens, 64), torch.randn(2, 3, tokens, 64), None, None, ReferenceBackend())
        view = history.kernel_view()
        assert view.key_scale_zero.dtype == torch.uint8
        assert cuda_history._code_layout_ok(view), f"capacity {history.capacity}"
    # pairs of an odd capacity: every other KV head's pairs start mid-word
    odd = torch.zeros(2, 3, history.capacity + 1, 2, dtype=torch.uint8)
    assert not cuda_history._code_layout_ok(replace(view, key_scale_zero=odd))


# ------------------------------------------------------------------------------------------ on the GPU
gpu = pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel needs a CUDA device")
BATCH, KV_HEADS, HISTORY, DENSE, SINK = 3, 8, 5000, 330, 5
ALWAYS = cuda_history.CudaHistoryConfig(min_history_bytes=0)  # these small calls too


# oscar-next's 2-bit rows: sigma codes, compact (one-byte) pairs
COMPACT = OscarConfig(scale_dtype="compact", encoder="sigma")
FOUR_BITS = OscarConfig(bits=4)
FOUR_BITS_COMPACT = OscarConfig(bits=4, scale_dtype="compact", encoder="sigma")


def _case(dim, groups, q_len, per_head, tokens=HISTORY, config=OscarConfig()):
    device = torch.device("cuda")
    shape = (KV_HEADS, dim, dim) if per_head else (dim, dim)
    rotations = [torch.linalg.qr(torch.randn(shape, dtype=torch.float64))[0].float().to(device) for _ in range(2)]
    history = QuantizedHistory(BATCH, KV_HEADS, dim, dim, config, device)
    keys = (torch.randn(BATCH, KV_HEADS, tokens, dim, device=device) * 1.5).bfloat16()
    values = torch.randn(BATCH, KV_HEADS, tokens, dim, device=device).bfloat16()
    history.append(keys, values, *rotations, ReferenceBackend())
    query = (torch.randn(BATCH, KV_HEADS * groups, q_len, dim, device=device) * 1.5).bfloat16()
    dense = [torch.randn(BATCH, KV_HEADS, DENSE + q_len, dim, device=device).bfloat16() for _ in range(2)]
    return rotations, history, query, dense


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@gpu
@pytest.mark.parametrize("dim,groups,q_len,per_head,config,tokens", [
    (128, 4, 1, False, OscarConfig(), HISTORY), (64, 4, 1, True, OscarConfig(), HISTORY),
    (128, 2, 3, False, OscarConfig(), HISTORY), (128, 8, 1, True, OscarConfig(), HISTORY),
    (64, 1, 1, False, OscarConfig(), HISTORY), (128, 2, 2, True, OscarConfig(), HISTORY),
    (64, 3, 1, False, OscarConfig(), HISTORY),
    # compact pairs: both row variants, both head_dims; odd lengths end in a partial tile whose last word holds
    # one token
    (128, 4, 1, False, COMPACT, HISTORY + 1), (128, 8, 1, True, COMPACT, HISTORY - 3),
    (64, 4, 1, True, COMPACT, HISTORY + 7), (64, 2, 3, False, COMPACT, HISTORY),
    # 4-bit codes (the high-precision KV heads of oscar-next's split layers, oscar-mixed's 4-bit layers)
    (128, 4, 1, False, FOUR_BITS, HISTORY), (128, 8, 1, True, FOUR_BITS, HISTORY + 1),
    (64, 4, 1, True, FOUR_BITS, HISTORY - 3), (64, 2, 3, False, FOUR_BITS, HISTORY + 7),
    (128, 4, 1, True, FOUR_BITS_COMPACT, HISTORY - 1), (64, 8, 1, False, FOUR_BITS_COMPACT, HISTORY)])
def test_decode_step_matches_triton_and_reference(dim, groups, q_len, per_head, config, tokens, monkeypatch):
    """Up to 4 rows per KV head run the narrow-rows kernel, 5-8 the other; float16 and compact pairs; 2- and 4-bit
    codes."""
    _check_decode_step(dim, groups, q_len, per_head, config, tokens, ALWAYS, monkeypatch)


@gpu
def test_a_kernel_staging_more_than_48_kib_launches(monkeypatch):
    """6 stages of 4-bit d=128 tiles (8,704 bytes each) need more dynamic shared memory than a launch gets
    unasked: the kernel asks for it when it loads."""
    stages = replace(ALWAYS, stages=5)
    assert (stages.stages + 1) * cuda_history.stage_bytes(128, 4) > 48 << 10
    _check_decode_step(128, 4, 1, False, FOUR_BITS, HISTORY, stages, monkeypatch)


def _check_decode_step(dim, groups, q_len, per_head, config, tokens, cuda_config, monkeypatch):
    rotations, history, query, (keys, values) = _case(dim, groups, q_len, per_head, tokens, config)
    assert history.key_scale_zero.dtype == (torch.uint8 if config.scale_dtype == torch.uint8 else torch.float16)
    history = history.kernel_view()
    calls = []
    launch = cuda_history.history_partials
    monkeypatch.setattr(cuda_history, "history_partials", lambda *a, **k: calls.append(1) or launch(*a, **k))
    scaling = dim**-0.5
    outs = []
    for enabled in (True, False):
        backend = poisoned_output_backend(cuda_history=enabled, cuda_history_config=cuda_config, compile_threads=0)
        outs.append(backend.tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling))
    assert len(calls) == 1, "the CUDA kernel did not run"
    ref = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, scaling)
    assert torch.isfinite(outs[0]).all()
    assert _relative(outs[0], outs[1]) < 2e-3
    assert _relative(outs[0], ref) < 1.5e-2


@gpu
@pytest.mark.parametrize("high_heads,rows", [((3,), 4), ((0, 7), 8), ((1, 2), 4)])
def test_one_launch_over_runs_writes_the_partials_of_a_launch_per_run(high_heads, rows):
    """`history_runs_partials` (every run of a split layer in one launch) against `history_partials` run by run:
    the same partials, bit for bit, where each run has its own splits and the buffers hold the most of them."""
    from oscar_hf.history import HeadSplitHistory
    from oscar_hf.kernels.triton.launch_plan import plan_runs

    config = replace(COMPACT, key_clip_ratio=None, value_clip_ratio=None,
                     high_precision_heads=tuple((0, h) for h in high_heads))
    history = HeadSplitHistory(BATCH, KV_HEADS, 128, 128, config, torch.device("cuda"))
    kv = [torch.randn(BATCH, KV_HEADS, HISTORY + 3, 128, device="cuda").bfloat16() for _ in range(2)]
    rotations = [torch.linalg.qr(torch.randn(KV_HEADS, 128, 128, dtype=torch.float64))[0].float().cuda()
                 for _ in range(2)]
    history.append(*kv, *rotations, ReferenceBackend())
    split = history.counted_view(torch.tensor([HISTORY + 3], dtype=torch.int32, device="cuda"))
    assert {r.history.bits for r in split.runs} == {2, 4}
    groups = rows  # one query position
    query = torch.randn(BATCH, KV_HEADS * groups, 1, 128, device="cuda")
    base = cuda_history.plan_history(SplitPlan(8, 1, 64, 3, 128, 0, 64), HISTORY + 3, BATCH * KV_HEADS, 96 * BATCH)
    plans, splits = plan_runs(base, HISTORY + 3, tuple(r.stop - r.start for r in split.runs),
                              tuple(cuda_history.history_bytes(1, 1, 1, 128, r.history.key_scale_zero.dtype,
                                                               r.history.bits) for r in split.runs), 128)
    assert len({p.history_splits for p in plans}) > 1, "the runs should differ in their splits"
    shape = (BATCH, KV_HEADS * groups, 1, splits)
    outs = []
    for one_launch in (True, False):
        out = torch.full((*shape, 128), float("nan"), device="cuda")
        lse = torch.full(shape, float("nan"), device="cuda")
        if one_launch:
            cuda_history.history_runs_partials(query, split.runs, plans, 0.1, KV_HEADS, out, lse, splits, ALWAYS)
        else:
            for run, plan in zip(split.runs, plans):
                heads = slice(run.start * groups, run.stop * groups)
                cuda_history.history_partials(query[:, heads], run.history, plan, 0.1, run.stop - run.start, out,
                                              lse, ALWAYS, head_offset=run.start * groups,
                                              partial_heads=KV_HEADS * groups, partial_splits=splits)
        outs.append((out[..., 3:, :], lse[..., 3:]))  # the dense splits are not the history's
    assert torch.isfinite(outs[0][0]).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
def test_a_split_layer_whose_runs_are_each_under_the_minimum_still_takes_the_cuda_kernel(monkeypatch):
    """The CUDA kernel's minimum history applies to the split layer, not to each run: at batch 1 and 20k tokens a
    one-head 2-bit run holds 1.4 MB, under the default 4 MiB, and the layer 12.2 MB. Every run goes to the one
    launch of runs."""
    from oscar_hf.history import HeadSplitHistory
    from oscar_hf.kernels.interface import DecodeCall, decode_by_runs
    from oscar_hf.kernels.triton.backend import TritonBackend

    tokens, device = 20_000, torch.device("cuda")
    config = replace(COMPACT, high_precision_heads=((0, 1),))
    history = HeadSplitHistory(1, KV_HEADS, 128, 128, config, device)
    rotations = [torch.linalg.qr(torch.randn(KV_HEADS, 128, 128, dtype=torch.float64))[0].float().cuda()
                 for _ in range(2)]
    history.append(*[torch.randn(1, KV_HEADS, tokens, 128, device=device).bfloat16() for _ in range(2)],
                   *rotations, ReferenceBackend())
    split = history.counted_view(torch.tensor([tokens], dtype=torch.int32, device=device))
    small = split.runs[0]
    assert (small.stop - small.start, small.history.bits) == (1, 2)
    assert cuda_history.history_bytes(1, 1, tokens, 128, COMPACT.scale_dtype) < (4 << 20)
    query = torch.randn(1, KV_HEADS * 4, 1, 128, device=device).bfloat16()
    dense = [torch.randn(1, KV_HEADS, DENSE + 1, 128, device=device).bfloat16() for _ in range(2)]
    call = DecodeCall(query, *dense, torch.tensor([DENSE], dtype=torch.int32, device=device), split, *rotations,
                      128**-0.5, None, None, None)
    launches = []
    runs = cuda_history.history_runs_partials
    monkeypatch.setattr(cuda_history, "history_runs_partials", lambda *a, **k: launches.append(1) or runs(*a, **k))
    got = TritonBackend(compile_threads=0).decode_attention(call)
    assert launches == [1]
    want = decode_by_runs(ReferenceBackend().decode_attention, call)
    assert _relative(got, want) < 1.5e-2


@gpu
@pytest.mark.parametrize("config", [OscarConfig(), COMPACT])
def test_history_partials_match_triton_on_a_pinned_history_and_in_a_graph(config):
    """A pinned history (length read from the device, splits cut for the capacity): the CUDA partials equal
    the Triton ones to the kernels' tolerance, also when replayed from a CUDA graph after the history grew."""
    from oscar_hf.kernels.triton.backend import TritonBackend

    rotations, history, query, (keys, values) = _case(128, 4, 1, False, tokens=3001, config=config)
    history.pin(8192)
    scaling = 128**-0.5
    cuda, plain = TritonBackend(cuda_history=True, cuda_history_config=ALWAYS), TritonBackend(cuda_history=False)
    cuda.tiered_attention(query, keys, values, None, history.kernel_view(), SINK, *rotations, scaling)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.tiered_attention(query, keys, values, None, history.kernel_view(), SINK, *rotations, scaling)
    more = torch.randn(BATCH, KV_HEADS, 700, 128, device="cuda").bfloat16()
    history.append(more, more, *rotations, ReferenceBackend())
    graph.replay()
    want = plain.tiered_attention(query, keys, values, None, history.kernel_view(), SINK, *rotations, scaling)
    assert _relative(out, want) < 2e-3


@gpu
def test_unsupported_or_small_calls_fall_back_to_triton(monkeypatch):
    """A softcap, more than 8 rows per KV head, a history under `min_history_bytes`, or 3-bit codes: the Triton
    kernel runs the history."""
    from oscar_hf.kernels.triton.backend import TritonBackend

    rotations, history, query, (keys, values) = _case(128, 4, 3, False)
    history = history.kernel_view()
    monkeypatch.setattr(cuda_history, "history_partials", lambda *a, **k: pytest.fail("CUDA kernel ran"))
    always = TritonBackend(cuda_history_config=ALWAYS)
    always.tiered_attention(query, keys, values, None, history, SINK, *rotations, 0.1)  # 12 rows per KV head
    one, k1, v1 = query[:, :, :1], keys[:, :, :-2], values[:, :, :-2]
    always.tiered_attention(one, k1, v1, None, history, SINK, *rotations, 0.1, softcap=30.0)
    small = TritonBackend(cuda_history_config=replace(cuda_history.CudaHistoryConfig(), min_history_bytes=9 << 20))
    small.tiered_attention(one, k1, v1, None, history, SINK, *rotations, 0.1)  # 8.6 MB of history
    rotations, history, query, (keys, values) = _case(128, 4, 1, False, config=OscarConfig(bits=3))
    history = history.kernel_view()
    out = always.tiered_attention(query, keys, values, None, history, SINK, *rotations, 0.1)
    ref = ReferenceBackend().tiered_attention(query, keys, values, None, history, SINK, *rotations, 0.1)
    assert _relative(out, ref) < 1.5e-2
