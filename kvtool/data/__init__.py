"""The prompt sets kvtool ships (calibration.jsonl, evaluation.jsonl beside this file) and the
loader and validation of JSONL prompt files, shipped or the user's."""

from kvtool.data.records import (
    DEFAULT_DATA,
    EVALUATION_DATA,
    Record,
    dataset_hash,
    load_jsonl,
    of_kinds,
    packaged_data,
    select_by_kind,
    select_samples,
    split_by_kind,
)

__all__ = [
    "DEFAULT_DATA",
    "EVALUATION_DATA",
    "Record",
    "dataset_hash",
    "load_jsonl",
    "of_kinds",
    "packaged_data",
    "select_by_kind",
    "select_samples",
    "split_by_kind",
]
