"""Rotation files: RotationZoo v1/v2 and our safetensors format round-trip bit-exactly; bad files fail clearly."""

import io
import json
import logging
import os
import pathlib
import pickle
import re
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from oscar_hf import OscarCache, RotationFileError, Rotations
from oscar_hf.rotations.hub import resolve_rotation_folder
from oscar_hf.rotations.io import FORMAT_TAG, SAFETENSORS_NAME, load_rotation_path, load_zoo_file, rotation_metadata
from oscar_hf.rotations.math import compose_rotation


def random_rotations(layers=(0, 1, 2), d=16, heads=None):
    def one():
        shape = (heads, d, d) if heads else (d, d)
        a = torch.randn(*shape, dtype=torch.float64)
        ev, u = torch.linalg.eigh(a @ a.transpose(-1, -2))
        return compose_rotation(u, ev).float(), ev.float()

    key, value, kev, vev = {}, {}, {}, {}
    for i in layers:
        key[i], kev[i] = one()
        value[i], vev[i] = one()
    return Rotations(key, value, kev, vev, metadata={"objective": "test", "model": "tiny"})


def assert_same(a: Rotations, b: Rotations):
    assert a.layer_ids == b.layer_ids
    for i in a.layer_ids:
        assert torch.equal(a.key[i], b.key[i]) and torch.equal(a.value[i], b.value[i])
        assert torch.equal(a.key_eigenvalues[i], b.key_eigenvalues[i])


@pytest.mark.parametrize("heads", [None, 2])
@pytest.mark.quick
def test_zoo_round_trip_is_bit_exact_in_reference_schema(tmp_path, heads):
    rot = random_rotations(heads=heads)
    key_file, value_file = rot.save_zoo(tmp_path, "qqt_r_h_pbr", "sst_r_h_pbr")
    assert os.path.basename(key_file) == "k_rotation_qqt_r_h_pbr.pt"
    state = torch.load(key_file, weights_only=True)
    assert state["format_version"] == (2 if heads else 1)
    assert state["source_grouping"] == ("kv_head" if heads else "layer")
    assert state["objective"] == "qqt_r_h_pbr"
    assert set(state["layers"]) == {0, 1, 2}
    entry = state["layers"][1]
    assert entry["layer_id"] == 1 and entry["rotation"].dtype == torch.float32 and entry["rotation"].is_contiguous()
    assert entry["rotation"].shape == ((2, 16, 16) if heads else (16, 16))
    assert_same(Rotations.from_pretrained(tmp_path), rot)


def test_rotation_metadata_is_what_a_full_load_records_in_either_format(tmp_path):
    rot = Rotations(random_rotations().key, random_rotations().value, metadata={"objective": "hadamard", "model": "m"})
    rot.save_pretrained(tmp_path / "ours")
    rot.save_zoo(tmp_path / "zoo")
    for folder in ("ours", "zoo"):
        assert rotation_metadata(tmp_path / folder) == load_rotation_path(tmp_path / folder)["metadata"]
    assert rotation_metadata(tmp_path / "ours")["objective"] == "hadamard"
    with pytest.raises(FileNotFoundError):
        rotation_metadata(tmp_path / "missing")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(RotationFileError, match="not an oscar-hf rotation file"):
        rotation_metadata(tmp_path / "other.safetensors")


def test_zoo_file_with_string_layer_keys_loads(tmp_path):
    rot = random_rotations()
    key_file, value_file = rot.save_zoo(tmp_path)
    state = torch.load(key_file, weights_only=True)
    state["layers"] = {str(k): v for k, v in state["layers"].items()}
    torch.save(state, key_file)
    assert_same(Rotations.from_zoo(key_file, value_file), rot)


@pytest.mark.quick
def test_safetensors_round_trip_keeps_tensors_and_metadata(tmp_path):
    rot = random_rotations(heads=2)
    assert rot.save_pretrained(tmp_path) is None  # as huggingface_hub's ModelHubMixin.save_pretrained
    assert sorted(os.listdir(tmp_path)) == ["README.md", "oscar_rotations.safetensors"]
    back = Rotations.from_pretrained(tmp_path)
    assert_same(back, rot)
    assert back.metadata["objective"] == "test" and back.per_head


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.quick
def test_pickled_object_is_refused(tmp_path):
    raw = tmp_path / "k_rotation_raw.pt"
    with open(raw, "wb") as f:
        pickle.dump({"format_version": 1, "layers": {0: Payload()}}, f)
    saved = tmp_path / "k_rotation_saved.pt"
    torch.save({"format_version": 1, "layers": {0: {"rotation": Payload()}}}, saved)
    for path in (raw, saved):
        with pytest.raises(RotationFileError, match="could not be loaded safely"):
            load_zoo_file(str(path))


@pytest.mark.quick
def test_corrupt_and_wrong_files_fail_clearly(tmp_path):
    (tmp_path / "k_rotation_x.pt").write_bytes(b"not a torch file")
    (tmp_path / "v_rotation_x.pt").write_bytes(b"not a torch file")
    with pytest.raises(RotationFileError, match="could not be loaded safely"):
        Rotations.from_pretrained(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"format_version": 7, "layers": {}}, other / "k_rotation_a.pt")
    torch.save({"format_version": 1, "layers": {}}, other / "v_rotation_a.pt")
    with pytest.raises(RotationFileError, match="unsupported format_version 7"):
        Rotations.from_pretrained(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RotationFileError, match="holds no rotations"):
        Rotations.from_pretrained(empty)


def test_non_orthogonal_rotation_is_rejected():
    bad = torch.eye(16) * 2
    with pytest.raises(RotationFileError, match="not orthogonal"):
        Rotations({0: bad}, {0: torch.eye(16)})


def test_rotations_checked_against_the_model():
    rot = random_rotations(layers=(0, 1))
    with pytest.raises(RotationFileError, match=r"cover layers 0-1 .* full-attention layers are 0-3 \(missing 2-3\)"):
        rot.check_model([0, 1, 2, 3], head_dim=16, num_kv_heads=2)
    with pytest.raises(RotationFileError, match="16x16 but the model's head_dim is 32"):
        rot.check_model([0, 1], head_dim=32, num_kv_heads=2)
    with pytest.raises(RotationFileError, match=r"are 0 \(1 not among them\): they were made for another model"):
        rot.check_model([0], head_dim=16, num_kv_heads=2)
    per_head = random_rotations(layers=(0,), heads=3)
    with pytest.raises(RotationFileError, match="3 per-head matrices but the model has 2 KV heads: they were made for "
                                                r"another model \(rotations: 1 layers 0, head_dim 16, 3 KV heads;"):
        per_head.check_model([0], head_dim=16, num_kv_heads=2)


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rotations", "smollm2-135m")


@pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="no shipped SmolLM2 rotations in this checkout")
@pytest.mark.parametrize("method", [None, "oscar"])
def test_rotations_for_a_model_of_another_depth_are_refused(method):
    """A deeper model's file was used silently, its first layers' rotations for this model's layers; a shallower
    one's was refused. Both say what shape the rotations and the model have, whatever the method (left to its
    default, the rotations' ranking named a layer this model lacks as `high_precision_layers`)."""
    from conftest import tiny_model

    smollm2_like = dict(num_key_value_heads=3, num_attention_heads=3, head_dim=64, hidden_size=192)
    with pytest.raises(RotationFileError, match=re.escape(
            "the rotations cover layers 0-29 but the model's full-attention layers are 0-3 (4-29 not among them): "
            "they were made for another model (rotations: 30 layers 0-29, head_dim 64, 3 KV heads; model: "
            "full-attention layers 0-3, head_dim 64, 3 KV heads)")):
        OscarCache(tiny_model(num_hidden_layers=4, **smollm2_like), SHIPPED, method=method)
    shipped = Rotations.from_pretrained(SHIPPED)
    shallow = Rotations({i: shipped.key[i] for i in range(4)}, {i: shipped.value[i] for i in range(4)})
    with pytest.raises(RotationFileError, match=re.escape(
            "(missing 4-7): they were made for another model (rotations: 4 layers 0-3, head_dim 64, 3 KV heads; "
            "model: full-attention layers 0-7, head_dim 64, 3 KV heads)")):
        OscarCache(tiny_model(num_hidden_layers=8, **smollm2_like), shallow, method=method)


@pytest.mark.quick
def test_missing_path_and_bad_repo_ids():
    with pytest.raises(FileNotFoundError, match="not a Hub repo id"):
        resolve_rotation_folder("./no/such/../folder")


def test_hub_offline_without_cache_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="offline mode is on.*no copy is in the local Hub cache"):
        Rotations.from_pretrained("someone/oscar-rotations", subfolder="qwen3-8b", cache_dir=str(tmp_path))


def test_hub_download_uses_subfolder_and_loads(monkeypatch, tmp_path):
    rot = random_rotations()
    snapshot = tmp_path / "snapshot"
    rot.save_pretrained(snapshot / "smollm2")
    calls = {}

    def fake_snapshot_download(repo_id, **kwargs):
        calls.update(kwargs, repo_id=repo_id)
        return str(snapshot)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    back = Rotations.from_pretrained("someone/oscar-rotations", subfolder="smollm2", revision="v1")
    assert_same(back, rot)
    assert calls["repo_id"] == "someone/oscar-rotations" and calls["revision"] == "v1"
    assert "smollm2/oscar_rotations.safetensors" in calls["allow_patterns"]
    with pytest.raises(FileNotFoundError, match="holds no rotation files"):
        Rotations.from_pretrained("someone/oscar-rotations", subfolder="other-model")


# ------------------------------------------------------------------------------------------- malformed files
EYE = torch.eye(4)
GOOD_ZOO = {"format_version": 1, "layers": {0: {"layer_id": 0, "rotation": EYE, "eigenvalues": torch.ones(4)}}}


def write_safetensors(folder, tensors, metadata=None):
    """An oscar-hf rotation file holding exactly `tensors` (cloned: safetensors refuses shared storage)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.clone().contiguous() for name, t in tensors.items()}, str(folder / SAFETENSORS_NAME),
              metadata={"format": FORMAT_TAG, "format_version": "1", **(metadata or {})})


def write_zoo(folder, key_state, value_state):
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    key_file, value_file = os.path.join(folder, "k_rotation_a.pt"), os.path.join(folder, "v_rotation_a.pt")
    torch.save(key_state, key_file)
    torch.save(value_state, value_file)
    return key_file, value_file


MALFORMED_SAFETENSORS = {
    "0-D rotation": ({"key.0": torch.tensor(1.0), "value.0": EYE}, {}, r"key rotation of layer 0 has shape \(\)"),
    "0x0 rotations": ({"key.0": torch.zeros(0, 0), "value.0": torch.zeros(0, 0)}, {}, r"shape \(0, 0\)"),
    "no kv heads": ({"key.0": torch.zeros(0, 4, 4), "value.0": torch.zeros(0, 4, 4)}, {}, r"shape \(0, 4, 4\)"),
    "non-square": ({"key.0": torch.zeros(4, 3), "value.0": torch.zeros(4, 3)}, {}, r"shape \(4, 3\)"),
    "integer rotation": ({"key.0": torch.eye(4, dtype=torch.int32), "value.0": EYE}, {},
                         "dtype torch.int32; expected floating point"),
    "boolean rotation": ({"key.0": EYE, "value.0": torch.eye(4, dtype=torch.bool)}, {},
                         "value rotation of layer 0 has dtype torch.bool"),
    "eigenvalues of another shape": ({"key.0": EYE, "value.0": EYE, "key_eigenvalues.0": torch.ones(7)}, {},
                                     r"key eigenvalues of layer 0 have shape \(7,\); its rotation \(4, 4\) has \(4,\)"),
    "0-D eigenvalues": ({"key.0": EYE, "value.0": EYE, "value_eigenvalues.0": torch.tensor(1.0)}, {},
                        r"value eigenvalues of layer 0 have shape \(\)"),
    "eigenvalues without a rotation": ({"key.0": EYE, "value.0": EYE, "key_eigenvalues.5": torch.ones(4)}, {},
                                       r"key eigenvalues for layers \[5\], which have no key rotation"),
    "non-ASCII layer digit": ({"key.²": EYE, "value.0": EYE}, {}, "unexpected tensor name 'key.²'"),
    "layer named twice": ({"key.0": EYE, "key.00": -EYE, "value.0": EYE}, {}, "two tensors name key layer 0"),
    "newer format_version": ({"key.0": EYE, "value.0": EYE}, {"format_version": "2"},
                             "unsupported format_version '2'"),
    "retrieval_layers a string": ({"key.0": EYE, "value.0": EYE}, {"retrieval_layers": '"0"'},
                                  "retrieval_layers are unreadable.*expected a JSON list of layer indices"),
    "retrieval_layers cut short": ({"key.0": EYE, "value.0": EYE}, {"retrieval_layers": "[0, "},
                                   "retrieval_layers are unreadable.*JSONDecodeError"),
    "retrieval_layers of bools": ({"key.0": EYE, "value.0": EYE}, {"retrieval_layers": "[true]"},
                                  "retrieval_layers are unreadable"),
    "retrieval_layers repeated": ({"key.0": EYE, "value.0": EYE}, {"retrieval_layers": "[0, 0]"},
                                  "listed more than once"),
    "per-layer clip ratios a list": ({"key.0": EYE, "value.0": EYE},
                                     {"key_clip_ratios": "[0.5]", "value_clip_ratios": "[0.5]"},
                                     "clip ratios are unreadable.*expected a JSON object"),
    "clip ratio a string": ({"key.0": EYE, "value.0": EYE}, {"key_clip_ratio": '"0.5"', "value_clip_ratio": "null"},
                            "clip ratio '0.5' is not a number"),
    "clip_bits a word": ({"key.0": EYE, "value.0": EYE}, {"key_clip_ratio": "0.5", "value_clip_ratio": "0.5",
                                                           "clip_bits": "two"}, "clip_bits are unreadable"),
}


@pytest.mark.parametrize("tensors, metadata, reason", MALFORMED_SAFETENSORS.values(), ids=MALFORMED_SAFETENSORS)
@pytest.mark.quick
def test_malformed_safetensors_fail_as_rotation_file_errors_naming_the_file(tmp_path, tensors, metadata, reason):
    folder = tmp_path / "rotations"
    write_safetensors(folder, tensors, metadata)
    with pytest.raises(RotationFileError, match=reason) as error:
        Rotations.from_pretrained(folder)
    assert str(error.value).startswith(str(folder))


@pytest.mark.parametrize("keep", [4, 40, -8], ids=["length cut", "header cut", "tensors cut"])
@pytest.mark.quick
def test_a_truncated_safetensors_file_fails_as_a_rotation_file_error_naming_it(tmp_path, keep):
    """The header of a safetensors file is JSON: cut short, it fails as a corrupt file, with the file's name."""
    folder = tmp_path / "rotations"
    write_safetensors(folder, {"key.0": EYE, "value.0": EYE}, {"retrieval_layers": "[0]"})
    path = folder / SAFETENSORS_NAME
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(RotationFileError, match=f"^{re.escape(str(path))} is not a readable safetensors file"):
        Rotations.from_pretrained(folder)


def zoo_layers(layers, version=1, **fields):
    return {"format_version": version, "layers": layers, **fields}


MALFORMED_ZOO = {
    "layers a list": (zoo_layers([{"rotation": EYE}]), "'layers' is of type list; expected a dict"),
    "layers None": (zoo_layers(None), "'layers' is of type NoneType"),
    "layers empty": (zoo_layers({}), "'layers' is empty"),
    "0-D rotation": (zoo_layers({0: {"rotation": torch.tensor(1.0)}}, version=2), r"has shape \(\)"),
    "0x0 rotation": (zoo_layers({0: {"rotation": torch.zeros(0, 0)}}), r"has shape \(0, 0\)"),
    "non-square": (zoo_layers({0: {"rotation": torch.zeros(2, 4, 3)}}, version=2), r"has shape \(2, 4, 3\)"),
    "integer rotation": (zoo_layers({0: {"rotation": torch.eye(4, dtype=torch.int64)}}), "dtype torch.int64"),
    "complex rotation": (zoo_layers({0: {"rotation": torch.eye(4, dtype=torch.complex64)}}), "dtype torch.complex64"),
    "rotation a list": (zoo_layers({0: {"rotation": [[1.0]]}}), "layer 0 has no 'rotation' tensor"),
    "eigenvalues a list": (zoo_layers({0: {"rotation": EYE, "eigenvalues": [1.0] * 4}}),
                           "eigenvalues of layer 0 are of type list; expected a tensor"),
    "eigenvalues of another shape": (zoo_layers({0: {"rotation": EYE, "eigenvalues": torch.ones(2, 4)}}),
                                     r"eigenvalues of layer 0 have shape \(2, 4\)"),
    "format_version True": (zoo_layers({0: {"rotation": EYE}}, version=True), "unsupported format_version True"),
    "format_version 1.0": (zoo_layers({0: {"rotation": EYE}}, version=1.0), "unsupported format_version 1.0"),
    "format_version a tensor": (zoo_layers({0: {"rotation": EYE}}, version=torch.tensor([1, 2])),
                                "unsupported format_version tensor"),
    "layer key a tensor": (zoo_layers({torch.tensor([1, 2]): {"rotation": EYE}}),
                           "layer key tensor.* is not a non-negative integer"),
    "layer key a float": (zoo_layers({0.5: {"rotation": EYE}}), "layer key 0.5 is not a non-negative integer"),
    "layer key negative": (zoo_layers({-1: {"rotation": EYE}}), "layer key -1 is not a non-negative integer"),
    "layer key a bool": (zoo_layers({True: {"rotation": EYE}}), "layer key True is not a non-negative integer"),
    "layer twice": (zoo_layers({0: {"rotation": EYE}, "0": {"rotation": -EYE}}),
                    "layer 0 appears twice in 'layers' \\(keys 0 and '0'\\)"),
    "layer_id disagrees with its key": (zoo_layers({0: {"layer_id": 3, "rotation": EYE}}),
                                        "layer 0 says its layer_id is 3"),
    "layer_id a string": (zoo_layers({0: {"layer_id": "0", "rotation": EYE}}), "says its layer_id is '0'"),
    "objective a list": (zoo_layers({0: {"rotation": EYE}}, objective=["qqt"]),
                         r"objective is \['qqt'\] \(of type list\); expected a string"),
    "source_grouping a number": (zoo_layers({0: {"rotation": EYE}}, source_grouping=5), "source_grouping is 5"),
    "source_grouping unknown": (zoo_layers({0: {"rotation": EYE}}, source_grouping="head"),
                                "source_grouping 'head' is not one of"),
}


@pytest.mark.parametrize("state, reason", MALFORMED_ZOO.values(), ids=MALFORMED_ZOO)
@pytest.mark.quick
def test_malformed_zoo_files_fail_as_rotation_file_errors_naming_the_file(tmp_path, state, reason):
    folder = tmp_path / "zoo"
    write_zoo(folder, state, state)  # both files: a pair of one bad rotation and one good one fails another way
    with pytest.raises(RotationFileError, match=reason) as error:
        Rotations.from_pretrained(folder)
    assert str(error.value).startswith(str(folder))


@pytest.mark.parametrize("make", [
    lambda: Rotations([EYE], {0: EYE}),
    lambda: Rotations({0: [[1.0]]}, {0: EYE}),
    lambda: Rotations({True: EYE}, {True: EYE}),
    lambda: Rotations({0: EYE}, {0: EYE}, key_eigenvalues=torch.ones(4)),
    lambda: Rotations({0: EYE}, {0: EYE}, metadata=["objective"]),
], ids=["table a list", "rotation a list", "bool layer", "eigenvalues a tensor", "metadata a list"])
def test_malformed_tables_in_memory_fail_as_rotation_file_errors(make):
    with pytest.raises(RotationFileError, match="of type|layer key True"):
        make()


def test_metadata_edited_after_loading_fails_as_a_rotation_file_error():
    rotations = random_rotations()
    rotations.metadata.update(key_clip_ratios="[0.5]", value_clip_ratios="[0.5]")
    with pytest.raises(RotationFileError, match="unreadable for layer 0"):
        rotations.clip_ratios(0)
    rotations.metadata.update(key_clip_ratios="{}", value_clip_ratios="{}", retrieval_layers='"21"')
    with pytest.raises(RotationFileError, match="retrieval_layers are unreadable"):
        rotations.retrieval_layers()


def test_empty_torch_file_says_it_is_empty(tmp_path):
    key_file, _ = write_zoo(tmp_path, GOOD_ZOO, GOOD_ZOO)
    open(key_file, "wb").close()
    with pytest.raises(RotationFileError, match=r"k_rotation_a.pt is empty \(0 bytes\): not a rotation file"):
        Rotations.from_pretrained(tmp_path)


def saved_bytes(state, zip_format: bool) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer, _use_new_zipfile_serialization=zip_format)
    return buffer.getvalue()


TORCH_FILES = [saved_bytes(GOOD_ZOO, True), saved_bytes(GOOD_ZOO, False)]


@st.composite
def damaged_torch_files(draw) -> bytes:
    """A valid RotationZoo file (zip or legacy format), cut short and with a few bytes overwritten."""
    data = bytearray(draw(st.sampled_from(TORCH_FILES)))
    del data[draw(st.integers(0, len(data))):]
    for _ in range(draw(st.integers(0, 4)) if data else 0):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def assert_loads_or_fails_clearly(load):
    """`load()` either gives `Rotations` or raises `RotationFileError` with a reason (not a blank one)."""
    try:
        return load()
    except RotationFileError as error:
        assert not str(error).rstrip().endswith(":"), str(error)
        return None


@settings(max_examples=150, deadline=None)
@given(data=st.one_of(damaged_torch_files(), st.binary(max_size=64)))
def test_any_bytes_in_a_torch_file_load_or_fail_as_rotation_file_errors(data):
    with tempfile.TemporaryDirectory() as folder:
        key_file, value_file = write_zoo(folder, GOOD_ZOO, GOOD_ZOO)
        with open(key_file, "wb") as f:
            f.write(data)
        assert_loads_or_fails_clearly(lambda: Rotations.from_zoo(key_file, value_file))


@st.composite
def small_tensors(draw) -> torch.Tensor:
    """Mostly-malformed tensors: any small shape (0-D and empty included) and dtype, sometimes an orthogonal one."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]))
    if draw(st.booleans()):
        d = draw(st.integers(1, 3))
        shape = draw(st.sampled_from([(d, d), (2, d, d)]))
        return torch.eye(d).expand(shape).clone().to(dtype)
    return torch.randn(draw(st.lists(st.integers(0, 3), max_size=4))).to(dtype)


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.floats(), st.text(max_size=3),
                 st.lists(st.integers(0, 2), max_size=2), small_tensors())
LAYER_KEYS = st.one_of(st.integers(-1, 2), st.sampled_from(["0", "1", "00", "²", "x", ""]), st.booleans(),
                       st.floats(0, 2))
ZOO_ENTRIES = st.one_of(JUNK, st.fixed_dictionaries(
    {"rotation": st.one_of(small_tensors(), JUNK)},
    optional={"layer_id": st.one_of(st.integers(0, 2), JUNK), "eigenvalues": st.one_of(small_tensors(), JUNK)},
))
ZOO_STATES = st.one_of(JUNK, st.fixed_dictionaries(
    {"format_version": st.one_of(st.sampled_from([1, 2]), JUNK),
     "layers": st.one_of(st.dictionaries(LAYER_KEYS, ZOO_ENTRIES, max_size=3), JUNK)},
    optional={"objective": st.one_of(st.text(max_size=3), JUNK),
              "source_grouping": st.one_of(st.sampled_from(["layer", "kv_head"]), JUNK)},
))


@settings(max_examples=200, deadline=None)
@given(key_state=ZOO_STATES, value_state=st.one_of(st.just(GOOD_ZOO), ZOO_STATES))
def test_any_rotationzoo_structure_loads_or_fails_as_rotation_file_errors(key_state, value_state):
    with tempfile.TemporaryDirectory() as folder:
        key_file, value_file = write_zoo(folder, key_state, value_state)
        assert_loads_or_fails_clearly(lambda: Rotations.from_zoo(key_file, value_file))


TENSOR_NAMES = st.builds("{}.{}".format, st.sampled_from(["key", "value", "key_eigenvalues", "value_eigenvalues", "x"]),
                         st.sampled_from(["0", "1", "00", "²", "-1", "x", ""]))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1, 3) | st.floats(-1, 2) | st.text(max_size=2),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=5,
)
METADATA = st.dictionaries(
    st.sampled_from(["format_version", "retrieval_layers", "key_clip_ratios", "value_clip_ratios", "key_clip_ratio",
                     "value_clip_ratio", "clip_bits", "objective"]),
    st.one_of(st.text(max_size=4), JSON_VALUES.map(json.dumps)),
)


@settings(max_examples=200, deadline=None)
@given(tensors=st.dictionaries(TENSOR_NAMES, small_tensors(), max_size=4), metadata=METADATA)
def test_any_safetensors_content_loads_or_fails_as_rotation_file_errors(tensors, metadata):
    with tempfile.TemporaryDirectory() as folder:
        write_safetensors(pathlib.Path(folder), tensors, metadata)
        rotations = assert_loads_or_fails_clearly(lambda: Rotations.from_pretrained(folder))
        if rotations is not None:  # what loads answers the questions a cache asks, or refuses clearly
            assert_loads_or_fails_clearly(rotations.retrieval_layers)
            assert_loads_or_fails_clearly(lambda: rotations.clip_ratios(rotations.layer_ids[0]))


# ------------------------------------------------------------------------------------------- local path or Hub
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "local_files_only"])
def test_missing_relative_path_says_no_such_local_folder_first(monkeypatch, tmp_path, offline):
    monkeypatch.chdir(tmp_path)
    options = {"local_files_only": True} if offline == "local_files_only" else {}
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as error:
        Rotations.from_pretrained("rotations/no-such-model", cache_dir=str(tmp_path / "hub"), **options)
    message = str(error.value)
    tried = os.path.join(os.getcwd(), "rotations", "no-such-model")
    assert message.startswith(f"rotations 'rotations/no-such-model': no such local folder or file ({tried}); as a "
                              "Hub repo id it is not available either: ")
    assert "offline mode is on" in message
    assert message.index("no such local folder") < message.index("Hub")


def test_cache_with_a_missing_relative_rotations_path_says_no_such_local_folder_first(monkeypatch, tmp_path):
    from conftest import tiny_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError, match=r"^rotations 'rotations/none': no such local folder or file "
                                      r"\(.*rotations/none\); as a Hub repo id it is not available either"):
        OscarCache(tiny_config("llama"), rotations="rotations/none", local_files_only=True)


def test_path_that_is_no_valid_repo_id_says_no_such_local_folder_first(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^rotations 'rotations/x.git': no such local folder or file .*"
                                                r"'rotations/x.git' is not a valid Hub repo id"):
        resolve_rotation_folder("rotations/x.git", local_files_only=True)
    with pytest.raises(FileNotFoundError, match=r"^rotations './no/such/../folder': no such local folder or file .*"
                                                "not a Hub repo id of the form 'owner/name'"):
        resolve_rotation_folder("./no/such/../folder")


# ------------------------------------------------------------------------ RotationZoo names, metadata, clip ratios
def calibrated(layers=(0, 1, 2), heads=None, **metadata):
    rot = random_rotations(layers, heads=heads)
    rot.metadata.update({"key_objective": "ktk", "value_objective": "vtv", "objective": "key=ktk,value=vtv",
                         **metadata})
    return rot


@pytest.mark.parametrize("metadata, names", [
    ({"key_objective": "ktk", "value_objective": "softmax_diag"}, ("ktk_r_h_pbr", "softmax_diag_r_h_pbr")),
    ({"key_objective": "hadamard", "value_objective": "sst"}, ("hadamard", "sst_r_h_pbr")),
    ({"objective": "hadamard"}, ("hadamard", "hadamard")),
    ({"objective": "key=qqt_r_h_pbr,value=uresidual"}, ("qqt_r_h_pbr", "uresidual")),
    ({}, ("unknown", "unknown")),
])
def test_zoo_files_are_named_after_the_recorded_objective(tmp_path, metadata, names):
    rot = random_rotations(layers=(0,))
    rot.metadata = dict(metadata)
    key_file, value_file = rot.save_zoo(tmp_path)
    assert (os.path.basename(key_file), os.path.basename(value_file)) == (f"k_rotation_{names[0]}.pt",
                                                                          f"v_rotation_{names[1]}.pt")
    assert torch.load(key_file, weights_only=True)["objective"] == names[0]
    assert torch.load(value_file, weights_only=True)["objective"] == names[1]


def test_a_loaded_zoo_pair_saves_under_its_own_names(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    random_rotations().save_zoo(first, "ktk_r_h_pbr", "vtv_r_h_pbr")
    Rotations.from_pretrained(first).save_zoo(second)
    assert sorted(os.listdir(second)) == ["k_rotation_ktk_r_h_pbr.pt", "v_rotation_vtv_r_h_pbr.pt"]


@pytest.mark.parametrize("clips", [
    {"key_clip_ratios": json.dumps({"0": 0.75, "1": None, "2": 0.9}),
     "value_clip_ratios": json.dumps({"0": 0.6, "1": 0.95, "2": None})},
    {"key_clip_ratio": "0.8", "value_clip_ratio": "null"},
])
@pytest.mark.parametrize("heads", [None, 2])
def test_searched_clip_ratios_survive_the_zoo_round_trip(tmp_path, clips, heads):
    rot = calibrated(heads=heads, clip_bits="4", encoder="lloyd", **clips)
    rot.save_zoo(tmp_path)
    back = Rotations.from_pretrained(tmp_path)
    assert_same(back, rot)
    for i in rot.layer_ids:
        assert back.clip_ratios(i) == rot.clip_ratios(i) and back.clip_ratios(i, bits=4) == rot.clip_ratios(i)
    assert back.clip_ratios(0, bits=2) is None  # chosen for 4-bit rows
    assert {k: back.metadata[k] for k in rot.metadata if k != "objective"} == {
        k: v for k, v in rot.metadata.items() if k != "objective"}
    assert back.metadata["objective"] == "key=ktk_r_h_pbr,value=vtv_r_h_pbr"


def reference_loader(path, layer_ids, head_dim):
    """What SGLang's `load_oscar_rotations` (FutureMLS-Lab/OSCAR) does with a file: `layers[i]["rotation"]`,
    int or str keys, `[d, d]` or `[Hkv, d, d]`, nothing else read."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "layers" not in state:
        raise ValueError("missing 'layers' key")
    mats = []
    for i in layer_ids:
        entry = state["layers"].get(i, state["layers"].get(str(i)))
        rotation = entry["rotation"]
        assert rotation.shape[-2:] == (head_dim, head_dim) and rotation.dim() in (2, 3)
        mats.append(rotation.to(torch.bfloat16))
    return torch.stack(mats)


@pytest.mark.parametrize("heads", [None, 2])
def test_zoo_files_with_metadata_load_in_the_reference_loader(tmp_path, heads):
    rot = calibrated(heads=heads, key_clip_ratio="0.8", value_clip_ratio="0.7")
    key_file, value_file = rot.save_zoo(tmp_path)
    for path, table in ((key_file, rot.key), (value_file, rot.value)):
        assert torch.equal(reference_loader(path, [0, 1, 2], 16),
                           torch.stack([table[i] for i in (0, 1, 2)]).to(torch.bfloat16))
        state = torch.load(path, weights_only=True)
        assert set(state) == {"format_version", "objective", "source_grouping", "layers", "metadata"}
        assert set(state["layers"][0]) == {"layer_id", "rotation", "eigenvalues"}


def test_reference_zoo_files_without_metadata_load_without_clip_ratios(tmp_path):
    write_zoo(tmp_path, GOOD_ZOO, GOOD_ZOO)
    rot = Rotations.from_pretrained(tmp_path)
    assert rot.clip_ratios(0) is None and rot.metadata == {"objective": "key=unknown,value=unknown",
                                                           "source": "rotationzoo"}


def test_a_mixed_pair_keeps_each_sides_clip_ratios_or_warns(tmp_path, caplog):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    calibrated(layers=(0,), key_clip_ratio="0.8", value_clip_ratio="0.7", model="a").save_zoo(ours)
    calibrated(layers=(0,), key_clip_ratio="0.9", value_clip_ratio="0.6", model="b").save_zoo(theirs)
    mixed = Rotations.from_zoo(ours / "k_rotation_ktk_r_h_pbr.pt", theirs / "v_rotation_vtv_r_h_pbr.pt")
    assert mixed.clip_ratios(0) == (0.8, 0.6) and mixed.metadata["model"] == "a"
    reference = {"format_version": 1, "layers": {0: {"layer_id": 0, "rotation": torch.eye(16)}}}
    _, reference_value = write_zoo(tmp_path / "reference", reference, reference)
    with caplog.at_level(logging.WARNING):
        mixed = Rotations.from_zoo(ours / "k_rotation_ktk_r_h_pbr.pt", reference_value)
    assert mixed.clip_ratios(0) is None
    assert "the key file records clip ratios ['key_clip_ratio']" in caplog.text
    assert "the value file none" in caplog.text and "none are kept" in caplog.text


@pytest.mark.parametrize("metadata", [["a"], {"clip": 0.8}, {1: "x"}])
def test_malformed_zoo_metadata_fails_as_a_rotation_file_error(tmp_path, metadata):
    write_zoo(tmp_path, {**GOOD_ZOO, "metadata": metadata}, GOOD_ZOO)
    with pytest.raises(RotationFileError, match="metadata is .*; expected a dict {str: str}"):
        Rotations.from_pretrained(tmp_path)
