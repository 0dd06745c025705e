"""What a run leaves on disk, the same for every method file: its folder runs/<run_name>, checkpoints written
atomically (a crash never leaves a half-written one) that --resume continues with their arguments and random states,
metrics.jsonl and results.json with the final `RESULT {...}` line; run_main ends a user's mistake in one line."""

import copy
import functools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

STATE = "run_state.json"
# arguments that never change what a run computes (the modes excepted): a resumed run may differ in these only
NOT_COMPARED = ("output_dir", "run_name", "resume", "dry_run", "eval_every", "report_to", "gradient_checkpointing")


def arg(default, help, low=None, high=None, group=None, flag=True, **metadata):
    """A dataclass field with its --help text (the method files' Args); `low`/`high`: the range a number must lie in
    (checked by parse_flags; None, a preset's placeholder, is left to the preset); `group`: the --help group this
    field and the ones after it belong to; `flag=False`: no flag, the presets alone set it (toy-world tuning, a
    constant of the authors' code), listed at the end of --help with its toy and paper values."""
    extras = {k: v for k, v in dict(low=low, high=high, group=group).items() if v is not None}
    extras |= {} if flag else {"flag": False}
    return field(default=default, metadata={"help": help, **extras, **metadata})


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
    state = {"spent": spent()} | state  # the budget so far (this process's; save_training's: the main process's)
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

    from accelerate import Accelerator

    if report_to != "none" and not importlib.util.find_spec(report_to):  # the choices: Args (argparse)
        raise SystemExit(f"--report_to {report_to} needs the {report_to} package (pip install {report_to})")
    cuda = torch.cuda.is_available()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION") or (
        "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    )
    return Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        project_dir=project_dir,
        log_with=None if report_to == "none" else report_to,
    )


def start_run(args, method, stages=("sft", "ppo")):
    """The folder of a training run, default runs/<run_name>, run_name <method>__<seed>__<main process's time>; a
    checkpoint there is continued only with --resume, and only when saved with the same arguments (an argument added
    since, at its default, is the same)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState(cpu=not torch.cuda.is_available())  # the run's processes as make_accelerator's Accelerator sees them
    stamp = f"{method}__{args.seed}__" + broadcast_object_list([time.strftime("%Y%m%d-%H%M%S")])[0]
    args.run_name = args.run_name or (Path(args.output_dir).name if args.output_dir else stamp)
    out = Path(args.output_dir or Path("runs") / args.run_name)
    args.output_dir, saved = str(out), {s: state for s in stages if (state := load_state(out / s)) is not None}
    if bool(saved) != args.resume:
        raise SystemExit(
            f"{out} holds a checkpoint ({', '.join(saved)}): pass --resume or another --run_name"
            if saved
            else f"--resume: no checkpoint in {out} (name the run to continue: --run_name/--output_dir)"
        )
    defaults = {f.name: f.default for f in fields(args)}  # dataclasses.MISSING where a field has none
    for stage, before in ((s, state.get("args") or {}) for s, state in saved.items()):
        if changed := [
            f"{k}: {before.get(k)!r} -> {v!r}"
            for k, v in asdict(args).items()
            if k not in NOT_COMPARED and before.get(k, defaults[k] if before else None) != v
        ]:
            raise SystemExit(f"--resume: {out / stage} was trained with other arguments ({'; '.join(changed)})")
    if budgets := [state["spent"] for state in saved.values() if "spent" in state]:  # the last stage's goes on
        TrainingTokens.total, TrainingTokens.cpu_before = budgets[-1]["generated_tokens"], budgets[-1]["cpu_s"]
    return out


def flag_parser(args_classes, presets=None):
    """An HfArgumentParser of `args_classes` that reads arg()'s extras: --help lists the flags under the groups their
    fields open (arg's `group`, kept by the fields that follow), a preset's field (`presets`: name -> (toy, paper))
    with its toy and paper values; a field of arg(flag=False) is no flag: --help lists it after the flags with its
    preset values; an argparse mistake (wrong type, not a choice) is one line, exit 2."""
    import argparse

    from transformers import HfArgumentParser

    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        def _get_help_string(self, action):  # a preset's field (default None) shows its two values instead
            return action.help if action.default is None else super()._get_help_string(action)

    class Parser(HfArgumentParser):
        group, groups = None, {}

        def error(self, message):
            self.exit(2, f"error: {message} (see --help)\n")

        def _parse_dataclass_field(self, parser, f):  # group and range are ours, not argparse's
            if f.metadata.get("flag") is False:  # set by the presets only: in the namespace, not on the command line
                self.set_defaults(**{f.name: f.default})
                values = " (toy: {!r}, paper: {!r})".format(*presets[f.name]) if f.name in (presets or {}) else ""
                values = values or f" (value: {f.default!r})"
                self.epilog = (self.epilog or "set by --preset only (PRESETS in the file), not flags:") + (
                    f"\n  {f.name}: {f.metadata['help']}{values}"
                )
                return
            metadata = {k: v for k, v in f.metadata.items() if k not in ("low", "high", "group")}
            self.group = f.metadata.get("group") or self.group
            if f.name in (presets or {}):
                metadata["help"] += " (toy: {!r}, paper: {!r})".format(*presets[f.name])
            if self.group and self.group not in self.groups:
                self.groups[self.group] = self.add_argument_group(self.group)
            f = copy.copy(f)
            f.metadata = metadata
            HfArgumentParser._parse_dataclass_field(self.groups.get(self.group, parser), f)

    return Parser(args_classes, formatter_class=Formatter)


def parse_flags(args_class, argv=None, presets=None):
    """The command line as an `args_class` dataclass (flag_parser). A mistake ends in one line naming the flag and what
    it accepts, exit 2 (never the whole usage): an unknown flag, a value of the wrong type or outside its choices, a
    number outside the range its field declares (arg's `low`/`high`)."""
    try:
        args = flag_parser(args_class, presets).parse_args_into_dataclasses(args=argv)[0]
    except ValueError as e:  # "Some specified arguments are not used by the HfArgumentParser: [...]"
        print(f"error: unknown flags {str(e).rpartition(': ')[2]} (see --help)", file=sys.stderr)
        raise SystemExit(2) from None
    for f in fields(args):
        value, low, high = getattr(args, f.name), f.metadata.get("low"), f.metadata.get("high")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f"in [{low}, {high}]" if low is not None and high is not None else f">= {low}"
                bounds = bounds if low is not None else f"<= {high}"
                print(f"error: --{f.name} {value}: must be {bounds}", file=sys.stderr)
                raise SystemExit(2)
    return args


def parse_args(args_class, argv=None, untrained="the untrained start answers at random", method=None, presets=None):
    """The command line as an `args_class` dataclass (parse_flags): one mode of --train, --eval, --ask; --ask
    needs --model; a checkpoint given as --model without --data_dir brings its world (the data_dir it trained on);
    a checkpoint of another method than `method` is refused, naming both; `presets`: parse_flags's."""
    args = parse_flags(args_class, argv, presets)
    if not (args.train or args.eval or args.ask or getattr(args, "dry_run", False)):
        raise SystemExit('choose a mode: --train, --eval or --ask "question" (see --help)')
    if sum(map(bool, (args.train, args.eval, args.ask))) > 1:  # never one of them silently ignored
        raise SystemExit('choose one mode: --train, --eval or --ask "question", not several (see --help)')
    if args.ask and args.model is None:
        raise SystemExit(f"--ask needs --model: a trained checkpoint (e.g. runs/<run_name>/ppo); {untrained}")
    state = load_state(args.model) if args.model else None
    if method and state and (other := checkpoint_method(state, args_class)) not in (None, f"a {method}"):
        raise SystemExit(f"--model {args.model} is {other} checkpoint, not a {method} one")
    if args.data_dir is None and state:
        args.data_dir = state.get("data_dir")  # a checkpoint remembers its data (corpus, splits)
    if hasattr(args, "world"):
        args.world = toy_world(args.world, args.data_dir, state)
    return args


WORLD_HELP = (
    "the toy world folder (world.json) that the toy models (toy-lm), the toy reader (--llm toy) and the toy teacher "
    "read; default: --data_dir when it holds world.json, else the world the --model checkpoint recorded"
)


def toy_world(world, data_dir, state=None):
    """The toy world folder (--world): `world` when given (it must hold world.json), else `data_dir` when it holds
    world.json, else the world a checkpoint's `state` recorded, else None (real models and readers need none)."""
    if world:
        if not (Path(world) / "world.json").is_file():
            raise SystemExit(
                f"--world {world}: no world.json there (write a toy world: python -m common.toy --out DIR)"
            )
        return str(world)
    if data_dir and (Path(data_dir) / "world.json").is_file():
        return str(data_dir)
    return (state or {}).get("world")


def checkpoint_method(state, args_class):
    """Whose checkpoint a state is: "a <its method>", else, for one saved without it, "another method's" where its
    arguments do not fit `args_class` (None: it fits)."""
    if state.get("method") or not state.get("args"):
        return state.get("method") and f"a {state['method']}"
    return None if set(state["args"]) <= {f.name for f in fields(args_class)} else "another method's"


def eval_dir(args, method):
    """--eval's own folder, never an earlier evaluation's: <model>/eval/<data>-<time> (for a hub id or a toy spec:
    runs/<method>-eval/<data>-<time>), the time the main process's."""
    from accelerate.utils import broadcast_object_list

    base = Path(args.model) / "eval" if args.model and Path(args.model).is_dir() else Path("runs") / f"{method}-eval"
    stamp = broadcast_object_list([time.strftime("%Y%m%d-%H%M%S")])[0]
    out, n = base / f"{Path(args.data_dir or 'data').name}-{stamp}", 1
    while out.exists():  # two evaluations within a second
        out, n = base / f"{Path(args.data_dir or 'data').name}-{stamp}-{n}", n + 1
    return str(out)


def per_round(value, rounds, flag):
    """A per-round list flag ("1,2,3") as `rounds` numbers: the first `rounds` of a longer list (a shorter run of the
    same schedule); a shorter list is one line naming the flag."""
    values = [float(v) for v in str(value).split(",") if v.strip()]
    if len(values) < rounds:
        raise SystemExit(f"{flag} needs {rounds} comma-separated numbers (one per round), got {value!r}")
    return values[:rounds]


def nothing_to_train(accelerator, warnings, stage, what):
    """A stage that trains on nothing (0 pairs, 0 samples, no warm-up path): one warning line, kept in `warnings`
    (results.json's "warnings")."""
    warnings.append(f"{stage}: {what}")
    accelerator.print(f"warning: {stage} trained on nothing ({what})")


BUILT_IN = ("policy", "oracle", "llm", "tfidf", "bm25", "lexical")  # specs naming a method role or a built-in scorer


def where_is(spec):
    """Where a model or LLM spec would load from, found without loading or contacting anything (--dry_run): a
    description, or None for a local path that does not exist (toy specs and BUILT_IN need nothing)."""
    import re

    from huggingface_hub import try_to_load_from_cache

    if not spec:
        return None
    spec = str(spec)
    name = spec.removeprefix("hf:")
    if spec.startswith(("toy", "http://", "https://")) or spec in BUILT_IN:
        return "an endpoint (not contacted)" if spec.startswith("http") else "built in (toy world or method role)"
    if Path(name).exists():
        return f"local folder {Path(name).resolve()}"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):  # owner/name: a hub id
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
        return "hub id, in the local cache" if cached else "hub id, not in the local cache (downloaded on first use)"
    return None


class DryRunMissing(SystemExit):
    """--dry_run found something missing: its one line, exit 1 (a configuration the run could not start with)."""


def dry_run(args):
    """--dry_run: the configuration as resolved (preset filled in) as json, then every data file and model it names
    found without loading anything; a missing one ends the run (exit 1) naming its flag and path."""
    config, lines, missing = asdict(args), [], []
    print(json.dumps(config, indent=1))
    splits = ["test"] * (args.train or args.eval) + ["train"] * args.train
    splits += [v for k, v in config.items() if args.train and k.endswith("_split") and v]
    paths = {f"data_dir ({s} split)": Path(args.data_dir or ".") / f"{s}.jsonl" for s in dict.fromkeys(splits)}
    saved = [config[k] for k in ("index", "bm25_index", "dense_index") if k in config]
    corpus_read = not (saved and all(saved))  # no corpus is read when every retriever is a saved folder
    files = ("triples", "index", "entity_index", "bm25_index", "dense_index") + (("corpus",) if corpus_read else ())
    paths |= {k: Path(config[k]) for k in files if config.get(k)}
    roles = ("model", "llm", "encoder", "reranker", "rewriter", "base_llm", "teacher_model")  # the specs to find
    where = {k: where_is(config.get(k)) for k in roles}
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    for flag, place in [(k, p.exists() and str(p)) for k, p in paths.items()] + [(k, w) for k, w in where.items()]:
        if place and not (offline and place.startswith("hub id, not in")):
            lines.append(f"  {flag}: {place}")
        elif place:  # HF_HUB_OFFLINE: the run could not download it
            missing.append(f"--{flag} {config[flag]} (a hub id not in the local cache, and HF_HUB_OFFLINE is set)")
        elif flag in paths or config.get(flag):
            missing.append(f"--{flag.split()[0]} {paths.get(flag) or config[flag]}")
    print("\n".join(lines))
    if missing:
        raise DryRunMissing(f"dry run: not found: {'; '.join(missing)}")
    print("dry run: configuration resolved, every path found, nothing loaded")


def start(args, method, stages=("sft", "ppo")):
    """A training run's accelerator and folder: start_run (`stages`: its checkpoint folders), make_accelerator, the
    trackers, the global seed."""
    from transformers import set_seed

    out = start_run(args, method, stages)
    accelerator = make_accelerator(args.report_to, out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: "None" if v is None else v for k, v in asdict(args).items()}
    # tensorboard's events in <run folder>/tensorboard; a wandb run named after the run, in the method's project
    name = "tensorboard" if args.report_to == "tensorboard" else method
    accelerator.init_trackers(name, config, init_kwargs={"wandb": {"name": args.run_name}})
    set_seed(args.seed)
    return accelerator, out


def start_eval(args):
    """An evaluation's accelerator and folder (never a training run's: refuse_training_results), seeded."""
    from transformers import set_seed

    out = Path(args.output_dir)
    refuse_training_results(out)
    accelerator = make_accelerator()
    out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)
    return accelerator, out


def progress(iterable, desc, disable=False, **kw):
    """A tqdm bar on stderr; where stderr is not a terminal (a log file, a pipe) it writes at most a line every 30 s
    instead of one per step."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        kw = {"mininterval": 30.0, "maxinterval": 60.0} | kw
    return tqdm(iterable, desc=desc, disable=disable, **kw)


def log_update(accelerator, out, stats, step):
    """One training update: a metrics.jsonl line, the trackers, and a ` | `-separated console line."""
    append_metrics(Path(out) / "metrics.jsonl", stats, accelerator.is_main_process)
    accelerator.log(stats, step=step)
    accelerator.print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))


def log_eval(accelerator, out, stage, result, step):
    """An evaluation: a metrics.jsonl line {"stage", "eval"} and its float scalars to the trackers."""
    append_metrics(Path(out) / "metrics.jsonl", {"stage": stage, "eval": result}, accelerator.is_main_process)
    accelerator.log({f"eval/{k}": v for k, v in result.items() if isinstance(v, float)}, step=step)


class TrainingTokens:
    """Tokens common.llm.generate wrote in this process outside the functions marked @evaluation (evaluations, a
    frozen local LLM's replies): the trained model's generation in training; with cpu_before (the CPU seconds a
    resumed checkpoint had spent), a run's budget (spent)."""

    total, paused, cpu_before = 0, False, 0.0


def evaluation(fn):
    """Mark a function whose generations are not the trained model's training: they are not counted."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        paused, TrainingTokens.paused = TrainingTokens.paused, True
        try:
            return fn(*args, **kwargs)
        finally:
            TrainingTokens.paused = paused

    return wrapper


def spent():
    """What the run has spent so far in this process: the tokens generated in training (TrainingTokens) and the CPU
    seconds, loading and evaluations included. Summed over processes only through a checkpoint's record (no
    collective here: a run with several processes reports its main process's share)."""
    return {
        "generated_tokens": TrainingTokens.total,
        "cpu_s": round(TrainingTokens.cpu_before + time.process_time(), 1),
    }


N_VAL = 100  # the learning curve's validation questions: the first N_VAL of the data's dev split


def curve_point(accelerator, out, args, update, evaluate):
    """A learning-curve point after `update` updates of the RL or preference stage (0: its start, the SFT model):
    evaluate(rows) greedily on the fixed validation subset, the first N_VAL rows of dev.jsonl (at most --n_eval; no
    point without a dev split), logged to metrics.jsonl as {"stage": "val", "update", "val": its numbers, "budget":
    spent so far} and the trackers. The random states are restored after it: training draws what it would without."""
    from common.data import load_split  # noqa: PLC0415

    if not (Path(args.data_dir) / "dev.jsonl").is_file():
        return
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with accelerator.autocast():
        result = evaluate(load_split(args.data_dir, "dev")[: min(N_VAL, getattr(args, "n_eval", None) or N_VAL)])
    random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])  # training draws on
    val = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    record = {"stage": "val", "update": update, "val": val, "budget": spent()}
    append_metrics(Path(out) / "metrics.jsonl", record, accelerator.is_main_process)
    accelerator.log({f"val/{k}": v for k, v in val.items()}, step=update)


def save_training(accelerator, folder, model, tokenizer, state, objects, *rngs):
    """A resumable checkpoint (call it on every process): the model (save_pretrained), `state` plus every process's
    random states (python, numpy, torch and `rngs`), and in training.pt the state dicts of `objects` (name -> an object
    with state_dict(), a list of them, or a state dict itself: value model, optimizers, schedulers, weights)."""
    from accelerate.utils import gather_object

    accelerator.wait_for_everyone()
    states, budget = gather_object([rng_states(*rngs)]), spent()
    if accelerator.is_main_process:
        as_dict = lambda o: o if isinstance(o, dict) else o.state_dict()
        tensors = {k: [as_dict(x) for x in o] if isinstance(o, list) else as_dict(o) for k, o in objects.items()}
        save_checkpoint(folder, model, tokenizer, state | {"rng": states, "spent": budget}, {"training.pt": tensors})


def load_training(accelerator, folder, objects, *rngs):
    """The state of the checkpoint save_training wrote in `folder` (None if there is none), with the state dicts of
    `objects` loaded (a module may hold more weights than were saved: its frozen ones) and this process's random states
    restored (when the process count is the same)."""
    state = load_state(folder)
    if state is None:
        return None
    saved = torch.load(Path(folder) / "training.pt", map_location="cpu", weights_only=True)
    for name, obj in objects.items():
        for o, s in zip(obj, saved[name]) if isinstance(obj, list) else [(obj, saved[name])]:
            if not isinstance(o, torch.nn.Module):
                o.load_state_dict(s)
            elif unexpected := o.load_state_dict(s, strict=False).unexpected_keys:
                raise SystemExit(f"{folder}: training.pt does not fit this model ({unexpected[:3]} ...)")
    if len(state["rng"]) == accelerator.num_processes:  # draw on as the uninterrupted run would
        set_rng_states(state["rng"][accelerator.process_index], *rngs)
    if accelerator.is_main_process and "spent" in state:  # the budget goes on (the main process's, as recorded)
        TrainingTokens.total, TrainingTokens.cpu_before = state["spent"]["generated_tokens"], state["spent"]["cpu_s"]
    return state


def cosine(step, total, warmup):
    """Learning-rate factor: linear warm-up over `warmup` steps, then cosine decay to 0.1 of the peak at `total`
    (OpenRLHF's cosine_with_min_lr, min_lr = 0.1 of the peak)."""
    decay = 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))
    return (step + 1) / warmup if step < warmup else decay


def own_share(batch, accelerator):
    """This process's items of a batch that every process holds in the same order (item i goes to process i mod N),
    and their weight: a process that a short last batch leaves without an item takes the batch's first with weight 0,
    so that it still runs the forward and backward that DDP's gradient all-reduce waits for."""
    mine = batch[accelerator.process_index :: accelerator.num_processes]
    return (mine, 1.0) if mine or not batch else (batch[:1], 0.0)


def global_sum(accelerator, value):
    """`value` (a number or a tensor) summed over the run's processes: a float tensor on the device."""
    value = torch.as_tensor(value, dtype=torch.float32, device=accelerator.device)
    return accelerator.reduce(value.clone(), "sum") if accelerator.num_processes > 1 else value


def micro_backward(accelerator, model, n, size, loss_of):
    """Gradient accumulation over this process's rows 0..n-1 in micro-batches of `size`: accelerator.backward of
    `loss_of(rows)` (rows a slice) for each, all but the last under no_sync, so that DDP all-reduces the gradients once
    per step however many micro-batches each process holds. Returns the sum of the losses (a float)."""
    import contextlib

    total = 0.0
    for m in range(0, n, size):
        with contextlib.nullcontext() if m + size >= n else accelerator.no_sync(model):
            loss = loss_of(slice(m, m + size))
            accelerator.backward(loss)
        total += float(loss.detach())
    return total


def sft_step(
    accelerator, model, optimizer, scheduler, ids, labels, attention, micro_batch_size, max_grad_norm=1.0, weight=1.0
):
    """One optimizer step of next-token cross-entropy on the labelled tokens (labels != -100: the targets; prompts and
    padding are -100), summed over the batch of every process and divided by their count, in micro-batches of
    `micro_batch_size` rows cut to their longest row: the same gradient for any micro-batch size and process count
    (DDP averages over processes, hence the factor N). `weight` 0: own_share's stand-in row. Returns the batch's
    loss."""
    ids, labels, attention = (t.to(accelerator.device) for t in (ids, labels, attention))  # (B, T) each
    n_tokens = global_sum(accelerator, (labels[:, 1:] != -100).sum() * weight).clamp(min=1)
    scale = accelerator.num_processes * weight / n_tokens

    def loss_of(rows):
        width = int(attention[rows].sum(1).max())
        logits = model(input_ids=ids[rows, :width], attention_mask=attention[rows, :width]).logits  # (b, t, V)
        targets = labels[rows, 1:width].flatten()  # token t + 1 is predicted at position t
        return (
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=-100, reduction="sum") * scale
        )

    optimizer.zero_grad()
    total = micro_backward(accelerator, model, len(ids), micro_batch_size, loss_of)
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    return float(global_sum(accelerator, total)) / accelerator.num_processes


def map_shared(fn, items):
    """fn over `items`, the work split over the run's processes (process i maps items[i::N]) and gathered back in the
    order of `items` on every process: work every process needs (a warm-up set) done once in all, not once per
    process. fn maps a list to a list as long; its results must not depend on the process that computes them (seed
    by item, never by rank), so that any process count gives the same list."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState()
    n, mine = state.num_processes, fn(items[state.process_index :: state.num_processes])
    if n == 1:
        return mine
    out = [None] * len(items)
    for rank, part in enumerate(gather_object([mine])):
        out[rank::n] = part
    return out


def rng_states(*own):
    """This process's random states (python, numpy, torch's CPU one, the run's random.Random objects) as json."""
    # not CUDA's: every common.llm.generate call reseeds all devices, and GPU runs promise curves, not bits (README)
    numpy = np.random.get_state()
    return dict(
        python=random.getstate(),
        numpy=[numpy[0], numpy[1].tolist(), *numpy[2:]],
        torch=torch.get_rng_state().tolist(),
        own=[r.getstate() for r in own],
    )


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
            raise SystemExit(
                f"{path} holds the results of a training run: --eval writes next to the model "
                f"(<model>/eval) or to its own --output_dir, never over them"
            )


def append_metrics(path, record, main_process=True):
    """One json line per update in metrics.jsonl (written by the main process only)."""
    if main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def result_record(method, args, before_sft, before, after, steps, wall, llm_calls="llm_calls"):
    """The project's result contract (results.json): the evaluations before and after the RL or preference stage
    (`before_sft`: the raw start), the final one's per-question costs, wall time, steps and the arguments."""
    final = after or before
    return {"method": method, "mode": "train" if args.train else "eval", "preset": args.preset, "seed": args.seed,
            "model": args.model, "dataset": args.data_dir, "n_eval": final["n"], "before_sft": before_sft,
            "before": before, "after": final, "retrievals_per_question": final["retrievals"],
            "llm_calls_per_question": final[llm_calls], "generated_tokens_per_question": final["generated_tokens"],
            "wall_s": round(wall, 1), "train_steps": steps, "budget": budget(steps), "args": asdict(args)}  # fmt: skip


def budget(steps):
    """A run's training budget: its stages' updates as each counts them (SFT steps, PPO iterations, DPO optimizer
    steps) and what it spent (spent: tokens generated in training, CPU seconds; the main process's)."""
    return {"updates": sum(v for v in (steps or {}).values() if isinstance(v, int))} | spent()


TABLE = ("em", "f1", "acc", "reward", "retrievals", "llm_calls", "generated_tokens")  # the end-of-run table's rows
# RESULT's metrics, where an evaluation has them (the rest: results.json); accuracy: a judge's verdict (c3po)
HEADLINE = ("accuracy", "em", "f1", "acc", "reward")


def end_table(results, rows=TABLE):
    """The table that ends a run: a row per metric, a column per evaluation (the raw start, before and after the RL or
    preference stage; an --eval's one evaluation)."""
    named = [("start", "before_sft"), ("before", "before"), ("after", "after")]
    if results.get("mode") == "eval":
        named = [("eval", "after")]
    columns = [(name, results[key]) for name, key in named if isinstance(results.get(key), dict)]
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    rows = [k for k in rows if any(number(c.get(k)) for _, c in columns)]
    lines = [f"{'':<18}" + "".join(f"{name:>10}" for name, _ in columns)]
    for k in rows:
        cells = "".join(f"{c[k]:>10.4g}" if number(c.get(k)) else f"{'-':>10}" for _, c in columns)
        lines.append(f"{k:<18}{cells}")
    return "\n".join(lines)


def run_paths(out, results):
    """What a run leaves a user to open: results.json, the final checkpoint (an --eval's: the model it read) and the
    newest predictions file."""
    out, stages = Path(out), list(results.get("train_steps") or {})
    checkpoint = next((out / s for s in reversed(stages) if (out / s / STATE).is_file()), None)
    predictions = sorted(out.glob("predictions*.jsonl"), key=lambda f: f.stat().st_mtime)
    paths = {"results": out / "results.json", "checkpoint": checkpoint or results.get("model")}
    return paths | ({"predictions": predictions[-1]} if predictions else {})


def result_line(results, path, limit=400):
    """`RESULT {...}` of at most `limit` characters: method, preset, seed, n_eval, the headline metrics before and
    after, and the path of results.json (the full record)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    head = {k: results.get(k) for k in ("method", "preset", "seed", "n_eval")}
    sides = ("before", "after") if results.get("mode") != "eval" else ("after",)
    for keep in range(len(HEADLINE), -1, -1):  # fewer metrics while the line is too long
        for side in sides:
            metrics = results.get(side) or {}
            head[side] = {k: round(metrics[k], 4) for k in HEADLINE[:keep] if number(metrics.get(k))}
        line = "RESULT " + json.dumps(head | {"results": str(path)})
        if len(line) <= limit:
            return line
    return "RESULT " + json.dumps(head | {"results": str(path)[-(limit // 2) :]})


def write_results(out, results, main_process=True, rows=TABLE):
    """results.json, written atomically, then (main process only) the run's end for the person watching: the table of
    `rows` before and after, the paths, and the last line `RESULT {...}` (result_line)."""
    if main_process:
        tmp = Path(out) / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(Path(out) / "results.json")
        paths = run_paths(out, results)
        print("\n" + end_table(results, rows), flush=True)
        print("\n".join(f"{k}: {v}" for k, v in paths.items() if v), flush=True)
        print(result_line(results, paths["results"]), flush=True)


USER_ERRORS = {"common.data": "UserError", "common.llm": "ModelLoadError", "common.retrieval": "EncoderLoadError"}


def run_main(main_fn, argv=None):
    """Run a command-line entry point, `main_fn(argv)`: a user error (a malformed data file, a model or an encoder
    that cannot be loaded, a SystemExit with a message: a flag or a combination of flags the run refuses) ends the run
    with the one line `error: <message>` on stderr and exit code 2 (--dry_run's missing files: exit 1); any other
    exception is a bug and keeps its traceback. Off a terminal (a log file, a pipe) the libraries' own bars (loading
    and saving weights) stay silent: runs.progress's bars say how far a run is."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return main_fn(argv)
    except SystemExit as e:  # a command-line mistake raised as its message: "error: <message>", exit 2
        if not isinstance(e.code, str) or isinstance(e, DryRunMissing):
            raise
        print(f"error: {e.code}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception as e:
        # the classes of a user's mistake, from the modules imported so far (one never imported cannot have raised
        # its error), so that catching them imports nothing
        errors = tuple(c for m, name in USER_ERRORS.items() if (c := getattr(sys.modules.get(m), name, None)))
        if not isinstance(e, errors):
            raise
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message or type(e).__name__}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
