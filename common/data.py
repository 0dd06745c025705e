"""QA datasets in the FlashRAG jsonl format, with validation that names the file and line."""
import json
import random
from pathlib import Path


class DataError(ValueError):
    """A data file is malformed; the message names the file and line."""


def iter_jsonl(path, required=()):
    """Yield (line number, row) from a jsonl file, checking that each row is an object with `required` keys."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise DataError(f"{path}:{lineno}: missing field {', '.join(map(repr, missing))}")
            yield lineno, row


def read_jsonl(path, required=()):
    """All rows of a jsonl file as a list of dicts (see iter_jsonl for the checks)."""
    return [row for _, row in iter_jsonl(path, required)]


def write_jsonl(path, rows):
    """Write rows as jsonl atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def load_qa(path):
    """Load FlashRAG QA rows {"id", "question", "golden_answers", "metadata"} ("metadata" optional, default {})."""
    rows = []
    for lineno, row in iter_jsonl(path, required=("id", "question", "golden_answers")):
        where = f"{path}:{lineno}"
        if not isinstance(row["question"], str) or not row["question"].strip():
            raise DataError(f"{where}: field 'question' must be a non-empty string")
        answers = row["golden_answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"{where}: field 'golden_answers' must be a non-empty list of strings, got {answers!r}")
        if not isinstance(row.setdefault("metadata", {}), dict):
            raise DataError(f"{where}: field 'metadata' must be an object")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_split(data_dir, split, types=""):
    """QA rows of data_dir/<split>.jsonl whose metadata "type" is one of the comma-separated `types` (all if empty)."""
    wanted = set(filter(None, types.split(",")))
    return [r for r in load_qa(Path(data_dir) / f"{split}.jsonl") if not wanted or r["metadata"].get("type") in wanted]


def sample_rows(rows, n, seed):
    """A seeded sample of n rows without replacement; all rows (in a seeded order) when n is None or >= len(rows)."""
    n = len(rows) if n is None or n >= len(rows) else n
    return random.Random(seed).sample(list(rows), n)
