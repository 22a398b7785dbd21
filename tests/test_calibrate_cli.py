"""oscar-calibrate end to end on a tiny model: files load back bit-exactly, in the reference's schema, into
OscarCache; the Hub upload carries a provenance card; bad inputs fail clearly."""

import json

import pytest
import torch
import transformers

from oscar_hf import OscarCache, RotationFileError, Rotations, UnsupportedModelError
from oscar_hf.calibrate import CalibrationDataError, CalibrationSettings, NoAttentionError, calibrate, cli
from oscar_hf.calibrate.hub import model_card, push_to_hub

from conftest import forward, tiny_model

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 60


@pytest.fixture
def model_folder(tmp_path):
    """A tiny Llama and a word-level tokenizer saved as a local model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.replace(",", " ").replace(".", " ").split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[UNK]")
    model = tiny_model("llama")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text(TEXT)
    return path


def run_cli(*argv):
    return cli.main([str(a) for a in argv])


def test_cli_writes_rotations_that_load_bit_exactly_and_run(model_folder, text_file, tmp_path, capsys):
    out = tmp_path / "rotations"
    assert run_cli("--model", model_folder, "--data", text_file, "--tokens", 300, "--context", 128,
                   "--out", out, "--format", "both", "--per-head", "--no-progress") == 0
    printed = capsys.readouterr().out
    assert "Rotations(2 layers, head_dim=16, per KV head" in printed and "OscarCache(model, rotations=" in printed
    ours = Rotations.from_pretrained(out)  # the safetensors file is preferred when both formats are present
    zoo = Rotations.from_zoo(out / "k_rotation_qqt_r_h_pbr.pt", out / "v_rotation_sst_r_h_pbr.pt")
    for i in (0, 1):
        assert torch.equal(ours.key[i], zoo.key[i]) and torch.equal(ours.value[i], zoo.value[i])
        assert torch.equal(ours.key_eigenvalues[i], zoo.key_eigenvalues[i])
    state = torch.load(out / "v_rotation_sst_r_h_pbr.pt", weights_only=True)
    assert state["format_version"] == 2 and state["source_grouping"] == "kv_head"
    assert state["objective"] == "sst_r_h_pbr"
    eigenvalues = state["layers"][1]["eigenvalues"]
    assert eigenvalues.shape == (2, 16) and bool((eigenvalues.diff(dim=-1) >= 0).all())  # ascending, as eigh
    assert ours.metadata["tokens"] == "300" and ours.metadata["key_objective"] == "qqt"
    assert ours.metadata["grouping"] == "kv_head" and ours.metadata["library"].startswith("oscar-hf ")
    card = (out / "README.md").read_text()
    assert "| Calibration tokens | `300` |" in card and str(text_file) in card

    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    cache = OscarCache(model, rotations=str(out), sink_tokens=4, recent_tokens=8)
    forward(model, torch.randint(1, 20, (1, 40)), cache)
    assert cache.layers[0].history_length > 0
    assert torch.equal(cache.layers[1].key_rotation.cpu(), ours.key[1])


def test_cli_shared_rotations_use_format_v1(model_folder, text_file, tmp_path):
    out = tmp_path / "shared"
    run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 100, "--out", out,
            "--format", "zoo", "--value-objective", "softmax_diag", "--tiered", "--sink", 4, "--recent", 8,
            "--no-progress")
    state = torch.load(out / "k_rotation_qqt_r_h_pbr.pt", weights_only=True)
    assert state["format_version"] == 1 and state["source_grouping"] == "layer"
    assert state["layers"][0]["rotation"].shape == (16, 16)
    assert (out / "v_rotation_softmax_diag_r_h_pbr.pt").exists()


def test_cli_clip_search_records_ratios(model_folder, text_file, tmp_path):
    out = tmp_path / "clipped"
    run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 200, "--out", out,
            "--clip-search", "layer", "--clip-tokens", 200, "--sink", 4, "--recent", 8, "--no-progress")
    metadata = Rotations.from_pretrained(out).metadata
    key_ratios = json.loads(metadata["key_clip_ratios"])
    assert set(key_ratios) == {"0", "1"}
    assert all(r is None or 0 < r <= 1 for r in key_ratios.values())
    assert metadata["clip_search_tokens"] == "200" and metadata["clip_bits"] == "2"


def test_cli_retrieval_ranking_needs_a_tokenizer_that_spells_the_needles(model_folder, text_file, tmp_path):
    # a word-level tokenizer turns every needle value into [UNK]: the ranking says so instead of ranking noise
    with pytest.raises(ValueError, match="does not decode back"):
        run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 200, "--out",
                tmp_path / "ranked", "--sink", 4, "--recent", 8, "--no-progress", "--rank-retrieval-layers",
                "--rank-lengths", 300)


def test_push_to_hub_uploads_folder_with_provenance_card(tmp_path):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return type("Commit", (), {"commit_url": "https://hub/commit/1"})()

    folder = tmp_path / "rot"
    folder.mkdir()
    metadata = {"model": "org/model", "data": "shakespeare", "tokens": "20000", "key_objective": "qqt",
                "value_objective": "sst", "library": "oscar-hf 0.1.0"}
    url = push_to_hub(folder, "me/rotations", metadata, subfolder="smollm2", api=FakeApi())
    assert url == "https://hub/commit/1"
    assert calls[0][:2] == ("create_repo", "me/rotations") and calls[0][2]["exist_ok"] is True
    upload = calls[1][1]
    assert upload["repo_id"] == "me/rotations" and upload["path_in_repo"] == "smollm2"
    card = (folder / "README.md").read_text()
    for value in ("org/model", "shakespeare", "20000", "qqt", "sst", "oscar-hf 0.1.0"):
        assert f"`{value}`" in card
    assert "base_model: org/model" in card and "subfolder='smollm2'" in card


def test_model_card_lists_unknown_metadata_too():
    assert "| custom | `42` |" in model_card({"model": "./local", "custom": "42"})


# ------------------------------------------------------------------------------------------------ bad inputs
def test_empty_data_fails_clearly(model_folder, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(CalibrationDataError, match="holds no text"):
        run_cli("--model", model_folder, "--data", empty, "--out", tmp_path / "o", "--no-progress")
    with pytest.raises(ValueError, match="no calibration sequences"):
        calibrate(tiny_model("llama"), [])


def test_bad_jsonl_and_missing_dataset_fail_clearly(model_folder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(CalibrationDataError, match=r"bad.jsonl:2: expected a string or an object"):
        run_cli("--model", model_folder, "--data", bad, "--out", tmp_path / "o", "--no-progress")


def test_bad_token_count_fails_clearly(model_folder, text_file, tmp_path):
    with pytest.raises(SystemExit, match="--tokens must be >= 1"):
        run_cli("--model", model_folder, "--data", text_file, "--tokens", 0, "--out", tmp_path / "o")


def test_model_without_attention_layers_fails_clearly():
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4)
    mamba = transformers.MambaForCausalLM(config).eval()
    with pytest.raises((UnsupportedModelError, NoAttentionError), match="nothing to calibrate|attention"):
        calibrate(mamba, [torch.randint(0, 32, (1, 20))])


def test_model_that_never_calls_attention_fails_clearly():
    model = tiny_model("llama")
    model.config.num_hidden_layers = 3  # the config promises a layer that never runs
    with pytest.raises(NoAttentionError, match=r"layers \[2\] were never called"):
        calibrate(model, [torch.randint(1, 96, (1, 20))])


def test_rotations_of_another_model_fail_clearly():
    rotations = calibrate(tiny_model("llama"), [torch.randint(1, 96, (1, 40))])
    bigger = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(RotationFileError, match="made for another model"):
        OscarCache(bigger, rotations=rotations)
    other_heads = tiny_model("llama", num_attention_heads=2, head_dim=32)
    with pytest.raises(RotationFileError, match="made for another model"):
        OscarCache(other_heads, rotations=rotations)


def test_settings_validate_objectives():
    with pytest.raises(ValueError, match="key objective 'kk'"):
        CalibrationSettings(key_objective="kk")
