"""QA datasets in the FlashRAG jsonl format, with validation that names the file and line; `python -m common.data`
mixes several into one split (a paper's training set drawn from several datasets):

    python -m common.data --out data/c3po/train.jsonl --n 6000 flashrag/nq/train.jsonl flashrag/hotpotqa/train.jsonl
"""

import json
import random
import warnings
from pathlib import Path


class UserError(ValueError):
    """A mistake in what the user gave (a data file, a model name, a flag): reported as one line, no traceback."""


class DataError(UserError):
    """A data file is malformed; the message names the file and line."""


def iter_jsonl(path, required=()):
    """Yield (line number, row) from a jsonl file, checking that each row is an object with `required` keys; a line
    that is not UTF-8 or not JSON is a DataError naming the file and line (a UTF-8 byte-order mark is allowed)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
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
    """Load FlashRAG QA rows {"id", "question", "golden_answers", "metadata"} ("metadata" optional, default {}).

    A row may give its gold list as "answers" (C-3PO's raw format): it becomes "golden_answers". The id must be a
    non-empty string or an integer; the gold list must hold strings, at least one of them not blank (blank ones
    beside real answers are dropped: they would match an empty prediction)."""
    rows = []
    for lineno, row in iter_jsonl(path, required=("id", "question")):
        where = f"{path}:{lineno}"
        field = "golden_answers" if "golden_answers" in row or "answers" not in row else "answers"
        if field not in row:
            raise DataError(f"{where}: missing field 'golden_answers' (or 'answers')")
        qid = row["id"]
        if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
            raise DataError(f"{where}: field 'id' must be a non-empty string or an integer, got {qid!r}")
        if not isinstance(row["question"], str) or not row["question"].strip():
            raise DataError(f"{where}: field 'question' must be a non-empty string")
        answers = row.pop(field)
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"{where}: field {field!r} must be a non-empty list of strings, got {answers!r}")
        if not any(a.strip() for a in answers):
            raise DataError(f"{where}: field {field!r} holds only empty answers, got {answers!r}")
        row["golden_answers"] = [a for a in answers if a.strip()]
        if not isinstance(row.setdefault("metadata", {}), dict):
            raise DataError(f"{where}: field 'metadata' must be an object")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def require_metadata(rows, keys, path, purpose):
    """A DataError naming the file, the first row (its id) that lacks one of the metadata `keys`, and what needs
    them (`purpose`, e.g. "the toy oracle teacher"); data/README.md lists each method's fields."""
    for row in rows:
        if missing := [k for k in keys if k not in row.get("metadata", {})]:
            raise DataError(
                f"{path}: row {row['id']!r} has no metadata {', '.join(map(repr, missing))}, which {purpose} needs "
                f"(data/README.md lists the fields each method reads)"
            )


def load_split(data_dir, split, types=""):
    """QA rows of data_dir/<split>.jsonl whose metadata "type" is one of `types` (comma-separated or a list; all rows
    if empty or None). A row without a type never matches a filter. When no row of the file has a type (a plain
    FlashRAG dataset), the filter does not apply: all rows come back, with a warning. When rows have types but none
    is wanted, a DataError names the file, the wanted types and those present."""
    path = Path(data_dir) / f"{split}.jsonl"
    rows = load_qa(path)
    wanted = types.split(",") if isinstance(types, str) else list(types or ())
    wanted = sorted({t.strip() for t in wanted if t.strip()})
    if not wanted:
        return rows
    present = sorted({str(r["metadata"]["type"]) for r in rows if r["metadata"].get("type") is not None})
    if not present:
        warnings.warn(
            f"{path}: no row has a metadata 'type', so the type filter {','.join(wanted)} is ignored "
            f"(all {len(rows)} rows used)",
            stacklevel=2,
        )
        return rows
    kept = [r for r in rows if r["metadata"].get("type") in wanted]
    if not kept:
        raise DataError(f"{path}: no row of type {', '.join(wanted)}; the types present are {', '.join(present)}")
    return kept


def sample_rows(rows, n, seed):
    """A seeded sample of n rows without replacement; all rows (in a seeded order) when n is None or >= len(rows)."""
    n = len(rows) if n is None or n >= len(rows) else n
    return random.Random(seed).sample(list(rows), n)


def mix(paths, n=None, seed=0):
    """The rows of several QA files (FlashRAG or C-3PO's raw rows), at most n sampled from each (seeded), each id
    prefixed by its file's folder name (FlashRAG's ids, e.g. "train_0", repeat across datasets), recorded in
    metadata "dataset"."""
    rows = []
    for path in paths:
        name = Path(path).resolve().parent.name
        for row in sample_rows(load_qa(path), n, seed):
            row["metadata"].setdefault("dataset", name)
            rows.append(row | {"id": f"{name}/{row['id']}"})
    return rows


def main(argv=None):
    """The command line: mix QA files into one."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.data", description="mix FlashRAG QA files into one split")
    parser.add_argument("files", nargs="+", help="QA jsonl files, e.g. flashrag/nq/train.jsonl")
    parser.add_argument("--out", required=True, help="the split to write, e.g. data/c3po/train.jsonl")
    parser.add_argument("--n", type=int, default=None, help="questions sampled from each file (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args(argv)
    rows = mix(args.files, args.n, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} questions from {len(args.files)} files to {args.out}")


if __name__ == "__main__":
    from common.data import main as command_line  # this module's errors as common.data's, which run_main knows
    from common.runs import run_main  # a malformed file: one line naming it, exit 2

    run_main(command_line)
