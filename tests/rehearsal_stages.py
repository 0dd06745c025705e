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
C3PO_SFT = [  # (prompt, output) pairs of unequal lengths
    ("decide : no retrieval , retrieval or planning . question : who is the director of zorvak ?", "[Planning]"),
    ("filter documents . question : q ?", "thought : keep 1 . action : [ 1 ]"),
    ("use llm . existing documents : plan : step 1 . question : q ?", "thought : done . action : [ llm ]"),
]


def c3po_args(**kw):
    """The paper preset's values (micro-batch 4, one PPO epoch, 1024 samples a minibatch, forced weight 1, clipping),
    with steps that SGD at learning rate 1 can take: no gradient clipping, no schedule warm-up."""
    import c3po

    return c3po.apply_preset(c3po.Args(preset="paper", train=True, seed=0, max_grad_norm=1e9, system_prompt="", **kw))


@stage("c3po:sft")
def c3po_sft(accelerator):
    """c3po.sft, one step on three pairs (process 0 holds two, process 1 one), then one on a single pair (process 1:
    own_share's stand-in, weight 0); AdamW swapped for SGD at learning rate 1."""
    import c3po
    from common import runs

    model, tokenizer = tiny_lm()
    before, losses, adamw, sft_step = trained(model), [], torch.optim.AdamW, runs.sft_step
    torch.optim.AdamW = lambda params, lr, **_: sgd(params)
    runs.sft_step = lambda *a, **k: losses.append(sft_step(*a, **k)) or losses[-1]
    try:
        for pairs in (C3PO_SFT, C3PO_SFT[:1]):
            examples = [dict(prompt=p, output=o, agent="router", row={}) for p, o in pairs]
            args = c3po_args(sft_steps=1, sft_batch_size=len(pairs), sft_lr=1.0)
            model, _ = c3po.sft(accelerator, model, tokenizer, examples, args, None)
    finally:
        torch.optim.AdamW, runs.sft_step = adamw, sft_step
    return {"loss": sum(losses), "grad": before - trained(model)}


def c3po_samples(n):
    """n agent-node samples as node_samples makes them (prompt, action, credit, forced tokens), unequal lengths."""
    shapes = [(3, 2, 1.0, 2), (5, 3, 0.0, 0), (2, 4, 0.5, 0)]
    return [dict(ids=[10 + i + j for j in range(p + a)], loss_mask=[0] * p + [1] * a, credit=c, agent="dm", forced=f)
            for i, (p, a, c, f) in enumerate(shapes[:n])]  # fmt: skip


@stage("c3po:ppo")
def c3po_ppo(accelerator):
    """c3po.ppo_update on three node samples (process 0 holds two, process 1 one), then on one (process 1: a stand-in
    of weight 0): advantages whitened over both processes, token means over the minibatch, SGD at learning rate 1.
    The reference differs from the policy and the value head is not zero, so that every term moves."""
    import copy

    import c3po
    from common import runs

    policy, tokenizer = tiny_lm()
    ref, value = tiny_lm(seed=1)[0].requires_grad_(False), c3po.ValueModel(policy)
    torch.nn.init.normal_(value.head.weight, std=0.1, generator=torch.Generator().manual_seed(2))
    before = trained(policy), trained(value)
    optimizers = [sgd(policy.parameters()), sgd(value.parameters())]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in optimizers]
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    losses, args = [], c3po_args(kl_coef=0.1, ppo_epochs=1)
    for n in (3, 1):
        samples, weight = runs.own_share(c3po_samples(n), accelerator)
        stats = c3po.ppo_update(accelerator, policy, value, ref, optimizers, schedulers, copy.deepcopy(samples),
                                tokenizer.pad_token_id, args, weight)  # fmt: skip
        losses.append(stats["losses/policy"] + stats["losses/value"])
    after = trained(accelerator.unwrap_model(policy)), trained(accelerator.unwrap_model(value))
    return {"loss": sum(losses), "grad": before[0] - after[0], "value_grad": before[1] - after[1]}


@stage("c3po:warmup")
def c3po_warmup(accelerator):
    """c3po.build_warmup on nine one-hop toy questions, twice: with the oracle teacher (noisy, its draws seeded by
    question, so two processes build the examples of one), and with a teacher whose draws differ per process, as an
    unseeded sampling LLM's do: every process must still hold the same examples (else their SFT step counts differ,
    and a process waits forever for the other's all-reduce)."""
    import random
    import zlib
    from dataclasses import replace

    from accelerate.utils import gather_object

    import c3po
    from common.data import load_split

    world = str(Path(__file__).resolve().parents[1] / "data" / "toy")
    args = c3po.apply_preset(c3po.Args(train=True, data_dir=world, teacher_noise=0.5))
    env = c3po.environment(args)
    rows = [r for r in load_split(world, "train", "one_hop") if not r["metadata"]["popular"]][:9]
    oracle, solved = c3po.build_warmup(rows, env.llm, env, args)
    draw = random.Random(accelerator.process_index)  # a sampling server: each process's draws its own

    def reply(prompt):  # the question as the query, a random selection, a random stop (compact templates)
        question = prompt.rpartition("question : ")[2].partition("\n")[0]
        ids = ", ".join(map(str, sorted(draw.sample(range(1, 4), draw.randint(1, 3)))))
        if prompt.startswith(("decide :", "filter")):
            return question if prompt.startswith("decide :") else f"thought : t . action : [ {ids} ]"
        return draw.choice(["thought : t . action : [ llm ]", f"thought : t . action : [ retrieval ] {question}"])

    class Sampling:  # the frozen LLM in the proxy roles (--teacher llm)
        def chat(self, messages_lists, **_):
            return [reply(messages[-1]["content"]) for messages in messages_lists]

    sampled, _ = c3po.build_warmup(rows, Sampling(), env, replace(args, teacher="llm"))
    agree = len(set(gather_object([repr(sampled)]))) == 1
    fingerprint = sum(zlib.crc32(repr((e["prompt"], e["output"])).encode()) for e in oracle)
    return {"loss": float(agree), "grad": torch.tensor([len(oracle), solved, fingerprint], dtype=torch.float64)}


# ------------------------------------------------------------------ sparkle

# ------------------------------------------------------------------ tearag

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
