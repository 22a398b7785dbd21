"""Data of the tasks in this folder, read from the jsonl files beside their YAML whatever the working directory.

A task YAML names its loader with `custom_dataset: !function task_data.<name>`; lm-eval imports this file from the
YAML's folder and calls the loader with the run's metadata (which it ignores). `datasets`' own `data_files` would
resolve against the working directory instead.
"""

from __future__ import annotations

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def jsonl_dataset(path: str, split: str = "test") -> dict[str, datasets.Dataset]:
    """`{split: Dataset}` of the jsonl file at `path` (one JSON object per line)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {split: datasets.Dataset.from_list(rows, split=split)}


def romeo(**_metadata) -> dict[str, datasets.Dataset]:
    """`romeo_ppl`: two 1536-token passages of Romeo and Juliet."""
    return jsonl_dataset(os.path.join(HERE, "romeo.jsonl"))
