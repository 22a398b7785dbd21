"""Calibration text: a text file, a JSON-lines file, a `datasets` name, or the bundled Shakespeare plays, turned
into `[1, L]` token-id sequences of at most `context` tokens, `tokens` in all.

- `.txt` (or any other file): the whole file is one document.
- `.jsonl`: one record per line; the text is the `text_field` (default "text"), or `messages` (a chat, rendered
  with the tokenizer's chat template), or `prompt`.
- `shakespeare` / `shakespeare:calibration`: the calibration plays of `oscar_hf.assets` (offline);
  `shakespeare:evaluation` the held-out plays (for experiments, never for calibration).
- anything else: `datasets.load_dataset(name, config, split=split)` and its `text_field` column.

With `chat_template=True`, plain texts are wrapped as one user message and rendered with the chat template.
Documents longer than `context` are cut into consecutive windows; a final window shorter than `min_tokens` is
dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SHAKESPEARE = "shakespeare"


class CalibrationDataError(ValueError):
    """The calibration data is missing, empty or unreadable."""


@dataclass
class Document:
    text: str | None = None
    messages: list[dict] | None = None


def load_documents(source: str, text_field: str = "text", split: str = "train",
                   config: str | None = None) -> list[Document]:
    """Documents of `source` (see module docstring); raises `CalibrationDataError` when there are none."""
    if source == SHAKESPEARE or source.startswith(SHAKESPEARE + ":"):
        documents = _shakespeare(source.partition(":")[2] or "calibration")
    elif os.path.isfile(source):
        documents = _jsonl(source, text_field) if source.endswith((".jsonl", ".json")) else _text_file(source)
    elif os.path.exists(source):
        raise CalibrationDataError(f"{source} is a folder; pass a .txt or .jsonl file, or a datasets name")
    else:
        documents = _dataset(source, text_field, split, config)
    documents = [d for d in documents if (d.text and d.text.strip()) or d.messages]
    if not documents:
        raise CalibrationDataError(f"the calibration data {source!r} holds no text")
    return documents


def _shakespeare(part: str) -> list[Document]:
    from oscar_hf.eval.assets import CALIBRATION_PLAYS, EVALUATION_PLAYS, play_text

    plays = {"calibration": CALIBRATION_PLAYS, "evaluation": EVALUATION_PLAYS}
    if part not in plays:
        raise CalibrationDataError(f"shakespeare:{part}: expected shakespeare:calibration or shakespeare:evaluation")
    return [Document(text=play_text(name)) for name in plays[part]]


def _text_file(path: str) -> list[Document]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [Document(text=f.read())]


def _jsonl(path: str, text_field: str) -> list[Document]:
    documents = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{path}:{number}: not valid JSON ({e.msg})") from e
            if isinstance(record, str):
                documents.append(Document(text=record))
            elif isinstance(record, dict) and isinstance(record.get(text_field), str):
                documents.append(Document(text=record[text_field]))
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                documents.append(Document(messages=record["messages"]))
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                documents.append(Document(text=record["prompt"]))
            else:
                raise CalibrationDataError(
                    f"{path}:{number}: expected a string or an object with {text_field!r}, 'messages' or 'prompt'"
                )
    return documents


def _dataset(name: str, text_field: str, split: str, config: str | None) -> list[Document]:
    try:
        import datasets
    except ImportError as e:
        raise CalibrationDataError(
            f"{name!r} is not a file; loading it as a datasets name needs `pip install datasets`"
        ) from e
    try:
        table = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ConnectionError)
        raise CalibrationDataError(f"{name!r} is neither a file nor a loadable dataset: {e}") from e
    if text_field in table.column_names:
        return [Document(text=t) for t in table[text_field] if isinstance(t, str)]
    if "messages" in table.column_names:
        return [Document(messages=m) for m in table["messages"]]
    raise CalibrationDataError(f"dataset {name!r} has no {text_field!r} column (columns: {table.column_names})")


def encode(tokenizer, document: Document, chat_template: bool) -> list[int]:
    """Token ids of one document (chat template applied to messages, or to the text when `chat_template`)."""
    messages = document.messages
    if messages is None and chat_template:
        messages = [{"role": "user", "content": document.text}]
    if messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise CalibrationDataError("the data holds chat messages but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(document.text).input_ids


def token_sequences(tokenizer, documents: Iterable[Document], tokens: int, context: int,
                    chat_template: bool = False, min_tokens: int = 16) -> list[torch.Tensor]:
    """`[1, L]` sequences, `L <= context`, `tokens` in total (the last one cut to fit)."""
    if tokens < 1 or context < 1:
        raise ValueError(f"tokens={tokens}, context={context}: both must be >= 1")
    sequences, total = [], 0
    for document in documents:
        ids = encode(tokenizer, document, chat_template)
        for start in range(0, len(ids), context):
            window = ids[start : start + context][: tokens - total]
            if len(window) < min(min_tokens, tokens - total):
                break
            sequences.append(torch.tensor([window], dtype=torch.long))
            total += len(window)
            if total >= tokens:
                return sequences
    if not sequences:
        raise CalibrationDataError("the calibration data tokenized to no sequence long enough to use")
    return sequences
