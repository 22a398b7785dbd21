"""Calibration data: files, JSON lines (text, chat messages), windows and token budgets."""

import json

import pytest
import torch

from oscar_hf.calibrate.data import CalibrationDataError, Document, load_documents, token_sequences


class CharTokenizer:
    """One id per character; a chat template that wraps each turn in brackets."""

    chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": [ord(c) % 97 for c in text]})()

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        return self("".join(f"[{m['content']}]" for m in messages)).input_ids


@pytest.mark.quick
def test_text_file_is_cut_into_windows_up_to_the_budget(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x" * 1000)
    sequences = token_sequences(CharTokenizer(), load_documents(str(path)), tokens=450, context=200)
    assert [s.shape for s in sequences] == [torch.Size([1, 200]), torch.Size([1, 200]), torch.Size([1, 50])]


@pytest.mark.quick
def test_jsonl_text_messages_and_prompt_records(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [{"text": "abc"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "xyz"}, "plain"]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    documents = load_documents(str(path))
    assert [d.text for d in documents] == ["abc", None, "xyz", "plain"]
    sequences = token_sequences(CharTokenizer(), documents, tokens=100, context=50, min_tokens=1)
    assert sequences[1][0].tolist() == CharTokenizer()("[hi]").input_ids  # the chat template was applied


@pytest.mark.quick
def test_chat_template_option_wraps_plain_text():
    sequences = token_sequences(CharTokenizer(), [Document(text="ab")], tokens=10, context=10, chat_template=True,
                                min_tokens=1)
    assert sequences[0][0].tolist() == CharTokenizer()("[ab]").input_ids


@pytest.mark.quick
def test_chat_messages_without_a_template_fail_clearly():
    class NoTemplate(CharTokenizer):
        chat_template = None

    with pytest.raises(CalibrationDataError, match="no chat template"):
        token_sequences(NoTemplate(), [Document(messages=[{"role": "user", "content": "x"}])], 10, 10)


@pytest.mark.quick
def test_shakespeare_calibration_and_evaluation_plays_are_disjoint():
    calibration = load_documents("shakespeare")
    evaluation = load_documents("shakespeare:evaluation")
    assert len(calibration) == 4 and len(evaluation) == 4
    assert not {d.text[:2000] for d in calibration} & {d.text[:2000] for d in evaluation}
    with pytest.raises(CalibrationDataError, match="shakespeare:calibration or shakespeare:evaluation"):
        load_documents("shakespeare:other")


def test_folder_and_unknown_dataset_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(CalibrationDataError, match="is a folder"):
        load_documents(str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CalibrationDataError, match="neither a file nor a loadable dataset"):
        load_documents("nobody/no-such-dataset-here")
