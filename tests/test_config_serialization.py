"""An OSCAR setup as data: `OscarConfig` to and from JSON, and `OscarCache.save_pretrained` / `from_pretrained`
rebuilding the same cache (config, rotations, per-layer settings, logits)."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from oscar_hf import OscarCache, OscarConfig, RotationFileError, Rotations
from oscar_hf.config import PRESETS, SCALE_DTYPES
from oscar_hf.rotations.io import CONFIG_NAME

from conftest import VOCAB, forward, tiny_model

TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=4)


def json_round_trip(config: OscarConfig) -> OscarConfig:
    return OscarConfig.from_dict(json.loads(json.dumps(config.to_dict())))


def random_rotations(layers=(0, 1), d=16, **metadata) -> Rotations:
    """Random orthogonal rotations (QR of Gaussian matrices), standing in for calibrated ones."""
    g = torch.Generator().manual_seed(0)
    key = {i: torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))[0].float() for i in layers}
    value = {i: torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))[0].float() for i in layers}
    return Rotations(key, value, metadata={"objective": "test", **metadata})


def assert_same_rotations(a: Rotations | None, b: Rotations | None):
    assert (a is None) == (b is None)
    if a is None:
        return
    for table in ("key", "value", "key_eigenvalues", "value_eigenvalues"):
        ta, tb = getattr(a, table), getattr(b, table)
        assert sorted(ta) == sorted(tb), table
        assert all(torch.equal(ta[i], tb[i]) for i in ta), table
    assert a.metadata == b.metadata


def logits_through(model, cache, ids) -> torch.Tensor:
    """Prefill (history demoted: the prompt is longer than sink + recent), then two decode steps."""
    with torch.no_grad():
        out = [forward(model, ids, cache).logits]
        for _ in range(2):
            out.append(forward(model, out[-1][:, -1:].argmax(-1), cache).logits)
    return torch.cat(out, dim=1)


def prompt(length=40, seed=1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ OscarConfig
@pytest.mark.parametrize("method", sorted(PRESETS))
@pytest.mark.quick
def test_every_preset_round_trips_through_json(method):
    config = OscarConfig.from_method(method)
    assert json_round_trip(config) == config
    assert json_round_trip(OscarConfig.from_method(method, bits=4)) == OscarConfig.from_method(method, bits=4)


@pytest.mark.quick
def test_non_default_fields_round_trip_and_are_json_types():
    config = OscarConfig(method="clip", sink_tokens=3, recent_tokens=5, demote_block=2, bits=4, key_clip_ratio=None,
                         value_clip_ratio=0.5, scale_dtype=torch.bfloat16, quantize=False, history_chunk=7,
                         encoder="lloyd", high_precision_layers=(3, 1), high_precision_bits=2)
    data = config.to_dict()
    assert data["scale_dtype"] == "bfloat16" and data["high_precision_layers"] == [1, 3]
    assert json_round_trip(config) == config
    for name, dtype in SCALE_DTYPES.items():
        encoder = "sigma" if name == "compact" else "minmax"
        config = OscarConfig(scale_dtype=dtype, encoder=encoder)
        assert config.to_dict()["scale_dtype"] == name
        assert json_round_trip(config) == config


@pytest.mark.quick
def test_a_json_file_round_trips(tmp_path):
    config = OscarConfig.from_method("oscar-next", high_precision_layers=[0, 2])
    path = tmp_path / "config.json"
    config.to_json_file(path)
    assert json.loads(path.read_text()) == config.to_dict()
    assert OscarConfig.from_json_file(path) == config


@pytest.mark.quick
def test_a_truncated_json_file_is_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    OscarConfig.from_method("oscar-next").to_json_file(path)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not a readable JSON file.*to_json_file"):
        OscarConfig.from_json_file(path)


@pytest.mark.quick
def test_an_unknown_key_is_rejected_with_the_valid_names():
    with pytest.raises(ValueError) as error:
        OscarConfig.from_dict({"recent_token": 128, "nbits": 2})
    message = str(error.value)
    assert "'recent_token' (did you mean 'recent_tokens'?)" in message and "'nbits'" in message
    assert "valid fields: method, sink_tokens, recent_tokens" in message and "high_precision_bits" in message
    with pytest.raises(ValueError, match="scale_dtype='int8'"):
        OscarConfig.from_dict({"scale_dtype": "int8"})


# ------------------------------------------------------------------------------------------ OscarCache
CALIBRATED = {
    # recorded clip ratios replace the preset's; the value rotations folded into the weights; a fixed capacity
    "oscar": (dict(key_clip_ratio="0.9", value_clip_ratio="0.8"), dict(fold_value_rotation=True, max_cache_len=64)),
    # the 4-bit layer comes from the rotations' retrieval ranking
    "oscar-hifi": (dict(retrieval_layers="[1, 0]"), {}),
}


@pytest.mark.parametrize("method", sorted(CALIBRATED))
def test_a_cache_with_calibrated_rotations_is_rebuilt_equal(tmp_path, method):
    metadata, options = CALIBRATED[method]
    model, twin = tiny_model(), tiny_model()  # twin: the same weights, loaded again
    cache = OscarCache(model, random_rotations(**metadata), method=method, **TIERS, **options)
    cache.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", CONFIG_NAME, "oscar_rotations.safetensors"]

    rebuilt = OscarCache.from_pretrained(twin, tmp_path)
    assert rebuilt.oscar_config == cache.oscar_config
    assert_same_rotations(rebuilt.rotations, cache.rotations)
    assert [layer.config for layer in rebuilt.layers] == [layer.config for layer in cache.layers]
    if method == "oscar":
        assert [layer.config.key_clip_ratio for layer in cache.layers] == [0.9, 0.9]
        assert all(layer.value_rotation is None for layer in rebuilt.layers)  # folded into twin's weights
        assert all(layer.max_cache_len == 64 for layer in rebuilt.layers)
    else:
        assert cache.oscar_config.high_precision_layers == (1,)
    ids = prompt()
    assert torch.equal(logits_through(twin, rebuilt, ids), logits_through(model, cache, ids))
    assert rebuilt.layers[0].history_length > 0


@pytest.mark.quick
def test_a_hadamard_cache_is_saved_as_its_config_alone_and_rebuilt_equal(tmp_path):
    model = tiny_model()
    cache = OscarCache(model, method="hadamard", **TIERS)
    cache.save_pretrained(tmp_path)
    assert os.listdir(tmp_path) == [CONFIG_NAME]
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["rotations"] == "hadamard"

    rebuilt = OscarCache.from_pretrained(model, str(tmp_path))
    assert rebuilt.oscar_config == cache.oscar_config
    assert_same_rotations(rebuilt.rotations, cache.rotations)
    ids = prompt()
    assert torch.equal(logits_through(model, rebuilt, ids), logits_through(model, cache, ids))



def test_saving_a_cache_that_holds_tokens_warns_that_they_are_not_saved(tmp_path, caplog):
    model = tiny_model()
    cache = OscarCache(model, method="hadamard", **TIERS)
    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        cache.save_pretrained(tmp_path / "empty")
        assert not [r for r in caplog.records if r.name.startswith("oscar_hf")]
        logits_through(model, cache, prompt())
        cache.save_pretrained(tmp_path / "filled")
    warnings = [r for r in caplog.records if r.name == "oscar_hf.cache" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "OscarCache.save_pretrained saves the setup only, not the 42 cached tokens: OscarCache.from_pretrained gives "
        "an empty cache, to be filled by running the prompt again"]
    assert OscarCache.from_pretrained(model, tmp_path / "filled").get_seq_length() == 0

def test_a_setup_for_another_model_is_refused(tmp_path):
    cache = OscarCache(tiny_model(), random_rotations(), method="oscar", **TIERS)
    cache.save_pretrained(tmp_path)
    wider = tiny_model(head_dim=32)
    with pytest.raises(ValueError, match="saved for a model with attention shape .*'head_dim': 16.*'head_dim': 32"):
        OscarCache.from_pretrained(wider, tmp_path)
    # past that check, the rotations refuse the model themselves (Rotations.check_model)
    setup = json.loads((tmp_path / CONFIG_NAME).read_text())
    setup["attention_shape"]["head_dim"] = 32
    (tmp_path / CONFIG_NAME).write_text(json.dumps(setup))
    with pytest.raises(RotationFileError, match="the rotations are 16x16 but the model's head_dim is 32"):
        OscarCache.from_pretrained(wider, tmp_path)


def test_a_folder_without_the_config_file_is_named_in_the_error(tmp_path):
    random_rotations().save_pretrained(tmp_path)  # rotations alone are not a setup
    with pytest.raises(FileNotFoundError, match=f"{CONFIG_NAME} does not exist.*OscarCache.save_pretrained"):
        OscarCache.from_pretrained(tiny_model(), tmp_path)
    with pytest.raises(FileNotFoundError, match="^OSCAR setup '.*no-such-folder': no such local folder"):
        OscarCache.from_pretrained(tiny_model(), tmp_path / "no-such-folder")


@pytest.mark.parametrize("damage", ["truncated", "not utf-8"])
@pytest.mark.quick
def test_a_damaged_setup_file_is_a_value_error_naming_the_file(tmp_path, damage):
    """Every other bad setup names its file; json's own error (`Unterminated string ...`) names only a line."""
    OscarCache(tiny_model(), random_rotations(), method="oscar", **TIERS).save_pretrained(tmp_path)
    path = tmp_path / CONFIG_NAME
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2] if damage == "truncated" else b"\xff\xfe" + text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not a readable JSON file.*save_pretrained"):
        OscarCache.from_pretrained(tiny_model(), tmp_path)


def test_a_config_file_naming_another_file_is_refused(tmp_path):
    OscarCache(tiny_model(), random_rotations(), method="oscar", **TIERS).save_pretrained(tmp_path)
    setup = json.loads((tmp_path / CONFIG_NAME).read_text())
    for field, value, message in (("rotations", "../elsewhere.safetensors", "rotations='../elsewhere.safetensors'"),
                                  ("extra", 1, "an OSCAR setup has the keys")):
        (tmp_path / CONFIG_NAME).write_text(json.dumps({**setup, field: value}))
        with pytest.raises(ValueError, match=message):
            OscarCache.from_pretrained(tiny_model(), tmp_path)



@pytest.mark.parametrize("key, value, expected", [
    ("fold_value_rotation", "false", "a bool"),
    ("fold_value_rotation", None, "a bool"),
    ("recorded_clip_ratios", "no", "a bool"),
    ("max_cache_len", 50.5, "an int"),
    ("max_cache_len", 10**18, "an int from 1 to 2147483648"),
    ("oscar_config", [], "a dict"),
    ("oscar_config.quantize", "false", "a bool"),
    ("oscar_config.quantize", None, "a bool"),
    ("oscar_config.bits", 2.0, "the int 2, 3 or 4"),
    ("oscar_config.sink_tokens", True, "an int"),
    ("oscar_config.recent_tokens", 10**18, "an int from 0 to 2147483648"),
    ("oscar_config.key_clip_ratio", True, "a float"),
    ("oscar_config.high_precision_layers", [True], "a list of layer indices"),
])
def test_a_setup_value_of_another_type_is_refused_before_anything_changes(tmp_path, key, value, expected):
    """JSON's "false" is a non-empty string, true in Python: read as it is, it folded the model's weights or
    quantized a history the file said not to."""
    model = tiny_model()
    OscarCache(model, random_rotations(key_clip_ratio="0.9", value_clip_ratio="0.8"), method="oscar",
               recorded_clip_ratios=False, **TIERS).save_pretrained(tmp_path)
    setup = json.loads((tmp_path / CONFIG_NAME).read_text())
    table, name = (setup["oscar_config"], key.split(".")[1]) if "." in key else (setup, key)
    table[name] = value
    (tmp_path / CONFIG_NAME).write_text(json.dumps(setup))
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"{CONFIG_NAME}: .*" + re.escape(f"{name}={value!r}: expected {expected}")):
        OscarCache.from_pretrained(model, tmp_path)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))

def test_a_setup_on_the_hub_is_downloaded_with_its_options(monkeypatch, tmp_path):
    import huggingface_hub

    model = tiny_model()
    cache = OscarCache(model, method="hadamard", **TIERS)
    cache.save_pretrained(tmp_path / "snapshot" / "llama")  # a named rotation: the repo holds the config alone
    calls = {}

    def fake_snapshot_download(repo_id, **kwargs):
        calls.update(kwargs, repo_id=repo_id)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    rebuilt = OscarCache.from_pretrained(model, "me/oscar-setups", subfolder="llama", revision="v2", token="hf_test")
    assert rebuilt.oscar_config == cache.oscar_config
    assert calls["repo_id"] == "me/oscar-setups" and calls["revision"] == "v2" and calls["token"] == "hf_test"
    assert "llama/*.json" in calls["allow_patterns"]  # oscar_config.json comes down with the rotations


def test_the_usage_snippet_for_transformers_users_runs(tmp_path, monkeypatch):
    usage = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "usage.md")
    section = open(usage).read().split("## Saving and loading; coming from `cache_implementation`", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    model = tiny_model()
    scope = {"model": model, "ids": prompt()}
    exec(snippet, scope)
    assert scope["out"].shape == (1, 60) and (tmp_path / "oscar-setup" / CONFIG_NAME).is_file()
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        model.generate(prompt(), cache_implementation="oscar", max_new_tokens=1)


@pytest.mark.quick
def test_presets_are_complete_configs_that_differ_in_their_fields():
    """A preset is data: an `OscarConfig` whose fields alone say what a cache stores, none the same as another's."""
    fields = {name: {k: v for k, v in preset.to_dict().items() if k != "method"} for name, preset in PRESETS.items()}
    assert len({json.dumps(f, sort_keys=True) for f in fields.values()}) == len(PRESETS)
    assert all(preset.method == name and OscarConfig.from_method(name) == preset for name, preset in PRESETS.items())
    assert PRESETS["oscar-hifi"].high_precision_layer_share > PRESETS["oscar-mixed"].high_precision_layer_share > 0
    assert PRESETS["oscar-next"].high_precision_head_share > 0 == PRESETS["oscar"].high_precision_layer_share


@pytest.mark.quick
def test_a_saved_config_without_newer_fields_keeps_the_meaning_of_its_preset():
    written_before = PRESETS["oscar-hifi"].to_dict()
    for name in ("high_precision_layer_share", "high_precision_head_share", "rotation"):
        del written_before[name]
    assert OscarConfig.from_dict(written_before) == PRESETS["oscar-hifi"]
