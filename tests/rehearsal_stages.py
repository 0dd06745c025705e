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
def sparkle_setup(**overrides):
    """The paper preset's arguments on the toy world (its models aside), and three warm-up pairs in the paper's
    formats: a Retrieval Decision, a Query Formulation (Tab. 8) and a Knowledge Integration (one triple)."""
    import sparkle

    world = str(Path(__file__).resolve().parents[1] / "data" / "toy")
    args = sparkle.Args(train=True, preset="paper", data_dir=world, llm="toy", encoder="tfidf", teacher="oracle")
    args = sparkle.apply_preset(args)
    for key, value in overrides.items():
        setattr(args, key, value)
    tpl, question = sparkle.TEMPLATES["paper"], "what is the birthplace of the director of zorvak ?"
    rd = tpl["rd"].format(context="", question=question, history="", current="i need to know the director of zorvak .")
    qf = tpl["qf"].format(question=question, thoughts="i need to know the director of zorvak .")
    triples = [
        (dict(title="zorvak"), "<zorvak; directed by; velbo>"),
        (dict(title="velbo"), "<velbo; born in; tuvia>"),
    ]
    ki = tpl["ki"].format(candidates=sparkle.format_candidates(tpl, triples), question=question,
                          chain="<zorvak; directed by; [unknown]>", query="zorvak directed")  # fmt: skip
    qf_out = tpl["qf_output"].format(chain="<zorvak; directed by; [unknown]>", gap="the director", query="zorvak")
    return args, [
        dict(prompt=(tpl["rd_system"], rd), output=tpl["rd_yes"], agent="rd"),
        dict(prompt=(tpl["qf_system"], qf), output=qf_out, agent="qf"),
        dict(prompt=(tpl["ki_system"], ki), output=triples[0][1], agent="ki"),
    ]


@stage("sparkle:sft")
def sparkle_sft(accelerator, micro=1):
    """sparkle.sft (its loop over runs.sft_step) on the three pairs: one step of a batch of 3 (2 + 1 over two
    processes), then one of a batch of 1 (process 1: a stand-in of weight 0); plain SGD at lr 1, no clipping."""
    import sparkle
    from common import runs

    model, tokenizer = tiny_lm()
    before, losses, step, adam = trained(model), [], runs.sft_step, torch.optim.Adam
    runs.sft_step = lambda *a, **k: losses.append(step(*a, **k)) or losses[-1]
    torch.optim.Adam = lambda params, **_: sgd(params)
    try:
        for size in (3, 1):
            args, examples = sparkle_setup(sft_batch_size=size, sft_steps=1, micro_batch_size=micro, max_grad_norm=1e9)
            model, _ = sparkle.sft(accelerator, model, tokenizer, examples, args, None)
    finally:
        runs.sft_step, torch.optim.Adam = step, adam
    return {"loss": torch.tensor(losses, dtype=torch.float64), "grad": before - trained(model)}


@stage("sparkle:ppo")
def sparkle_ppo(accelerator, micro=1):
    """sparkle.ppo_update on three operation samples (the pairs, RD's forced) in minibatches of 2 and 1 (the last
    short of the two processes), process 0 holding two samples and process 1 one; the policy and the critic (its own
    backbone) stepped by plain SGD at lr 1, no clipping."""
    import copy

    import sparkle

    args, examples = sparkle_setup(ppo_batch_size=2, micro_batch_size=micro, max_grad_norm=1e9)
    policy, tokenizer = tiny_lm(0)
    value, ref = sparkle.ValueModel(tiny_lm(1)[0]), copy.deepcopy(policy).eval().requires_grad_(False)
    torch.nn.init.normal_(value.head.weight, std=0.1)  # a critic that is not zero
    samples = []
    for ex, credit in zip(examples, (0.9, 0.2, 0.5)):
        prompt = sparkle.encode_prompts(tokenizer, [ex["prompt"]])[0]
        action = tokenizer(ex["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(dict(ids=prompt + action, loss_mask=[0] * len(prompt) + [1] * len(action), credit=credit,
                            agent=ex["agent"], forced=ex["agent"] == "rd"))  # fmt: skip
    before = trained(policy), trained(value)
    optimizers = [sgd(policy.parameters()), sgd(value.parameters())]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in optimizers]
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    # in process order the one process's list: process 0 takes two samples, process 1 one
    mine = [samples[:2], samples[2:]][accelerator.process_index] if accelerator.num_processes == 2 else samples
    out = sparkle.ppo_update(accelerator, policy, value, ref, optimizers, schedulers, copy.deepcopy(mine),
                             tokenizer.pad_token_id, args)  # fmt: skip
    after = trained(accelerator.unwrap_model(policy)), trained(accelerator.unwrap_model(value))
    return {"loss": out["losses/policy"], "value_loss": out["losses/value"], "grad": before[0] - after[0],
            "value_grad": before[1] - after[1], "kl": out["rollout/kl"]}  # fmt: skip


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
