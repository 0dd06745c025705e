"""What a run leaves on disk, the same for every method file: checkpoints written atomically (a crash never leaves a
half-written one), metrics.jsonl (one line per update) and results.json with the final `RESULT {...}` line."""
import json
import shutil
from pathlib import Path

import torch

STATE = "run_state.json"


def save_checkpoint(folder, model, tokenizer, state, tensors=None):
    """save_pretrained, a json state and torch state dicts (optimizer, value head ...), written into a temporary
    folder that replaces `folder` only once complete; the previous checkpoint survives a crash at any point."""
    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, value in (tensors or {}).items():
        torch.save(value, tmp / name)
    (tmp / STATE).write_text(json.dumps(state))  # written last: its presence marks a complete checkpoint
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load_state(folder):
    """The json state of the complete checkpoint in `folder` (None when there is none); a checkpoint left aside by a
    crash between the two renames of save_checkpoint is put back first."""
    folder = Path(folder)
    old = folder.with_name(folder.name + ".old")
    if not (folder / STATE).is_file() and (old / STATE).is_file():
        shutil.rmtree(folder, ignore_errors=True)
        old.rename(folder)
    return json.loads((folder / STATE).read_text()) if (folder / STATE).is_file() else None


def append_metrics(path, record, main_process=True):
    """One json line per update in metrics.jsonl (written by the main process only)."""
    if main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def write_results(out, results, main_process=True):
    """results.json, written atomically, then the final `RESULT <json>` line on stdout (main process only)."""
    if main_process:
        tmp = Path(out) / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(Path(out) / "results.json")
        print("RESULT " + json.dumps(results), flush=True)
