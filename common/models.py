"""Spec strings to models and frozen LLMs: the one place that knows every backend. Hub ids, local folders and
OpenAI-compatible endpoints come from common.llm; the toy world's tiny `toy-lm[:options]` models (common.toy.lm) and
its `toy[:<world dir>]` reader (common.toy) are added here, so common.llm never imports the toy world and a method
file meets the toy world only as a value (a model name, an LLM spec).

    model, tokenizer = load_model_and_tokenizer("Qwen/Qwen2-0.5B")           # hub id or folder (common.llm)
    model, tokenizer = load_model_and_tokenizer("toy-lm", world="data/toy")   # vocabulary of that world
    llm = make_llm("toy:data/toy")                                            # or hf:<name>, http(s)://<host>/v1
"""

from functools import partial
from pathlib import Path

from common import llm

DEFAULT_WORLD = Path(__file__).resolve().parent.parent / "data" / "toy"
LLM_SPECS = llm.LLM_SPECS + ', "toy" (the toy reader of data/toy), "toy:<world dir>"'


def is_toy_lm(name):
    """True for the toy model sentinel "toy-lm" and "toy-lm:<options>" (not for names that only start like it)."""
    return str(name) == "toy-lm" or str(name).startswith("toy-lm:")


def load_model_and_tokenizer(name_or_path, dtype=None, device=None, lora=None, trust_remote_code=False, world=None):
    """(model, tokenizer) of a hub id, a local folder (a LoRA folder over either) or "toy-lm[:options]", a tiny model
    whose vocabulary is the toy world in folder `world` (required there: the --data_dir trained on; other names ignore
    it). A folder saved from a toy-lm loads its own saved tokenizer; `lora` wraps the model with peft."""
    name = str(name_or_path)
    if not is_toy_lm(name):
        base = partial(load_model_and_tokenizer, world=world)  # a LoRA folder's base may be a toy-lm
        return llm.load_model_and_tokenizer(name, dtype, device, lora, trust_remote_code, load_base=base)
    if world is None:
        raise llm.ModelLoadError(
            f"{name!r} takes its vocabulary from a toy world: pass --world DIR (a folder with world.json; "
            "python -m common.toy --out DIR writes one)"
        )
    from common.toy.lm import load_toy_lm  # imported when asked for: real runs never load the toy world

    try:
        model, tokenizer = load_toy_lm(name, dtype=dtype, device=device, world=world)
    except (FileNotFoundError, ValueError) as e:  # no world there (common.data.DataError is a ValueError)
        raise llm.ModelLoadError(f"cannot build {name!r}: {e}") from None
    model.name_or_path = name  # what a LoRA checkpoint records as its base
    return (model if lora is None else llm.add_lora(model, lora)), tokenizer


def make_llm(spec, world=None, **kw):
    """A frozen LLM with .chat(messages_lists, **sampling) -> list[str]: "toy" the toy reader of `world` (--world;
    data/toy when None), "toy:<world dir>" that of the folder named, anything else common.llm.make_llm
    (hf:<name or folder>, http(s)://<host>/v1)."""
    spec = str(spec)
    if spec == "toy" or spec.startswith("toy:"):
        from common.toy import ToyReader

        return ToyReader(spec[len("toy:") :] or world or DEFAULT_WORLD, **kw)
    try:
        return llm.make_llm(spec, **kw)
    except ValueError as e:
        if "accepted forms" not in str(e):
            raise
        raise ValueError(f"unknown LLM spec {spec!r}; accepted forms: {LLM_SPECS}") from None
