"""Prompt datasets: JSONL (one object per line) or Parquet (one row per record).

Every record is validated when the file is loaded, so a bad file fails at start-up, not hours into a
run, with one DataError that names the file and the line (Parquet: the row, 1-based) and what is wrong.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


class DataError(ValueError):
    pass


@dataclass
class PromptRecord:
    index: int  # position in the file (0-based)
    prompt: Any  # string, or a list of {"role": ..., "content": ...} chat messages
    reference: Optional[str]  # reference answer as a string (numbers converted), None if the file has none
    metadata: dict = field(default_factory=dict)  # the record's other fields, handed to the reward


def _check_prompt(value, where: str, key: str):
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {key!r} is an empty string")
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: field {key!r} is a list, so it must hold chat messages "
                                f"{{\"role\": str, \"content\": str}}; message {i} is {m!r:.80}")
        return value
    raise DataError(f"{where}: field {key!r} must be a string or a non-empty list of chat messages, "
                    f"got {type(value).__name__} {value!r:.80}")


def _check_reference(value, where: str, key: str) -> str:
    # bool is an int subclass, but True as a reference answer is almost surely a data bug
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {key!r} must be a string or a number, "
                        f"got {type(value).__name__} {value!r:.80}")
    return str(value)


def _record(obj, where: str, index: int, prompt_key: str, answer_key: Optional[str]) -> PromptRecord:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with field {prompt_key!r}, "
                        f"got {type(obj).__name__} {obj!r:.80}")
    missing = [k for k in (prompt_key, answer_key) if k is not None and (k not in obj or obj[k] is None)]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r} (fields present: {', '.join(map(str, obj)) or 'none'}; "
                        f"field names are set by prompts.prompt_key / prompts.answer_key)")
    prompt = _check_prompt(obj[prompt_key], where, prompt_key)
    ref = _check_reference(obj[answer_key], where, answer_key) if answer_key is not None else None
    meta = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key)}
    return PromptRecord(index, prompt, ref, meta)


def read_jsonl(path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer") -> list[PromptRecord]:
    with open(path, "rb") as f:
        raw_lines = f.read().split(b"\n")
    records = []
    for lineno, raw in enumerate(raw_lines, 1):
        where = f"{path}: line {lineno}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.object[e.start]:#04x} at column {e.start + 1})") from None
        if not text.strip():  # blank lines (e.g. the trailing newline) are not records
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON at column {e.colno}: {e.msg}") from None
        records.append(_record(obj, where, len(records), prompt_key, answer_key))
    if not records:
        raise DataError(f"{path}: line 1: file is empty (expected one JSON object per line)")
    return records


def read_parquet(path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer") -> list[PromptRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'rlpo_mega[parquet]'), "
                        f"or convert the file to JSONL") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    for key in (prompt_key, answer_key):
        if key is not None and key not in table.column_names:
            raise DataError(f"{path}: row 1: missing field {key!r} (columns: {', '.join(table.column_names)}; "
                            f"field names are set by prompts.prompt_key / prompts.answer_key)")
    rows = table.to_pylist()
    if not rows:
        raise DataError(f"{path}: row 1: file has no rows")
    return [_record(row, f"{path}: row {i + 1}", i, prompt_key, answer_key) for i, row in enumerate(rows)]


def load_prompts(path: str, fmt: str = "auto", prompt_key: str = "prompt",
                 answer_key: Optional[str] = "answer") -> list[PromptRecord]:
    """All records of a prompt file, validated. fmt: auto (by extension) | jsonl | parquet."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: prompt file does not exist")
    if fmt == "auto":
        ext = os.path.splitext(path)[1].lower()
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}.get(ext, "")
        if not fmt:
            raise DataError(f"{path}: cannot tell the format from the extension {ext!r}; "
                            f"set prompts.format to jsonl or parquet")
    if fmt == "jsonl":
        return read_jsonl(path, prompt_key, answer_key)
    if fmt == "parquet":
        return read_parquet(path, prompt_key, answer_key)
    raise DataError(f"{path}: unknown prompts.format {fmt!r} (auto | jsonl | parquet)")
