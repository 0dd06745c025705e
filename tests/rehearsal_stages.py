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

# ------------------------------------------------------------------ sparcrag
SPARCRAG_PAIRS = [  # (prompt, chosen, rejected, weight): the paper's formats, a <think> block, a lambda-weighted pair
    ("write 2 queries . original query : who is the director of zorvak ?",
     "<think> i need to know the director . </think> <queries> <query> zorvak directed </query> </queries> [END]",
     "<think> i need to know", 1.0),
    ("decide . answer : unknown", "the note lacks it . <decision> continue </decision> [END]",
     "<decision> stop </decision> [END]", 2.0),
    ("decide . answer : velbo", "<decision> stop </decision> [END]", "<decision> continue </decision> [END]", 1.0),
    ("write 1 queries . original query : velbo ?", "<queries> <query> velbo born </query> </queries> [END]",
     "<queries> </queries> [END]", 1.0),
]  # fmt: skip


def sparcrag_args(**flags):
    """The paper preset's arguments on the toy world, a tiny model, LoRA dropout 0 (the same forward everywhere)."""
    import sparcrag

    world = str(Path(__file__).resolve().parents[1] / "data" / "toy")
    flags = dict(preset="paper", model=TINY_LM, data_dir=world, encoder="tfidf", llm="toy", lora_dropout=0.0) | flags
    return sparcrag.apply_preset(sparcrag.Args(**flags))


def sparcrag_dpo(accelerator, **flags):
    """sparcrag.dpo_train on SPARCRAG_PAIRS (1 epoch) with SGD at lr 1 for its AdamW: {"loss": each step's logged
    loss, "margin": each step's logged reward margin, "grad": the LoRA weights' change}."""
    import tempfile

    import sparcrag

    model, tokenizer = tiny_lm()
    pairs = [dict(zip(("prompt", "chosen", "rejected", "weight"), p)) for p in SPARCRAG_PAIRS]
    made, logged = [], []  # the LoRA weights as created; the logged steps
    add_lora, adamw, log_update = sparcrag.add_lora, torch.optim.AdamW, sparcrag.runs.log_update
    sparcrag.add_lora = lambda *a: (lora := add_lora(*a), made.append(trained(lora)))[0]
    torch.optim.AdamW = lambda params, **kw: sgd(params)
    sparcrag.runs.log_update = lambda accelerator, out, stats, step: logged.append(stats)
    try:
        args = sparcrag_args(dpo_epochs=1, **flags)
        with tempfile.TemporaryDirectory() as out:
            torch.manual_seed(1)  # the LoRA A matrices
            tuned, _ = sparcrag.dpo_train(accelerator, model, tokenizer, pairs, args, None, Path(out))
    finally:
        sparcrag.add_lora, torch.optim.AdamW, sparcrag.runs.log_update = add_lora, adamw, log_update
    series = lambda key: torch.tensor([r[key] for r in logged], dtype=torch.float64)
    return {"loss": series("losses/dpo"), "margin": series("rewards/margin"), "grad": made[0] - trained(tuned)}


@stage("sparcrag:dpo")
def sparcrag_dpo_stage(accelerator):
    """The paper preset's weighted DPO (micro-batch 1) on 4 pairs in batches of 3: shares of 2 and 1 over two
    processes, then a last batch of 1 (the second process a stand-in at weight 0)."""
    return sparcrag_dpo(accelerator, dpo_batch_size=3)


@stage("sparcrag:sft")
def sparcrag_sft(accelerator):
    """The toy warm-up's SFT (sparcrag.sft) with SGD at lr 1: a batch of 3 examples (shares of 2 and 1), then one of 1
    (the second process a stand-in at weight 0)."""
    from dataclasses import replace

    import sparcrag

    model, tokenizer = tiny_lm()
    role = lambda prompt: "rewrite" if prompt.startswith("write") else "evaluate"
    examples = [{"role": role(p), "prompt": p, "output": y} for p, y, _, _ in SPARCRAG_PAIRS[:2] + SPARCRAG_PAIRS[3:]]
    before, losses = trained(model), []
    adamw, sft_step = torch.optim.AdamW, sparcrag.runs.sft_step
    torch.optim.AdamW = lambda params, **kw: sgd(params)
    sparcrag.runs.sft_step = lambda *a, **kw: losses.append(sft_step(*a, **kw)) or losses[-1]
    try:
        args = sparcrag_args(preset="toy", sft_steps=1, sft_batch_size=4)  # the toy's warm-up, its shares 3 and 1
        model = sparcrag.sft(accelerator, model, tokenizer, examples, args, None)
        model = sparcrag.sft(accelerator, model, tokenizer, examples, replace(args, sft_batch_size=1), None)
    finally:
        torch.optim.AdamW, sparcrag.runs.sft_step = adamw, sft_step
    return {"loss": torch.tensor(losses, dtype=torch.float64), "grad": before - trained(model)}


if __name__ == "__main__":
    from accelerate import Accelerator

    out, names = sys.argv[1], sys.argv[2:] or list(STAGES)
    accelerator, results = Accelerator(cpu=True), {}
    for name in names:
        results[name] = STAGES[name](accelerator)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(results, out)
