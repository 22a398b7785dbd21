"""`Rotations` on the Hub with huggingface_hub's semantics (`ModelHubMixin`'s from_pretrained / save_pretrained /
push_to_hub), and the model card built with `ModelCard` / `ModelCardData`. No network: `HfApi` is replaced."""

import inspect
import os

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, ModelHubMixin

from oscar_hf import Rotations
from oscar_hf.rotations.card import model_card

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def random_rotations(layers=(0, 1), d=16):
    """Random orthogonal rotations (QR of Gaussian matrices)."""
    torch.manual_seed(0)
    key = {i: torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].float() for i in layers}
    value = {i: torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].float() for i in layers}
    return Rotations(key, value, metadata={"objective": "test"})


def assert_same(a: Rotations, b: Rotations):
    assert a.layer_ids == b.layer_ids
    assert all(torch.equal(a.key[i], b.key[i]) and torch.equal(a.value[i], b.value[i]) for i in a.layer_ids)


class RecordingApi:
    """`huggingface_hub.HfApi` that records calls and keeps a copy of every uploaded folder's files."""

    calls: list = []

    def __init__(self, token=None):
        RecordingApi.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        RecordingApi.calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        folder = kwargs["folder_path"]
        files = {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}
        RecordingApi.calls.append(("upload_folder", kwargs, files))
        return "https://huggingface.co/me/rot/commit/abc"


@pytest.fixture
def api(monkeypatch):
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi


def test_signatures_follow_model_hub_mixin():
    for name in ("from_pretrained", "save_pretrained", "push_to_hub"):
        ours, theirs = inspect.signature(getattr(Rotations, name)), inspect.signature(getattr(ModelHubMixin, name))
        for parameter in theirs.parameters.values():
            if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) or parameter.name in (
                    "config", "proxies", "resume_download"):
                continue  # rotations have no config.json; older huggingface_hub releases' deprecated arguments
            assert parameter.name in ours.parameters, (name, parameter.name)
            assert ours.parameters[parameter.name].kind == parameter.kind, (name, parameter.name)


def test_push_to_hub_uploads_rotations_and_card_in_one_commit(api, tmp_path):
    rot = random_rotations()
    rot.metadata.update(model=SMOLLM2, tokens="20480")
    url = rot.push_to_hub("me/rot", subfolder="smollm2", private=True, token="hf_test", branch="dev",
                          commit_message="add rotations")
    assert url == "https://huggingface.co/me/rot/commit/abc"
    assert api.calls[0] == ("init", "hf_test")
    assert api.calls[1][1] == "me/rot" and api.calls[1][2] == {"private": True, "exist_ok": True}
    _, upload, files = api.calls[2]
    assert upload["repo_id"] == "me/rot" and upload["path_in_repo"] == "smollm2" and upload["revision"] == "dev"
    assert upload["commit_message"] == "add rotations" and upload["repo_type"] == "model"
    assert sorted(files) == ["README.md", "oscar_rotations.safetensors"]
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == SMOLLM2 and card.data.library_name == "oscar-hf"
    assert "rotations='me/rot', subfolder='smollm2'" in card.text
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "oscar_rotations.safetensors").write_bytes(files["oscar_rotations.safetensors"])
    assert_same(Rotations.from_pretrained(tmp_path / "back"), rot)


def test_save_pretrained_with_push_to_hub_returns_the_commit_url(api, tmp_path):
    url = random_rotations().save_pretrained(tmp_path / "rot", push_to_hub=True, repo_id="me/rot", token="hf_test")
    assert url == "https://huggingface.co/me/rot/commit/abc"
    assert api.calls[1][1] == "me/rot"


@pytest.mark.parametrize("repo_id, token, message", [
    ("me/bad--id", "hf_test", "'me/bad--id' is not a valid Hub repo id"),
    ("me/rot", None, "uploading to 'me/rot' needs a Hub token"),
])
def test_push_to_hub_checks_repo_id_and_token_before_any_request(api, monkeypatch, repo_id, token, message):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(ValueError, match=message):
        random_rotations().push_to_hub(repo_id, token=token)
    assert api.calls == []


def test_save_pretrained_keeps_a_folders_config_and_card(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "README.md").write_text("the model's own card")
    random_rotations().save_pretrained(tmp_path)
    assert (tmp_path / "config.json").read_text() == '{"model_type": "llama"}'
    assert (tmp_path / "README.md").read_text() == "the model's own card"
    assert (tmp_path / "oscar_rotations.safetensors").is_file()


def test_from_pretrained_passes_hub_options_to_snapshot_download(monkeypatch, tmp_path):
    rot = random_rotations()
    rot.save_pretrained(tmp_path / "snapshot")
    calls = {}

    def fake_snapshot_download(repo_id, **kwargs):
        calls.update(kwargs, repo_id=repo_id)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    back = Rotations.from_pretrained("me/rot", force_download=True, token="hf_test", cache_dir=tmp_path / "cache",
                                     revision="v2")
    assert_same(back, rot)
    assert calls["force_download"] is True and calls["token"] == "hf_test" and calls["revision"] == "v2"
    assert calls["cache_dir"] == str(tmp_path / "cache")
    with pytest.raises(TypeError):
        Rotations.from_pretrained("me/rot", "subfolder")  # keyword-only, as ModelHubMixin's


def test_card_of_a_hub_model_names_it_as_base_model():
    card = model_card({"model": SMOLLM2, "model_revision": "", "tokens": "20480", "model_type": "llama"},
                      repo_id="me/rot")
    assert card.data.base_model == SMOLLM2
    assert card.text.lstrip().startswith(f"# OSCAR KV-cache rotations for {SMOLLM2}")
    assert "Model revision" not in card.text and "| Calibration tokens | `20480` |" in card.text
    assert "https://github.com/)" not in card.text and "path/to/this/folder" not in card.text


def test_card_of_a_local_model_keeps_its_path_out_of_title_and_base_model(tmp_path):
    card = model_card({"model": str(tmp_path), "model_type": "qwen3"}, local_folder="rotations/x")
    assert card.data.base_model is None
    assert card.text.lstrip().startswith("# OSCAR KV-cache rotations for a local qwen3 model")
    assert f"| Model | `{tmp_path}` |" in card.text and "rotations='rotations/x'" in card.text


def test_card_escapes_table_cells():
    card = model_card({"model": "./m", "created_with": "oscar-calibrate --data a|b"})
    assert "| created_with | `oscar-calibrate --data a\\|b` |" in card.text
