"""Rotation files: RotationZoo v1/v2 and our safetensors format round-trip bit-exactly; bad files fail clearly."""

import os
import pickle

import pytest
import torch

from oscar_hf import RotationFileError, Rotations
from oscar_hf.rotations.hub import resolve_rotation_folder
from oscar_hf.rotations.io import load_zoo_file
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
def test_zoo_round_trip_is_bit_exact_in_reference_schema(tmp_path, heads):
    rot = random_rotations(heads=heads)
    key_file, value_file = rot.save_zoo(tmp_path)
    state = torch.load(key_file, weights_only=True)
    assert state["format_version"] == (2 if heads else 1)
    assert state["source_grouping"] == ("kv_head" if heads else "layer")
    assert state["objective"] == "qqt_r_h_pbr"
    assert set(state["layers"]) == {0, 1, 2}
    entry = state["layers"][1]
    assert entry["layer_id"] == 1 and entry["rotation"].dtype == torch.float32 and entry["rotation"].is_contiguous()
    assert entry["rotation"].shape == ((2, 16, 16) if heads else (16, 16))
    assert_same(Rotations.from_pretrained(tmp_path), rot)


def test_zoo_file_with_string_layer_keys_loads(tmp_path):
    rot = random_rotations()
    key_file, value_file = rot.save_zoo(tmp_path)
    state = torch.load(key_file, weights_only=True)
    state["layers"] = {str(k): v for k, v in state["layers"].items()}
    torch.save(state, key_file)
    assert_same(Rotations.from_zoo(key_file, value_file), rot)


def test_safetensors_round_trip_keeps_tensors_and_metadata(tmp_path):
    rot = random_rotations(heads=2)
    path = rot.save_pretrained(tmp_path)
    assert os.path.basename(path) == "oscar_rotations.safetensors"
    back = Rotations.from_pretrained(tmp_path)
    assert_same(back, rot)
    assert back.metadata["objective"] == "test" and back.per_head


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_object_is_refused(tmp_path):
    raw = tmp_path / "k_rotation_raw.pt"
    with open(raw, "wb") as f:
        pickle.dump({"format_version": 1, "layers": {0: Payload()}}, f)
    saved = tmp_path / "k_rotation_saved.pt"
    torch.save({"format_version": 1, "layers": {0: {"rotation": Payload()}}}, saved)
    for path in (raw, saved):
        with pytest.raises(RotationFileError, match="could not be loaded safely"):
            load_zoo_file(str(path))


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
    per_head = random_rotations(layers=(0,), heads=3)
    with pytest.raises(RotationFileError, match="3 per-head matrices but the model has 2 KV heads"):
        per_head.check_model([0], head_dim=16, num_kv_heads=2)


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
