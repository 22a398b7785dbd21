"""What the benchmarks (`bench/`) and the kernel experiments (`experiments/`) share: random-weight models at real
shapes, caches filled with random K/V and the timing of `generate` decode steps through them, one layer's
decode-attention case, CUDA-graph timing, the stage-1 launch candidates, and the offline SASS helpers.

Scripts run from the repository root as `python -m bench.<name>` / `python -m experiments.<folder>.<name>` and
import from here (`from bench.harness import ...`; `from bench import harness` where a script sets `DEVICE` or
`OSCAR_BACKEND`, which the decode helpers read at call time). Triton is imported only by the helpers that need it,
so the decode helpers also run on CPU (`--smoke`) where Triton is missing.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from oscar_hf import OscarCache, use_oscar_attention
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import OscarConfig

try:
    from oscar_hf.history import DECODE_RESERVE, history_capacity
except ImportError:  # a package from before they moved there (bench/gpu_before_after.sh runs today's bench on it)
    from oscar_hf.counted_decode import DECODE_RESERVE, history_capacity
from oscar_hf.history import QuantizedHistory
from oscar_hf.kernels.interface import Backend, DemoteCall
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.parallel import tensor_parallel_position
from oscar_hf.rotations.math import hadamard_matrix

# ---------------------------------------------------------------------------------------------------------- models
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False,
                bos_token_id=151643, eos_token_id=151645)


def random_model(model_class, config, device, dtype=torch.bfloat16, seed: int = 0):
    """`model_class(config)` in eval mode with random weights (seeded), built directly on `device` in `dtype` (no
    float32 copy of billions of weights)."""
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def random_qwen3(options: dict, device, dtype=torch.bfloat16, seed: int = 0):
    """A Qwen3ForCausalLM of `Qwen3Config(**options)` with random weights (`random_model`), padding with EOS."""
    config = Qwen3Config(**options)
    model = random_model(Qwen3ForCausalLM, config, device, dtype, seed)
    model.generation_config.pad_token_id = config.eos_token_id
    return model


def build_model(smoke=False):
    """Random bf16 Qwen3-8B on `DEVICE`; `smoke`: a tiny model of the same family, to check a script on CPU."""
    options = dict(QWEN3_8B)
    if smoke:
        options.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return random_qwen3(options, DEVICE)


# ---------------------------------------------------------------------------------------------------------- decode
GB = 1e9
DEVICE = "cuda"  # where the decode helpers put caches and inputs ("cpu" for --smoke)
OSCAR_BACKEND: Backend | None = None  # the backend of every OscarCache layer; None: `kernels.select.backend_for`
OSCAR_OPTIONS: dict = {}  # OscarConfig fields of every benchmarked OscarCache (e.g. high_precision_layers)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak():
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def allocated():
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def allocations() -> int:
    """Blocks the caching allocator has handed out so far (a CUDA graph's replays take none)."""
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0) if DEVICE == "cuda" else 0


def empty_cache():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def fill_oscar(model, batch, context, chunk=8192, **options):
    """An OscarCache holding `context` random tokens per layer, filled through its own update and demotion path
    (the demotion kernel on CUDA), not a prefill forward: uniform 2-bit rows on Hadamard rotations
    (`method="hadamard"`) unless `options` (more OscarCache options) say otherwise; `method=None`: the default a
    user gets (`oscar-next` on the model's data-free profile)."""
    cache = benchmark_oscar_cache(model, **options)
    heads = model.config.num_key_value_heads // tensor_parallel_position(model)[1]  # this rank's KV heads under TP
    return fill_layers(cache, batch, heads, model.config.head_dim, context, chunk)


def benchmark_oscar_cache(model, **options) -> OscarCache:
    """The benchmarks' empty OscarCache (`fill_oscar`'s defaults, then `OSCAR_OPTIONS`, then `options`)."""
    # compile_decode: these benchmarks time the steady state, so generate compiles from the first call
    options = {"method": "hadamard", "compile_decode": True} | OSCAR_OPTIONS | options
    return OscarCache(model, rotations="hadamard", backend=OSCAR_BACKEND, **options)


def fill_layers(cache, batch, heads, head_dim, context, chunk=8192):
    """`cache` (an OscarCache) with `context` random tokens of `heads` KV heads in every layer (`fill_oscar`)."""
    shape = (batch, heads, chunk, head_dim)
    k = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    for layer in cache.layers:
        done = 0
        while done < context:
            n = min(chunk, context - done)
            layer.update(k[:, :, :n], v[:, :, :n])
            if done == 0:  # one allocation, as a one-shot prefill makes, with the decode reserve
                layer.history.reserve(history_capacity(context, DECODE_RESERVE, layer.config.demote_block))
            layer.settle()
            done += n
    return cache


def _fill_every_layer(cache, model, batch, context):
    """One `update` of `context` random BF16 tokens per layer (a one-shot prefill's K/V); returns `cache`."""
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, device=DEVICE, dtype=torch.bfloat16),
                     torch.randn(shape, device=DEVICE, dtype=torch.bfloat16), i)
    return cache


def fill_dynamic(model, batch, context):
    return _fill_every_layer(DynamicCache(), model, batch, context)


def fill_quanto(model, batch, context):
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=model.config, nbits=2, q_group_size=64, residual_length=128)
    return _fill_every_layer(cache, model, batch, context)


def fill_static(model, batch, context):
    """A StaticCache with room for `context` tokens and the benchmark's decode steps, holding `context` of them."""
    from transformers import StaticCache

    return _fill_every_layer(StaticCache(config=model.config, max_cache_len=context + 64), model, batch, context)


PREFILL_CHUNK = 8192  # the job-throughput rows that prefill through `generate` feed prompts in chunks of this


def fill_by_prefill(model, cache, batch, context, chunk: int = PREFILL_CHUNK):
    """`cache` holding `context` random prompt tokens per sequence, put there by a `generate` call's chunked prefill
    (`prefill_chunk_size=chunk`, one new token), as a job that serves real prompts fills it."""
    ids = torch.randint(10, 1000, (batch, context), device=DEVICE)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   prefill_chunk_size=chunk, **{cache_argument_name(model): cache})
    return cache


def fill_oscar_by_prefill(model, batch, context):
    return fill_by_prefill(model, benchmark_oscar_cache(model), batch, context)


FILLERS = {"oscar": fill_oscar, "oscar-topp": fill_oscar, "oscar-eager": fill_oscar,
           # what OscarCache(model) stores: oscar-next on the model's data-free profile (`oscar_hf.profile`)
           "oscar-default": lambda model, batch, context: fill_oscar(model, batch, context, method=None),
           "oscar-noguards": fill_oscar, "dynamic": fill_dynamic,
           # the prompt prefilled through `generate` in chunks (`fill_by_prefill`): peaks include the prefill's
           "oscar-prefill": fill_oscar_by_prefill,
           "dynamic-prefill": lambda model, batch, context: fill_by_prefill(model, DynamicCache(), batch, context),
           "quanto": fill_quanto, "static": fill_static,
           # oscar-next's row format (sigma rows, compact pairs) with Hadamard rotations, all layers at 2 bits
           "oscar-compact": lambda model, batch, context: fill_oscar(model, batch, context, scale_dtype="compact",
                                                                     encoder="sigma", key_clip_ratio=None,
                                                                     value_clip_ratio=None)}
# how each kind decodes through `generate`: sampling options, and whether generate may compile the step itself
# (it does for caches that say they are compileable, on CUDA: StaticCache, OscarCache)
GENERATE_OPTIONS = {"oscar-topp": dict(do_sample=True, top_p=0.9, temperature=1.0),
                    "oscar-eager": dict(disable_compile=True)}


def _no_guards_options() -> dict:
    """`oscar-noguards`, an experiment: generate's compile with every dynamo guard dropped
    (as `torch.compiler.skip_all_guards_unsafe`; `reduce-overhead` spelled as its option, since torch.compile takes a
    mode or options, not both). Correct only while nothing a guard would check changes, as in this benchmark's
    fixed decode loop: it bounds what guard evaluation costs a step, it is not a setting to ship."""
    from transformers import CompileConfig

    return dict(compile_config=CompileConfig(mode=None, options={
        "triton.cudagraphs": True, "guard_filter_fn": lambda entries: [False] * len(entries)}))


GENERATE_OPTIONS["oscar-noguards"] = _no_guards_options()


def set_attention(model, kind):
    if kind.startswith("oscar"):
        use_oscar_attention(model)
    else:
        model.set_attn_implementation("sdpa")


class StepTimer:
    """A stopping criterion that never stops generation and records when each decode step finished (after a
    device synchronization; `generate` synchronizes every step anyway for its own stopping check)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def decode_step(model, cache, batch, context, warmup=6, steps=16, options=None):
    """((median, mean) ms per decode step, peak bytes, first call's seconds, allocator blocks per step of the timed
    call) over `steps` timed steps of one `generate` call that continues `cache`, after a `warmup`-token call
    (kernel compilation, allocator growth, and where `generate` compiles the step, the compilation and CUDA-graph
    recording: its time is the third value). `options`: more `generate` arguments (sampling). The blocks count
    `generate`'s own per-step tensors too (the grown `input_ids`, the logits it keeps), whatever the cache."""
    from transformers import StoppingCriteriaList

    name = cache_argument_name(model)
    reset_peak()
    result = first_call = None
    for n, timed in ((warmup, False), (steps + 1, True)):
        start_len = int(cache.get_seq_length())
        ids = torch.randint(10, 1000, (batch, start_len + 1), device=DEVICE)
        timer = StepTimer()
        sync()
        blocks = allocations()
        began = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       **({"do_sample": False} | (options or {})), stopping_criteria=StoppingCriteriaList([timer]),
                       **{name: cache})
        sync()
        if timed:
            deltas = sorted(b - a for a, b in zip(timer.times, timer.times[1:]))
            result = (1e3 * deltas[len(deltas) // 2], 1e3 * sum(deltas) / len(deltas))
            per_step = (allocations() - blocks) / n
        else:
            first_call = time.perf_counter() - began
        del ids
    return result, peak(), first_call, per_step


def measure(model, kind, batch, context):
    """One row: a `kind` cache (a key of `FILLERS`) filled to `context` tokens at `batch`, then its decode steps."""
    set_attention(model, kind)
    torch._dynamo.reset()  # every row compiles afresh, as in a process of its own
    model.__dict__.pop("_compiled_call", None)
    empty_cache()
    base = allocated()
    reset_peak()
    t0 = time.perf_counter()
    cache = FILLERS[kind](model, batch, context)
    sync()
    fill_s = time.perf_counter() - t0
    fill_peak = peak()
    held = allocated() - base
    (step_ms, mean_ms), peak_bytes, first_s, blocks = decode_step(model, cache, batch, context,
                                                                  options=GENERATE_OPTIONS.get(kind))
    row = dict(cache=kind, context=context, batch=batch, step_ms=step_ms, mean_step_ms=mean_ms,
               tokens_per_s=batch / step_ms * 1e3, peak_GB=peak_bytes / GB, cache_GB=held / GB, fill_s=fill_s,
               first_call_s=first_s, allocations_per_step=blocks, weights_GB=base / GB, fill_peak_GB=fill_peak / GB)
    if kind.endswith("-prefill"):  # a job's sequences must get through their prompt too
        row["peak_GB"] = max(row["peak_GB"], row["fill_peak_GB"])
    del cache
    empty_cache()
    return row


def safe_measure(model, kind, batch, context):
    """`measure`, or a row with an "error" (out of memory, or any other exception) instead of its times."""
    try:
        return measure(model, kind, batch, context)
    except torch.OutOfMemoryError:
        empty_cache()
        return dict(cache=kind, context=context, batch=batch, error="OOM")
    except Exception as exc:
        empty_cache()
        return dict(cache=kind, context=context, batch=batch, error=f"{type(exc).__name__}: {exc}"[:300])


# ---------------------------------------------------------------------------------------------------------- attention
Q_HEADS, KV_HEADS, SINK, RECENT = 32, 8, 64, 256  # Qwen3-8B's heads; OscarConfig's default tiers


def graphed(fn):
    """`fn` captured in a CUDA graph (after a warm-up call): replaying it times the GPU work without the host's
    launch overhead."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Case:
    """Random BF16 K/V of one decode layer and its OSCAR tiers: `SINK` + `RECENT` + 1 new token in BF16, the rest
    demoted to a `bits`-bit history by `backend` (Hadamard rotations, the default clip ratios)."""

    def __init__(self, batch: int, context: int, dim: int, backend: Backend, bits: int = 2):
        dev = torch.device(DEVICE)
        self.batch, self.context, self.dim = batch, context, dim
        self.query = torch.randn(batch, Q_HEADS, 1, dim, device=dev, dtype=torch.bfloat16)
        self.keys = torch.randn(batch, KV_HEADS, context, dim, device=dev, dtype=torch.bfloat16)
        self.values = torch.randn(batch, KV_HEADS, context, dim, device=dev, dtype=torch.bfloat16)
        self.rotation = hadamard_matrix(dim, torch.float32).to(dev)
        dense = SINK + RECENT + 1
        self.history_len = context - dense
        idx = torch.cat([torch.arange(SINK), torch.arange(SINK + self.history_len, context)]).to(dev)
        self.dense_keys = self.keys.index_select(2, idx).contiguous()
        self.dense_values = self.values.index_select(2, idx).contiguous()
        self.history = QuantizedHistory(batch, KV_HEADS, dim, dim, OscarConfig(bits=bits), dev)
        self.history._reserve(self.history_len)
        mid = slice(SINK, SINK + self.history_len)
        h = self.history
        self.demotion = DemoteCall(self.keys[:, :, mid], self.values[:, :, mid], self.rotation, self.rotation, 0.96,
                                   0.92, bits, "minmax", h.key_codes[:, :, : self.history_len],
                                   h.key_scale_zero[:, :, : self.history_len], h.value_codes[:, :, : self.history_len],
                                   h.value_scale_zero[:, :, : self.history_len])
        backend.demote_kv(self.demotion)
        self.history.length = self.history_len
        self.tensors = self.history.kernel_view()  # what the backends read

    def oscar(self, backend, key_rotation=True):
        """The decode attention call; `key_rotation=False` leaves R_K out (a timing probe, not the same output)."""
        return backend.tiered_attention(self.query, self.dense_keys, self.dense_values, None, self.tensors, SINK,
                                        self.rotation if key_rotation else None, self.rotation, self.dim**-0.5)

    def oscar_folded(self, backend):
        """The call of a model whose value rotation is folded into v_proj/o_proj (`fold_value_rotation=True`): the
        BF16 tiers hold `v @ R_V` (the history holds the same codes either way) and no R_Vᵀ is applied; its output
        times R_Vᵀ is `oscar`'s (o_proj does that product for free)."""
        if getattr(self, "_folded_values", None) is None:
            self._folded_values = (self.dense_values.float() @ self.rotation).to(self.dense_values.dtype)
        return backend.tiered_attention(self.query, self.dense_keys, self._folded_values, None, self.tensors, SINK,
                                        self.rotation, None, self.dim**-0.5)

    def reference(self):
        """The reference backend's output over the same tiers (float32 dequantization), computed once."""
        if getattr(self, "_reference", None) is None:
            self._reference = ReferenceBackend().tiered_attention(
                self.query, self.dense_keys, self.dense_values, None, self.tensors, SINK, self.rotation,
                self.rotation, self.dim**-0.5).float()
        return self._reference

    def sdpa(self):
        return F.scaled_dot_product_attention(self.query, self.keys, self.values, scale=self.dim**-0.5,
                                              enable_gqa=True)

    def dense_triton(self, backend):
        return backend.dense_attention(self.query, self.dense_keys, self.dense_values, None, self.dim**-0.5)

    def dense_torch(self):
        groups = Q_HEADS // KV_HEADS
        k = self.dense_keys.repeat_interleave(groups, dim=1)
        v = self.dense_values.repeat_interleave(groups, dim=1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(self.query, k, v, None, True,
                                                                      scale=self.dim**-0.5)[:2]

    def bytes_history(self) -> int:
        """Bytes of the history a call must read: codes and (scale, zero) of K and V for every row."""
        return self.history.nbytes()

    def bytes_dense(self) -> int:
        return self.batch * KV_HEADS * (SINK + RECENT + 1) * self.dim * 2 * 2

    def bytes_sdpa(self) -> int:
        return self.batch * KV_HEADS * self.context * self.dim * 2 * 2


# Stage-1 launch candidates per head_dim (`python -m bench.attention --sweep` times them, `python -m
# bench.compile_stage1 --sweep` compiles them), as LaunchConfig fields: history tile, warps, stages, programs per
# SM, dense tile, orientation, fold. The default first, then neighbours. The one-warp 64-token tiles at d=128 keep
# each warp's share of a tile (64 tokens) but reduce the softmax within the warp (no barrier per tile); 16-key dense
# tiles keep their shared memory (18 KB) from capping the programs per SM. With the query rotated once per call the
# default takes 240 registers (8 resident); 32-token tiles take 168 (12 resident) for 12% more instructions per
# token (`python -m bench.compile_stage1 --loops`).
def _cfg(tile, warps, stages, programs, dense=32, token_major=False, block_m=16, fold=False, regs=None,
         min_history=512):
    return dict(block_n_history=tile, num_warps=warps, num_stages=stages, programs_per_sm=programs,
                block_n_dense=dense, token_major=token_major, block_m=block_m, fold_key_offsets=fold,
                max_registers=regs, min_history_tokens=min_history)


SWEEP_CONFIGS = {
    128: [_cfg(64, 1, 3, 20, dense=16, token_major=True, block_m=8, fold=True, min_history=256),
          _cfg(64, 1, 3, 30, dense=16, token_major=True, block_m=8, fold=True, min_history=256),
          _cfg(64, 1, 2, 20, dense=16, token_major=True, block_m=8, fold=True, min_history=256),
          _cfg(32, 1, 3, 24, dense=16, token_major=True, block_m=8, fold=True, min_history=256),
          _cfg(32, 1, 3, 36, dense=16, token_major=True, block_m=8, fold=True, min_history=256)],
    64: [_cfg(128, 1, 3, 24, token_major=True, block_m=8, fold=True),
         _cfg(64, 1, 3, 28, dense=16, token_major=True, block_m=8, fold=True),
         _cfg(64, 1, 3, 40, dense=16, token_major=True, block_m=8, fold=True)],
}


# ---------------------------------------------------------------------------------------------------------- SASS
REGISTERS_PER_SM, SHARED_PER_SM, MAX_BLOCKS = 65536, 232448, 32  # an H200 (sm_90) multiprocessor's limits


def disassemble_cubin(cubin: bytes) -> tuple[str, str]:
    """`cuobjdump -res-usage` and `-sass` of a CUBIN (Triton's bundled cuobjdump; no GPU needed)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return tuple(subprocess.run([os.path.join(bin_dir, "cuobjdump"), flag, f.name], capture_output=True,
                                    text=True, check=True).stdout for flag in ("-res-usage", "-sass"))
    finally:
        os.unlink(f.name)


def loop_mixes(sass: str) -> list[tuple[int, dict]]:
    """Every loop of a kernel's SASS text (a backward branch and what it jumps over): instruction count and the
    most common opcodes. The decode kernel has two: the dense tier's and the history's (the longer one)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", sass)]
    loops = []
    for address, text in code:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            ops: dict[str, int] = {}
            for a, t in code:
                if int(target.group(1), 16) <= a <= address:
                    op = re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0].split(".")[0]
                    ops[op] = ops.get(op, 0) + 1
            loops.append((sum(ops.values()), dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])))
    return loops
