"""Data of the tiny test tasks: tiny.jsonl beside this file, whatever the working directory."""

import os

from oscar_hf.eval.lm_eval_tasks.task_data import jsonl_dataset


def tiny(**_metadata):
    return jsonl_dataset(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.jsonl"))
