"""Each method's training stages, one step on fixed tiny data, run once by one process and once by two:

    python tests/rehearsal_stages.py OUT.pt [STAGE ...]
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        tests/rehearsal_stages.py OUT.pt [STAGE ...]

A stage is a function of the Accelerator that builds its model from a seed, runs one optimizer step of the method's own
stage code (its SFT, PPO or DPO update) on data whose counts leave a short last batch (fewer items than processes), and
returns what one and two processes must agree on: the loss the stage reports and the gradient it stepped with (the
change of the trained weights under plain SGD at learning rate 1). The main process writes {stage: result} to OUT.pt;
tests/test_paper_rehearsal.py compares the two files.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = {}  # "method:stage" -> fn(accelerator) -> {"loss": float, "grad": 1-d float64 tensor, ...}
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


def stage(name):
    """Register a stage under `name` ("method:stage")."""

    def register(fn):
        STAGES[name] = fn
        return fn

    return register


def tiny_lm(seed=0, world="data/toy"):
    """A tiny toy-lm (its weights from `seed`) and its tokenizer."""
    from common.models import load_model_and_tokenizer

    torch.manual_seed(seed)
    return load_model_and_tokenizer(TINY_LM, world=str(Path(__file__).resolve().parents[1] / world))


def trained(model):
    """The trainable weights, flattened (float64, on the CPU)."""
    return torch.cat([p.detach().double().flatten().cpu() for p in model.parameters() if p.requires_grad])


def sgd(params):
    """Plain SGD at learning rate 1: a step's weight change is minus its (clipped) gradient."""
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=1.0)


# ------------------------------------------------------------------ common.runs.sft_step (every method's SFT)
@stage("runs:sft_step")
def runs_sft_step(accelerator):
    """Three rows of unequal target lengths at micro-batch 2: process 0 holds rows 0 and 2, process 1 row 1."""
    from common import runs
    from common.llm import right_pad

    model, tokenizer = tiny_lm()
    texts = [("question : who is the director of zorvak ?", "velbo"), ("q ?", "tuvia was born in 1931"),
             ("question : what is the release year of zorvak ?", "1931")]  # fmt: skip
    before = trained(model)
    optimizer = sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in (texts, texts[:1]):  # a full batch, then a short one: process 1 gets no row (weight 0)
        own, weight = runs.own_share(batch, accelerator)
        seqs = [(tokenizer(p)["input_ids"], tokenizer(t)["input_ids"]) for p, t in own]
        ids = right_pad([p + t for p, t in seqs], tokenizer.pad_token_id)
        labels = right_pad([[-100] * len(p) + t for p, t in seqs], -100)
        attention = right_pad([[1] * (len(p) + len(t)) for p, t in seqs], 0)
        loss = runs.sft_step(accelerator, model, optimizer, scheduler, ids, labels, attention, 2, 1e9, weight)
    return {"loss": loss, "grad": before - trained(accelerator.unwrap_model(model))}


@stage("runs:map_shared")
def runs_map_shared(accelerator):
    """Five items over two processes (three and two), gathered back in order, each result seeded by its item."""
    import random

    from common import runs

    items = list(range(5))
    mapped = runs.map_shared(lambda xs: [x + random.Random(x).random() for x in xs], items)
    return {"loss": float(len(mapped)), "grad": torch.tensor(mapped, dtype=torch.float64)}


# ------------------------------------------------------------------ smartrag

# ------------------------------------------------------------------ c3po

# ------------------------------------------------------------------ sparkle


# ------------------------------------------------------------------ tearag
def tearag_model(seed=0):
    """A tiny toy-lm with TeaRAG's format tokens (<Reference>, </Reference> single tokens)."""
    import tearag as T

    model, tokenizer = tiny_lm(seed)
    T.add_format_tokens(model, tokenizer)
    return model, tokenizer


def tearag_sequences(tokenizer):
    """Three SFT paths of unequal lengths in the paper's format (instruction as system turn) as tearag.sft_examples
    writes them, and their (ids, loss_mask) as DPO trains on them."""
    import tearag as T

    block = lambda *facts: T.reference_block([{"kind": "triplet", "head": h, "relation": r, "tail": t}
                                              for h, r, t in facts])  # fmt: skip
    step = lambda i, entity, query, facts, answer: [
        (T.step_header(i, [entity], query), True),
        (block(*facts), False),
        (f"Summary: The fact {' and '.join(map(' '.join, facts))} logically implies the answer: {answer}.\n", True),
    ]
    examples = [
        ("what is the birth year of voben ?", step(1, "voben", "voben born", [("voben", "birth year", "1967")], "1967")
         + [("Final answer: 1967", True)]),
        ("in which country was dites born ?", step(1, "dites", "dites born", [("dites", "born in", "makux")], "makux")
         + step(2, "makux", "makux city", [("makux", "country", "rusu"), ("rusu", "capital", "kovik")], "rusu")
         + [("Final answer: rusu", True)]),
        ("who is the director of sutisek ?", [("Final answer: fukix", True)]),
    ]  # fmt: skip
    args = SimpleNamespace(augment_p=0.0, templates="paper")
    return examples, [T.sft_sequence(e, tokenizer, args, None, None) for e in examples]


@stage("tearag:sft")
def tearag_sft(accelerator, micro_batch_size=2):
    """tearag.sft for one epoch of three paths at batch 2 (the paper's micro-batch 2): a full batch, then a short one
    (process 1 gets no path: weight 0); the loss is what runs.sft_step reports."""
    import tearag as T
    from common import runs

    model, tokenizer = tearag_model()
    examples, _ = tearag_sequences(tokenizer)
    args = SimpleNamespace(seed=0, sft_steps=0, sft_batch_size=2, sft_lr=1.0, weight_decay=0.0, augment_p=0.0,
                           micro_batch_size=micro_batch_size, templates="paper")  # fmt: skip
    before, losses, step = trained(model), [], runs.sft_step
    adamw, torch.optim.AdamW = torch.optim.AdamW, lambda params, **kw: sgd(params)
    runs.sft_step = lambda *a, **kw: losses.append(step(*a, **kw)) or losses[-1]
    try:
        model, steps = T.sft(accelerator, model, tokenizer, examples, args, None)
    finally:
        torch.optim.AdamW, runs.sft_step = adamw, step
    assert steps == 2
    return {"loss": sum(losses), "grad": before - trained(model)}


@stage("tearag:dpo")
def tearag_dpo(accelerator, micro_batch_size=2):
    """tearag.dpo_round (eta 1, one epoch) on three pairs at dpo_batch_size 2: a full batch, then a short one; the
    reference log-probs are the model's at the start, computed over both processes (runs.map_shared)."""
    import random

    import tearag as T

    model, tokenizer = tearag_model(seed=1)
    _, seqs = tearag_sequences(tokenizer)
    pairs = [(seqs[0], seqs[1]), (seqs[1], seqs[2]), (seqs[2], seqs[0])]
    args = SimpleNamespace(micro_batch_size=micro_batch_size, dpo_lr=1.0, weight_decay=0.0, dpo_batch_size=2, beta=0.5)
    before = trained(model)
    adamw, torch.optim.AdamW = torch.optim.AdamW, lambda params, **kw: sgd(params)
    try:
        model, stats, steps = T.dpo_round(accelerator, model, tokenizer, pairs, 1.0, 1, args, random.Random(0))
    finally:
        torch.optim.AdamW = adamw
    assert steps == 2
    return {"loss": stats["losses/all"], "dpo": stats["losses/dpo"], "sft": stats["losses/sft"],
            "grad": before - trained(model)}  # fmt: skip


# ------------------------------------------------------------------ sparcrag


if __name__ == "__main__":
    from accelerate import Accelerator

    out, names = sys.argv[1], sys.argv[2:] or list(STAGES)
    accelerator, results = Accelerator(cpu=True), {}
    for name in names:
        results[name] = STAGES[name](accelerator)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(results, out)
