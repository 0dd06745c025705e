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

import contextlib
import sys
from dataclasses import replace
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
def smartrag_setting(**kw):
    """smartrag's paper preset on the toy world (tfidf, the oracle rewriter, the toy reader as the base model); kw
    override flags."""
    import smartrag

    world = str(Path(__file__).resolve().parents[1] / "data" / "toy")
    flags = dict(preset="paper", train=True, data_dir=world, encoder="tfidf", rewriter="oracle", base_llm="toy")
    return smartrag, smartrag.apply_preset(smartrag.Args(**flags | kw))


@contextlib.contextmanager
def unclipped(accelerator):
    """The accelerator's gradient clipping switched off for a stage: a clipped gradient would hide a wrong scale."""
    accelerator.clip_grad_norm_ = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del accelerator.clip_grad_norm_  # the class's method again


@stage("smartrag:sft")
def smartrag_sft(accelerator, micro_batch_size=2):
    """smartrag.sft, one step on three warm-up pairs of unequal target lengths (process 0 holds two rows, process 1
    one), then one step on a batch of one (process 1: the stand-in of weight 0). AdamW swapped for plain SGD."""
    import tempfile

    smartrag, args = smartrag_setting(micro_batch_size=micro_batch_size, lora_r=0)
    out = Path(tempfile.mkdtemp())  # the sft/loss lines' metrics.jsonl
    model, tokenizer = tiny_lm()
    tags = smartrag.add_tags(model, tokenizer)
    pair = lambda question, tag, text: dict(question=question, observations=[], tag=tag, text=text, popular=False,
                                            searched=[])  # fmt: skip
    examples = [pair("who is the director of zorvak ?", "answer", "velbo"),
                pair("what is the birthplace of velbo ?", "retrieve", "velbo born in the city of"),
                pair("in what year did zorvak come out ?", "answer", "1931")]  # fmt: skip
    before, losses, adamw, sft_step = trained(model), [], torch.optim.AdamW, smartrag.runs.sft_step
    torch.optim.AdamW = lambda params, **kwargs: sgd(params)
    smartrag.runs.sft_step = lambda *a, **k: losses.append(sft_step(*a, **k)) or losses[-1]
    try:
        for batch_size in (3, 1):
            batch_args = replace(args, sft_batch_size=batch_size)
            with unclipped(accelerator):
                model, _ = smartrag.sft(accelerator, out, model, tokenizer, tags, examples, batch_args, None, steps=1)
    finally:
        torch.optim.AdamW, smartrag.runs.sft_step = adamw, sft_step
    return {"loss": torch.tensor(losses, dtype=torch.float64), "grad": before - trained(model)}


@stage("smartrag:ppo")
def smartrag_ppo(accelerator, micro_batch_size=2):
    """smartrag.ppo_iteration on a LoRA policy with an untied LM head (as Llama-2's): three sequences, a search then a
    forced answer (rolled out by process 0) and a direct answer (process 1), in minibatches of 2: a minibatch of two,
    then one of one (process 1: the stand-in); the reference differs from the policy, so the KL term counts."""
    import copy

    smartrag, args = smartrag_setting(micro_batch_size=micro_batch_size, model=TINY_LM + ",tie=0", lora_r=2,
                                      ppo_batch_size=2)  # fmt: skip
    torch.manual_seed(0)
    policy, tokenizer, tags = smartrag.load_policy(args, accelerator.device)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    model = smartrag.PolicyAndValue(policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # LoRA B and the value head leave zero, so that every weight gets a gradient
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    turn = lambda state, forced, action, reward: dict(prompt_ids=encode(state), forced_ids=forced,
                                                      action_ids=encode(action) + [tokenizer.eos_token_id],
                                                      reward=reward)  # fmt: skip
    search = turn("question : who is the director of zorvak ? output :", [], "[Search] zorvak directed", -0.2)
    state = "question : who is the director of zorvak ? observation : zorvak is a film directed by velbo . output :"
    read = turn(state, [tags["answer"]], "velbo", 2.0)
    direct = turn("question : in what year did zorvak come out ? output :", [], "[Answer] 1931", 0.0)
    episodes = [{"turns": [search, read]}, {"turns": [direct]}]
    if accelerator.num_processes > 1:  # what each process rolled out
        episodes = episodes[:1] if accelerator.process_index == 0 else episodes[1:]
    before = trained(model)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    torch.manual_seed(2)  # the minibatch shuffle (process 0's)
    with unclipped(accelerator):
        stats = smartrag.ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, 0.1, args)
    keys = ("losses/policy", "losses/value", "losses/approx_kl", "rollout/kl", "losses/explained_variance")
    grad = before - trained(accelerator.unwrap_model(model))
    return {"loss": stats["losses/policy"], "grad": grad} | {key: stats[key] for key in keys}


@stage("smartrag:warmup")
def smartrag_warmup(accelerator):
    """smartrag.build_warmup of five training questions, two the base model knows (pi_0*, the toy reader as the base
    model): the rewrites, retrievals and knowledge probes shared out (three and two), each question probed once in
    all, the same pairs."""
    from common import runs
    from common.data import load_split

    smartrag, args = smartrag_setting()
    rows = load_split(args.data_dir, "train", "one_hop")
    rows = [r for r in rows if r["metadata"]["popular"]][:2] + [r for r in rows if not r["metadata"]["popular"]][:3]
    probed, make_llm = [], smartrag.make_llm

    def counted(spec, **kwargs):
        llm = make_llm(spec, **kwargs)
        chat = llm.chat
        llm.chat = lambda messages, **sampling: probed.extend(messages) or chat(messages, **sampling)
        return llm

    smartrag.make_llm = counted
    try:
        examples, known = smartrag.build_warmup(rows, smartrag.environment(args), args)
    finally:
        smartrag.make_llm = make_llm
    pairs = [len(e["observations"]) + len(e["text"]) + 100 * (e["tag"] == "answer") for e in examples]
    return {"loss": float(runs.global_sum(accelerator, len(probed))), "grad": torch.tensor(pairs, dtype=torch.float64),
            "known": known}  # fmt: skip


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
    import tempfile

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
            model, _ = c3po.sft(accelerator, model, tokenizer, examples, args, None, tempfile.mkdtemp())
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
def sparkle_setup(**overrides):
    """The paper preset's arguments on the toy world (its models aside), and three warm-up pairs in the paper's
    formats: a Retrieval Decision, a Query Formulation (Tab. 8) and a Knowledge Integration (one triple)."""
    import sparkle

    world = str(Path(__file__).resolve().parents[1] / "data" / "toy")
    args = sparkle.Args(train=True, preset="paper", data_dir=world, llm="toy", encoder="tfidf", teacher_model="oracle")
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
    import tempfile

    import sparkle
    from common import runs

    model, tokenizer, out = *tiny_lm(), Path(tempfile.mkdtemp())  # out: the SFT loss's metrics.jsonl
    before, losses, step, adam = trained(model), [], runs.sft_step, torch.optim.Adam
    runs.sft_step = lambda *a, **k: losses.append(step(*a, **k)) or losses[-1]
    torch.optim.Adam = lambda params, **_: sgd(params)
    try:
        for size in (3, 1):
            args, examples = sparkle_setup(sft_batch_size=size, sft_steps=1, micro_batch_size=micro, max_grad_norm=1e9)
            model, _ = sparkle.sft(accelerator, model, tokenizer, examples, args, None, out)
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
    import tempfile

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
        model, steps = T.sft(accelerator, model, tokenizer, examples, args, None, tempfile.mkdtemp())  # its log
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
    base = dict(preset="paper", model=TINY_LM, data_dir=world, world=world, encoder="tfidf", llm="toy", lora_dropout=0)
    return sparcrag.apply_preset(sparcrag.Args(**base | flags))


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
    """The toy warm-up's SFT (common.toy.sparcrag.sft) with SGD at lr 1: a batch of 3 examples (shares of 2 and 1),
    then one of 1 (the second process a stand-in at weight 0)."""
    import tempfile
    from dataclasses import replace

    import sparcrag
    from common.toy import sparcrag as toy

    model, tokenizer = tiny_lm()
    role = lambda prompt: "rewrite" if prompt.startswith("write") else "evaluate"
    examples = [{"role": role(p), "prompt": p, "output": y} for p, y, _, _ in SPARCRAG_PAIRS[:2] + SPARCRAG_PAIRS[3:]]
    before, losses = trained(model), []
    adamw, sft_step = torch.optim.AdamW, sparcrag.runs.sft_step
    torch.optim.AdamW = lambda params, **kw: sgd(params)
    sparcrag.runs.sft_step = lambda *a, **kw: losses.append(sft_step(*a, **kw)) or losses[-1]
    try:
        args = sparcrag_args(preset="toy", sft_steps=1, sft_batch_size=4)  # the toy's warm-up, its shares 3 and 1
        with tempfile.TemporaryDirectory() as out:  # its metrics.jsonl (sft/loss)
            model = toy.sft(accelerator, model, tokenizer, examples, args, None, out, sparcrag.batch_tensors)
            small = replace(args, sft_batch_size=1)
            model = toy.sft(accelerator, model, tokenizer, examples, small, None, out, sparcrag.batch_tensors)
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
