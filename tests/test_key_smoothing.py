"""Per-channel key smoothing (`Rotations(key_smoothing=...)`, `oscar_hf.calibrate.smoothing`): keys stored as
`(k / s) @ R`, the query rotated by `(q * s) @ R`. Without quantization the cache's logits do not change; with it,
the real cache and the decode-equivalent simulation agree; the scales round-trip through the rotation file and
are checked when loaded; the calibration measures them from the model's keys and queries."""

from __future__ import annotations

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.calibrate.smoothing import key_smoothing
from oscar_hf.eval.decode_equivalent import simulate_logits
from oscar_hf.rotations.io import RotationFileError
from oscar_hf.rotations.rotations import Rotations

from conftest import tiny_llama
from test_simulate import LAYOUT, cached_logits


def _smoothed(model, spread: float = 4.0, seed: int = 0) -> tuple[Rotations, Rotations]:
    """Hadamard rotations for `model`, and the same with random key smoothing (scales within `spread`x)."""
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    plain = Rotations.hadamard(range(cfg.num_hidden_layers), dim)
    generator = torch.Generator().manual_seed(seed)
    scales = {i: spread ** torch.rand(cfg.num_key_value_heads, dim, generator=generator)
              for i in range(cfg.num_hidden_layers)}
    return plain, plain.with_key_smoothing(scales, "random, for a test")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.quick
def test_smoothed_keys_leave_an_unquantized_history_exact(model):
    """A history kept at full precision (`method="none"`) through smoothed transforms gives the model's own
    logits, and its dense view gives back the keys it was given; rotating the query by the key matrix instead
    of its own would not."""
    _, smoothed = _smoothed(model)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    cache = OscarCache(model, rotations=smoothed, method="none", **LAYOUT)
    logits = cached_logits(model, ids, cache, 10, 1)
    reference = model(ids).logits
    assert (logits - reference).abs().max().item() < 1e-4
    layer = cache.layers[0]
    assert layer.history_length > 0 and layer.query_rotation is not layer.key_rotation
    keys, _ = layer.dense_kv()
    plain = OscarCache(model, method="none", **LAYOUT)
    cached_logits(model, ids, plain, 10, 1)
    torch.testing.assert_close(keys, plain.layers[0].dense_kv()[0], atol=1e-5, rtol=1e-5)
    broken = OscarCache(model, rotations=smoothed, method="none", **LAYOUT)
    for each in broken.layers:  # the query rotated like the keys: the history's scores change
        each.tiers._query_rotation = each.key_rotation.clone()
    assert (cached_logits(model, ids, broken, 10, 1) - reference).abs().max().item() > 1e-3


@pytest.mark.parametrize("method,options", [("hadamard", {}), ("quarot", dict(high_precision_heads=[(0, 1)]))],
                         ids=["2-bit", "one KV head at 4 bits"])
def test_the_simulation_follows_a_smoothed_quantized_cache(model, method, options):
    plain, smoothed = _smoothed(model)
    cfg = model.config
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    template = OscarCache(cfg, rotations=smoothed, method=method, **LAYOUT, **options)
    simulated = simulate_logits(model, ids, template, prefill=9)
    decoded = cached_logits(model, ids, OscarCache(model, rotations=smoothed, method=method, **LAYOUT, **options),
                            9, 1)
    assert (simulated - decoded).abs().max().item() < 1e-5
    unsmoothed = cached_logits(model, ids, OscarCache(model, rotations=plain, method=method, **LAYOUT, **options),
                               9, 1)
    assert (unsmoothed - decoded).abs().max().item() > 1e-4  # the smoothing changed what the history rounds


@pytest.mark.quick
def test_key_smoothing_round_trips_and_is_checked(tmp_path, model):
    _, smoothed = _smoothed(model)
    smoothed.save_pretrained(tmp_path / "r")
    loaded = Rotations.from_pretrained(tmp_path / "r")
    assert set(loaded.key_smoothing) == set(smoothed.key_smoothing)
    for layer, scales in smoothed.key_smoothing.items():
        assert torch.equal(loaded.key_smoothing[layer], scales)
        key_matrix, query_matrix = loaded.key_transforms(layer)
        eye = torch.eye(scales.shape[-1]).expand_as(key_matrix)
        torch.testing.assert_close(key_matrix @ query_matrix.transpose(-1, -2), eye, atol=1e-5, rtol=0)
    with pytest.raises(RotationFileError, match="RotationZoo files cannot hold"):
        smoothed.save_zoo(tmp_path / "zoo")
    good = smoothed.key_smoothing[0]
    for bad, message in ((-good, "finite and positive"), (good[:, :-1], "expected \\[kv_heads"),
                         (good.new_full(good.shape, float("nan")), "finite and positive")):
        with pytest.raises(RotationFileError, match=message):
            Rotations(smoothed.key, smoothed.value, key_smoothing={0: bad})
    with pytest.raises(RotationFileError, match="no key rotation"):
        Rotations(smoothed.key, smoothed.value, key_smoothing={99: good})
    with pytest.raises(RotationFileError, match="another number of KV heads"):
        smoothed.check_model(smoothed.layer_ids, smoothed.head_dim, good.shape[0] + 1)


@pytest.mark.quick
def test_smoothing_drops_rankings_made_without_it(model):
    plain, _ = _smoothed(model)
    plain.metadata["retrieval_heads"] = "[[0, 1]]"
    smoothed = plain.with_key_smoothing({0: torch.ones(model.config.num_key_value_heads, plain.head_dim)}, "ones")
    assert smoothed.retrieval_heads() is None and smoothed.metadata["key_smoothing"] == "ones"


@pytest.mark.quick
def test_calibrated_scales_follow_the_channels_of_keys_and_queries(model):
    """Scales are sqrt(rms(k) / rms(q)) per channel, geometric mean 1 per head: a key channel made 16x larger
    (its k_proj row scaled) gets a 4x larger scale than before, relative to the others of its head."""
    torch.manual_seed(3)
    text = [torch.randint(0, model.config.vocab_size, (1, 96))]
    before = key_smoothing(model, text)
    cfg = model.config
    dim = cfg.hidden_size // cfg.num_attention_heads
    assert set(before) == set(range(cfg.num_hidden_layers))
    for s in before.values():
        assert s.shape == (cfg.num_key_value_heads, dim) and (s > 0).all()
        torch.testing.assert_close(s.log().mean(-1), torch.zeros(cfg.num_key_value_heads), atol=1e-5, rtol=0)
    k_proj = model.model.layers[0].self_attn.k_proj
    channel = 3  # of KV head 0; its RoPE partner (channel + dim / 2) is scaled too, so that RoPE keeps the factor
    original = k_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            k_proj.weight[[channel, channel + dim // 2]] *= 16
        after = key_smoothing(model, text)
    finally:
        with torch.no_grad():
            k_proj.weight.copy_(original)
    ratio = (after[0][0] / before[0][0])
    ratio = ratio / ratio[[c for c in range(dim) if c not in (channel, channel + dim // 2)]].mean()
    torch.testing.assert_close(ratio[[channel, channel + dim // 2]], torch.full((2,), 4.0), atol=0.05, rtol=0)


@pytest.mark.quick
def test_the_smoothing_command_checks_its_arguments_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from oscar_hf.calibrate import smoothing
    from oscar_hf.eval import assets

    monkeypatch.setattr(assets, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        smoothing.main(["--model", "smollm2", "--rotations", "hadamard", "--out", str(tmp_path / "o"),
                        "--tokens", "0", "--no-progress"])
    assert exit_info.value.code == 2 and "--tokens 0 must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_smoothing_fitted_rotations_afterwards_warns_before_loading_the_model(tmp_path, caplog, monkeypatch):
    """Scales added after a fit leave the key rotation fitted to keys the history no longer holds: the command says
    so (and what to do) before any work; Hadamard rotations, whose fit does not depend on the keys, do not warn."""
    from oscar_hf.calibrate import smoothing
    from oscar_hf.eval import assets

    fitted = Rotations.hadamard([0, 1], 16)
    fitted.metadata["key_objective"] = "qqt"
    fitted.save_pretrained(tmp_path / "fitted")

    class Loaded(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(assets, "load_model", refuse)
    for source, warns in ((str(tmp_path / "fitted"), True), ("hadamard", False)):
        caplog.clear()
        with pytest.raises(Loaded):
            smoothing.main(["--model", "smollm2", "--rotations", source, "--out", str(tmp_path / "o"), "--no-progress"])
        warned = any("fitted (qqt) to unsmoothed keys" in r.getMessage() for r in caplog.records)
        assert warned == warns, source


def test_the_kernels_decode_smoothed_keys_like_the_reference(monkeypatch):
    """Smoothed (non-orthogonal, per KV head) key and query matrices through the Triton demotion and attention
    kernels (Triton's interpreter on CPU): a greedy generate gives the reference backend's tokens, and its history
    really went through the kernels."""
    pytest.importorskip("triton", reason="the kernels need triton")
    from conftest import cache_argument_name, kernel_qwen3
    from oscar_hf.kernels.reference.backend import ReferenceBackend
    from oscar_hf.kernels.triton import backend as triton_backend
    from oscar_hf.kernels.triton.backend import TritonBackend
    from oscar_hf.kernels.triton.interpreter import kernel_device

    device = kernel_device()
    model = kernel_qwen3(device=device)
    cfg = model.config
    plain = Rotations.hadamard(range(cfg.num_hidden_layers), cfg.head_dim)
    generator = torch.Generator().manual_seed(5)
    smoothed = plain.with_key_smoothing({i: 4.0 ** torch.rand(cfg.num_key_value_heads, cfg.head_dim,
                                                              generator=generator)
                                         for i in range(cfg.num_hidden_layers)}, "random, for a test")
    ids = torch.randint(3, 256, (2, 37), device=device)
    options = dict(rotations=smoothed, method="quarot", sink_tokens=4, recent_tokens=8, demote_block=8)

    def run(backend):
        cache = OscarCache(model, backend=backend, **options)
        return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, disable_compile=True,
                              **{cache_argument_name(model): cache})

    reference = run(ReferenceBackend())
    demoted, read = [], []
    demote, partials = triton_backend.demote_rows, triton_backend.attention_partials

    def spy_partials(query, keys, values, history, *args, **kwargs):
        if history is not None and history.length:
            read.append(1)
        return partials(query, keys, values, history, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "demote_rows", lambda *a, **k: demoted.append(1) or demote(*a, **k))
    monkeypatch.setattr(triton_backend, "attention_partials", spy_partials)
    kernels = run(TritonBackend(min_dense_tokens=8, min_history_tokens=8, target_programs=16))
    assert demoted and read and torch.equal(kernels, reference)


@pytest.mark.quick
def test_key_rotations_are_fitted_to_the_keys_and_queries_the_history_holds():
    """With key smoothing the history holds `k / s` and the query is `q * s`: the key objective's moments are those
    of the smoothed rows, so that the rotation suits what is stored (`pipeline.smoothed_key_moments`)."""
    from oscar_hf.calibrate.pipeline import smoothed_key_moments

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 500, 8, generator=g, dtype=torch.float64), torch.randn(2, 500, 8, generator=g,
                                                                             dtype=torch.float64)
    s = torch.rand(2, 8, generator=g, dtype=torch.float64) * 3 + 0.25

    def moment(x):
        return x.transpose(1, 2) @ x / x.shape[1]

    value = moment(torch.randn(2, 500, 8, generator=g, dtype=torch.float64))
    moments = {"query": {3: moment(q)}, "key": {3: moment(k)}, "value": {3: value}}
    smoothed = smoothed_key_moments(moments, {3: s})
    torch.testing.assert_close(smoothed["query"][3], moment(q * s[:, None, :]))
    torch.testing.assert_close(smoothed["key"][3], moment(k / s[:, None, :]))
    assert smoothed["value"][3] is value  # scores, hence softmax weights and values, do not change
    assert smoothed_key_moments(moments, {})["query"][3] is moments["query"][3]  # layers without scales
