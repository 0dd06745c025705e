"""What a run leaves on disk, the same for every method file: its folder runs/<run_name>, checkpoints written
atomically (a crash never leaves a half-written one) that --resume continues with their arguments and random states,
metrics.jsonl and results.json with the final `RESULT {...}` line; run_main ends a user's mistake in one line."""
import json
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

STATE = "run_state.json"
# arguments that never change what a run computes (the modes excepted): a resumed run may differ in these only
NOT_COMPARED = ("output_dir", "run_name", "resume", "eval_every", "report_to", "gradient_checkpointing")


def save_checkpoint(folder, model, tokenizer, state, tensors=None):
    """save_pretrained, a json state and torch state dicts (optimizer, value head ...), written into a temporary folder
    that replaces `folder` only once complete; a process killed at any point leaves the last checkpoint put in place
    (the new one once renamed, else the previous one), which load_state returns. Not fsynced (no power cuts)."""
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
    """After a crash between save_checkpoint's renames (`folder` gone, `folder`.old complete): rename it back."""
    # safe when every process of a run calls it at once: one rename wins
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
    """The json state of the complete checkpoint in `folder`, or None; one that a crash set aside is put back first."""
    folder = Path(folder)
    _put_back(folder)
    return json.loads((folder / STATE).read_text()) if (folder / STATE).is_file() else None


def make_accelerator(report_to="none", project_dir=None):
    """The run's Accelerator with the trackers `report_to`: CPU without CUDA; on a GPU, bf16 autocast over fp32 master
    weights unless accelerate's flags or config say otherwise (`accelerate launch --mixed_precision no|fp16|bf16`)."""
    import importlib.util
    import os

    from accelerate import Accelerator

    if report_to != "none" and not importlib.util.find_spec(report_to):  # the choices: Args (argparse)
        raise SystemExit(f"--report_to {report_to} needs the {report_to} package (pip install {report_to})")
    cuda = torch.cuda.is_available()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or ("bf16" if cuda and torch.cuda.is_bf16_supported() else "no")
    return Accelerator(cpu=not cuda, mixed_precision=precision, project_dir=project_dir,
                       log_with=None if report_to == "none" else report_to)


def start_run(args, method, stages=("sft", "ppo")):
    """The folder of a training run, default runs/<run_name>, run_name <method>__<seed>__<main process's time>; a
    checkpoint there is continued only with --resume, and only when saved with the same arguments."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState(cpu=not torch.cuda.is_available())  # the run's processes as make_accelerator's Accelerator sees them
    stamp = f"{method}__{args.seed}__" + broadcast_object_list([time.strftime("%Y%m%d-%H%M%S")])[0]
    args.run_name = args.run_name or (Path(args.output_dir).name if args.output_dir else stamp)
    out = Path(args.output_dir or Path("runs") / args.run_name)
    args.output_dir, saved = str(out), {s: state for s in stages if (state := load_state(out / s)) is not None}
    if bool(saved) != args.resume:
        raise SystemExit(f"{out} holds a checkpoint ({', '.join(saved)}): pass --resume or another --run_name" if saved
                         else f"--resume: no checkpoint in {out} (name the run to continue: --run_name/--output_dir)")
    for stage, before in ((s, state.get("args") or {}) for s, state in saved.items()):
        if changed := [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in asdict(args).items() if k not in NOT_COMPARED
                       and before.get(k) != v]:
            raise SystemExit(f"--resume: {out / stage} was trained with other arguments ({'; '.join(changed)})")
    return out


def rng_states(*own):
    """This process's random states (python, numpy, torch's CPU one, the run's random.Random objects) as json."""
    # not CUDA's: every common.llm.generate call reseeds all devices, and GPU runs promise curves, not bits (README)
    numpy = np.random.get_state()
    return dict(python=random.getstate(), numpy=[numpy[0], numpy[1].tolist(), *numpy[2:]],
                torch=torch.get_rng_state().tolist(), own=[r.getstate() for r in own])


def set_rng_states(state, *own):
    """Restore what rng_states returned, so that a resumed run draws what the uninterrupted one would have."""
    as_tuple = lambda s: (s[0], tuple(s[1]), s[2])  # random.Random's state, once a json round trip made it lists
    random.setstate(as_tuple(state["python"]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    for r, s in zip(own, state["own"]):
        r.setstate(as_tuple(s))


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


USER_ERRORS = {"common.data": "UserError", "common.llm": "ModelLoadError", "common.retrieval": "EncoderLoadError"}


def run_main(main_fn, argv=None):
    """Run a command-line entry point, `main_fn(argv)`: a user error (a malformed data file, a model or an encoder
    that cannot be loaded) ends the run with the one line `error: <message>` on stderr and exit code 2; any other
    exception is a bug and keeps its traceback."""
    try:
        return main_fn(argv)
    except Exception as e:
        # the classes of a user's mistake, from the modules imported so far (one never imported cannot have raised
        # its error), so that catching them imports nothing
        errors = tuple(c for m, name in USER_ERRORS.items() if (c := getattr(sys.modules.get(m), name, None)))
        if not isinstance(e, errors):
            raise
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message or type(e).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
