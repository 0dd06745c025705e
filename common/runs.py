"""What a run leaves on disk, the same for every method file: checkpoints written atomically (a crash never leaves a
half-written one), metrics.jsonl (one line per update) and results.json with the final `RESULT {...}` line; and
run_main, which ends a command-line run on a user's mistake with one line instead of a traceback."""
import json
import shutil
import sys
from pathlib import Path

import torch

STATE = "run_state.json"


def save_checkpoint(folder, model, tokenizer, state, tensors=None):
    """save_pretrained, a json state and torch state dicts (optimizer, value head ...), written into a temporary
    folder that replaces `folder` only once complete; a process killed at any point leaves the last checkpoint
    put in place (the new one once its rename is done, the previous one before), which load_state then returns.
    Not fsynced: this guards against a crashed or killed run, not against a power cut."""
    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    _put_back(folder)  # a save that crashed between its renames set the last checkpoint aside: never delete it
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


def _put_back(folder):
    """After a crash between the two renames of save_checkpoint, `folder` is missing and `folder`.old holds the last
    checkpoint: rename it back. Safe when every process of a run calls it at once (one rename wins)."""
    old = folder.with_name(folder.name + ".old")
    if (folder / STATE).is_file() or not (old / STATE).is_file():
        return
    if folder.exists():  # an incomplete folder (no state file): not a checkpoint
        shutil.rmtree(folder)
    try:
        old.rename(folder)
    except OSError:
        if not (folder / STATE).is_file():  # not another process that put it back first
            raise


def load_state(folder):
    """The json state of the complete checkpoint in `folder` (None when there is none); a checkpoint left aside by a
    crash between the two renames of save_checkpoint is put back first."""
    folder = Path(folder)
    _put_back(folder)
    return json.loads((folder / STATE).read_text()) if (folder / STATE).is_file() else None


def make_accelerator():
    """The run's Accelerator: CPU without CUDA; on a GPU, bf16 autocast over fp32 master weights unless accelerate's
    own flags or config say otherwise (`accelerate launch --mixed_precision no|fp16|bf16`)."""
    import os

    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or ("bf16" if cuda and torch.cuda.is_bf16_supported() else "no")
    return Accelerator(cpu=not cuda, mixed_precision=precision)


def refuse_training_results(out):
    """Stop an evaluation that would write over a training run's results.json in `out`."""
    path = Path(out) / "results.json"
    if path.is_file():
        try:
            mode = json.loads(path.read_text(encoding="utf-8")).get("mode", "train")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            mode = "unknown"
        if mode != "eval":
            raise SystemExit(f"{path} holds the results of a training run: --eval writes next to the model "
                             f"(<model>/eval) or to its own --output_dir, never over them")


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


USER_ERRORS = (("common.data", "UserError"), ("common.llm", "ModelLoadError"),
               ("common.retrieval", "EncoderLoadError"))


def user_error_classes():
    """The exception classes that mean a user's mistake, from the modules imported so far (a module never imported
    cannot have raised its error), so that catching them imports nothing."""
    return tuple(c for module, name in USER_ERRORS if (c := getattr(sys.modules.get(module), name, None)))


def run_main(main_fn, argv=None):
    """Run a command-line entry point, `main_fn(argv)`: a user error (a malformed data file, a model or an encoder
    that cannot be loaded) ends the run with the one line `error: <message>` on stderr and exit code 2; any other
    exception is a bug and keeps its traceback."""
    try:
        return main_fn(argv)
    except Exception as e:
        if not isinstance(e, user_error_classes()):
            raise
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message or type(e).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
