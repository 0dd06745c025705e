"""The paper path rehearsed on the toy world: what only the paper preset's values, several processes or a real model's
output reach, which no toy-preset run shows.

- Oracle agents writing in the paper's output format (`<think>` blocks, step headers, tags) score under `--preset
  paper` (its top-k, caps, widths, depths and lengths) within 0.02 of the same oracle under the toy preset, on the
  same questions: a cap that keeps the wrong documents, a parser that misses the paper's format or a cut that loses
  the answer fails it.
- Every SFT, PPO and DPO stage gives under two processes, on counts that leave a short last batch, the loss and the
  gradient of one process (tests/rehearsal_stages.py, launched once with each).
- Every loss is the same for micro-batch 1 and the whole batch (gradients compared).
- `--preset paper --dry_run` prints every paper value, pinned here to the paper's tables.

    python -m pytest -q tests/test_paper_rehearsal.py        # the whole rehearsal, a few minutes on 2 CPU cores
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import rehearsal_stages
import torch
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ one process and two: every stage of every method
@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """Every stage of tests/rehearsal_stages.py run by one process, then by two (gloo, CPU): (one, two)."""
    out, script = tmp_path_factory.mktemp("stages"), str(ROOT / "tests" / "rehearsal_stages.py")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port"]
    for command in (
        [sys.executable, script, str(out / "one.pt")],
        [*launch, free_port(), script, str(out / "two.pt")],
    ):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"{n}.pt", weights_only=True) for n in ("one", "two")]


@pytest.mark.parametrize("name", list(rehearsal_stages.STAGES))
def test_a_stage_under_two_processes_gives_the_loss_and_gradient_of_one(name, stage_runs):
    one, two = (runs[name] for runs in stage_runs)
    assert one.keys() == two.keys() and {"loss", "grad"} <= one.keys()
    for key in one:
        assert torch.allclose(torch.as_tensor(two[key]), torch.as_tensor(one[key]), rtol=1e-4, atol=1e-6), key
    assert torch.as_tensor(one["grad"]).abs().max() > 0  # the step moved the weights


# ------------------------------------------------------------------ smartrag
SMARTRAG_DATA = str(ROOT / "data" / "toy")


def smartrag_oracle(monkeypatch, tokenizer, tags, paper):
    """The toy oracle (common.toy.smartrag.oracle_policy) as the policy in smartrag's own rollout: generate() writes
    its action (after a tag the threshold or the quota forced: that tag's text), cut at max_new_tokens;
    first_token_probs puts p = 1 on its tag. The knowledge probe's base model: oracle_base, its reply cut at
    max_tokens words."""
    import re

    import smartrag
    from common.llm import Generation
    from common.toy.smartrag import oracle_base, oracle_policy

    tag_of = {smartrag.ANSWER_TAG: tags["answer"], smartrag.RETRIEVE_TAG: tags["retrieve"]}
    action = lambda ids: oracle_policy(tokenizer.decode(ids), SMARTRAG_DATA).split(" ", 1)  # [tag, text]

    def generate(model, tokenizer_, prompts, max_new_tokens, **kwargs):
        out = []
        for prompt in prompts:
            prefix = prompt[-1] in tags.values()
            tag, text = action(prompt[:-1] if prefix else prompt)
            assert not prefix or prompt[-1] == tag_of[tag]  # the oracle would have chosen the tag it was given
            ids = [] if prefix else [tag_of[tag]]
            out.append((ids + tokenizer(" " + text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[
                :max_new_tokens])  # fmt: skip
        return Generation([""] * len(out), out, [list(p) for p in prompts], [True] * len(out))

    def first_token_probs(model, prompts, pad_id):
        probs = torch.zeros(len(prompts), len(tokenizer))
        for row, prompt in enumerate(prompts):
            probs[row, tag_of[action(prompt)[0]]] = 1.0
        return probs

    class Base:
        def chat(self, messages_lists, max_tokens=256, **sampling):
            replies = [oracle_base(m[-1]["content"], SMARTRAG_DATA, paper) for m in messages_lists]
            return [re.match(rf"(\S+\s*){{0,{max_tokens}}}", r).group(0).rstrip() for r in replies]

    monkeypatch.setattr(smartrag, "generate", generate)
    monkeypatch.setattr(smartrag, "first_token_probs", first_token_probs)
    monkeypatch.setattr(smartrag, "make_llm", lambda spec, **kw: Base())


def test_smartrag_oracle_scores_the_same_under_the_toy_and_the_paper_preset(monkeypatch, tmp_path):
    """The oracle policy through smartrag's rollout, rewards and evaluation (greedy: the threshold; sampled), and the
    oracle base model through the knowledge probe of pi_0* (App. A.2), on the same 80 one-hop questions: under
    --preset paper (Tab. 7 templates, top-4 snippets, 50 new tokens, a probe reply in a chat model's format: a <think>
    block, then the [Answer] tag) they score what they score under the toy preset."""
    from accelerate import Accelerator

    import smartrag
    from common.data import load_split

    model, tokenizer = rehearsal_stages.tiny_lm()
    tags = smartrag.add_tags(model, tokenizer)
    test, train = (load_split(SMARTRAG_DATA, split, "one_hop")[:80] for split in ("test", "train"))
    scores = {}
    for preset in ("toy", "paper"):
        smartrag_oracle(monkeypatch, tokenizer, tags, paper=preset == "paper")
        args = smartrag.apply_preset(smartrag.Args(preset=preset, eval=True, data_dir=SMARTRAG_DATA, encoder="tfidf"))
        (tmp_path / preset).mkdir()
        result = smartrag.evaluate_stage(Accelerator(cpu=True), tmp_path / preset, "eval", model, tokenizer,
                                         smartrag.environment(args), test, args, tags)  # fmt: skip
        known = sum(smartrag.probe_knowledge(train, args)) / len(train)
        scores[preset] = dict(em=result["em"], reward=result["reward"], sampled=result["sampled"]["em"],
                              retrieval=result["retrieval_rate"], known=known)  # fmt: skip
    toy, paper = scores["toy"], scores["paper"]
    assert toy["em"] >= 0.8 and 0.1 <= toy["known"] <= 0.6 and 0.3 <= toy["retrieval"] <= 0.9  # a good oracle
    for key in toy:
        assert abs(paper[key] - toy[key]) <= 0.02, (key, toy, paper)


@pytest.mark.parametrize("name", ["smartrag:sft", "smartrag:ppo"])
def test_smartrag_losses_are_the_same_for_micro_batch_1_and_the_whole_batch(name):
    """sft (runs.sft_step) and the PPO update (policy and value losses): the same gradient for any micro-batch size."""
    from accelerate import Accelerator

    one, whole = (rehearsal_stages.STAGES[name](Accelerator(cpu=True), micro_batch_size=m) for m in (1, 64))
    assert torch.allclose(one["grad"], whole["grad"], rtol=1e-5, atol=1e-7) and whole["grad"].abs().max() > 0
    assert torch.allclose(torch.as_tensor(one["loss"]), torch.as_tensor(whole["loss"]), rtol=1e-6)


SMARTRAG_PAPER = {  # flag: the paper preset's value, where the paper (or the authors' code, impl) gives it
    "model": "meta-llama/Llama-2-7b-chat-hf",  # §4, App. A.3: LLaMA-2-7B (impl: the chat model)
    "lora_r": 16,  # App. A.3: LoRA for LLaMA (the rank is ours: the paper gives none)
    "templates": "paper",  # Tab. 7
    "quota": 1,  # §4: "the retrieval quota N is specified to be 1"
    "top_k": 4,  # §4, App. A.3: K = 4
    "alpha": 0.2,  # §4, App. A.3: retrieval reward -0.2 (Eq. 5)
    "initial_policy": "filtered",  # §3.1, App. A.2, App. B.4: the main results start from pi_0* (initial policy 2)
    "know_f1": 0.2,  # App. A.2: the base model answers directly with F1 >= 0.2
    "sft_steps": 0,  # §4, App. A.3: 1 epoch (0: one epoch)
    "sft_lr": 3e-4,  # §4, App. A.3
    "sft_batch_size": 8,  # §4, App. A.3
    "rollout_tokens": 5120,  # §4, App. A.3: trajectories of 5120 tokens per iteration
    "ppo_epochs": 1,  # §4, App. A.3
    "ppo_lr": 2e-6,  # §4, App. A.3
    "ppo_batch_size": 32,  # §4, App. A.3
    "sample_top_k": 50,  # App. A.3: top-K sampling, K = 50
    "threshold": 0.5,  # §4.1, App. A.3: a threshold on the first token (impl: 0.5)
    "num_beams": 4,  # App. A.3: beam search (impl: 4 beams)
    "max_new_tokens": 50,  # impl
    "ppo_iterations": 50,  # impl (LLaMA)
    "gamma": 0.99,  # Eq. 6's discount (impl: 0.99, per token)
    "lam": 0.95,  # impl
    "clip": 0.2,  # impl
    "vf_coef": 0.5,  # impl
    "max_grad_norm": 0.5,  # impl
    "kl_init": 0.001,  # impl
    "kl_target": 0.2,  # impl
    "kl_adaptive": True,  # impl
    "invalid_reward": -1.0,  # impl
    "data_dir": "data/smartrag",  # App. A.1: PopQA, AmbigNQ and 20k HotpotQA questions, trained on together
    "encoder": "intfloat/e5-base-v2",  # simplification: a local index for Bing (header 1)
    "question_types": "",  # every question of the data (§4)
    "rewriter": "",  # App. A.2: gpt-3.5-turbo-1106, given with --rewriter (an endpoint)
    "base_llm": "hf:meta-llama/Llama-2-7b-chat-hf",  # §3.1: the base LLM itself is probed
    "probe_tokens": 32,  # ours
    "rollout_batch": 64,  # ours
    "micro_batch_size": 8,  # ours: memory only
    "gradient_checkpointing": True,  # ours: memory only
    "base_pretrain_steps": 0,  # toy world only (header 11)
    "augment_p": 0.0,  # toy world only (header 10)
    "rl_augment_p": 0.0,  # toy world only (header 10)
}


def test_smartrag_dry_run_prints_every_paper_value(capsys):
    """--preset paper --dry_run prints the resolved configuration (then stops on the absent data/smartrag corpus):
    every flag is printed, and the paper preset's values are the paper's (SMARTRAG_PAPER cites each)."""
    import json
    from dataclasses import fields

    import smartrag

    with pytest.raises(SystemExit, match="corpus"):
        smartrag.main(["--preset", "paper", "--dry_run"])
    printed = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]
    assert set(printed) == {f.name for f in fields(smartrag.Args)}
    assert set(smartrag.PRESETS) <= set(SMARTRAG_PAPER)  # every preset value is pinned
    assert {k: printed[k] for k in SMARTRAG_PAPER} == SMARTRAG_PAPER


# ------------------------------------------------------------------ c3po
class C3poThinkingLLM:
    """The toy reader as a reasoning model serves it: every reply after a <think> block, cut at max_tokens words; it
    judges too (App. D.2), with the verdict of cover-EM, so its scores are the toy preset's judge's."""

    def __init__(self, reader):
        self.reader = reader

    def chat(self, messages_lists, max_tokens=256, **sampling):
        import ast
        import re

        from common.metrics import cover_em

        replies = []
        for messages in messages_lists:
            prompt = messages[-1]["content"]
            if "precise answer validator" in prompt:  # [App. D.2]
                golds = ast.literal_eval(re.search(r"Correct Answer: (.*)\n", prompt).group(1))
                verdict = bool(cover_em(prompt.rpartition("Predicted Answer: ")[2].strip(), golds))
                reply = f"<think>\nI compare the predicted answer with each correct answer.\n</think>\n\n{verdict}"
            else:
                reply = "<think>\nI read the question and the documents.\n</think>\n\n"
                reply += self.reader.chat([messages], **sampling)[0]
            replies.append(" ".join(reply.split(" ")[:max_tokens]))
        return replies


def c3po_oracle_accuracy(preset, style, rows, monkeypatch):
    """Algorithm 1 (c3po.evaluate: the rollout, the parsers, the judge) with the toy oracle as the proxy, writing in
    `style`, under the preset's values and templates (only the retriever and the LLM are the toy world's)."""
    import random

    import c3po
    from common.toy.c3po import oracle_c3po

    world = str(ROOT / "data" / "toy")
    args = c3po.apply_preset(
        c3po.Args(preset=preset, eval=True, model="oracle", data_dir=world, encoder="tfidf", llm="toy")
    )
    env = c3po.environment(args)
    if preset == "paper":
        env.llm = C3poThinkingLLM(env.llm)

    rng = random.Random(0)  # noise 0: never drawn against

    def act(requests, seed):  # fixed texts as the proxy gets them; else the oracle (noise 0) after any forced prefix
        draw = lambda r: r.prefix + oracle_c3po(r.tree["row"], r.agent, r.ctx, r.prefix, rng, 0, style)
        return [[(r.fixed or draw(r), None, None)] * r.n for r in requests]

    monkeypatch.setattr(c3po, "proxy_actor", lambda model, tokenizer, args, greedy: act)
    return c3po.evaluate(None, None, env, rows, args)


@pytest.mark.parametrize("style", ["paper", "think"])
def test_c3po_oracle_scores_the_same_under_the_paper_preset(style, monkeypatch):
    """The oracle under --preset paper (App. B.1 templates, top-10, 10 documents, depth 15, the LLM judge, a reader
    that thinks first) and under the toy preset, on the same 80 test questions of every type; paper: the formats the
    paper prints (a thought per document, `Thought: ... Action: ...`), think: after a <think> block naming the other
    actions, as a reasoning model writes."""
    from common.data import load_split

    rows = load_split(str(ROOT / "data" / "toy"), "test", "")[:80]
    toy = c3po_oracle_accuracy("toy", "compact", rows, monkeypatch)
    paper = c3po_oracle_accuracy("paper", style, rows, monkeypatch)
    assert toy["accuracy"] > 0.8 and toy["strategies"]["Planning"] > 0.4 and toy["retrievals"] > 0.5
    assert abs(paper["accuracy"] - toy["accuracy"]) <= 0.02, (paper["strategies"], toy["strategies"])
    assert paper["strategies"] == toy["strategies"] and paper["invalid"] == 0.0


def test_c3po_losses_are_the_same_for_micro_batch_1_and_the_whole_batch(monkeypatch, tmp_path):
    """c3po.sft (AdamW made SGD at learning rate 1) and c3po.ppo_update (the policy and the value model), one step on
    three sequences at --micro_batch_size 1 and 3: the same weight change."""
    import copy

    from accelerate import Accelerator
    from rehearsal_stages import C3PO_SFT, c3po_args, c3po_samples, sgd, tiny_lm, trained

    import c3po

    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, **_: sgd(params))
    changes = {}
    for micro in (1, 3):
        args = c3po_args(sft_steps=1, sft_batch_size=3, sft_lr=1.0, micro_batch_size=micro, kl_coef=0.1)
        model, tokenizer = tiny_lm()
        before = trained(model)
        examples = [dict(prompt=p, output=o, agent="router", row={}) for p, o in C3PO_SFT]
        model, _ = c3po.sft(Accelerator(cpu=True), model, tokenizer, examples, args, None, tmp_path)
        policy, ref = tiny_lm()[0], tiny_lm(seed=1)[0].requires_grad_(False)
        value = c3po.ValueModel(policy)
        torch.nn.init.normal_(value.head.weight, std=0.1, generator=torch.Generator().manual_seed(2))
        start = trained(policy), trained(value)
        optimizers = [sgd(policy.parameters()), sgd(value.parameters())]
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in optimizers]
        c3po.ppo_update(Accelerator(cpu=True), policy, value, ref, optimizers, schedulers,
                        copy.deepcopy(c3po_samples(3)), tokenizer.pad_token_id, args)  # fmt: skip
        changes[micro] = [before - trained(model), start[0] - trained(policy), start[1] - trained(value)]
    for whole, one in zip(changes[3], changes[1]):
        assert whole.abs().max() > 0 and torch.allclose(one, whole, rtol=1e-5, atol=1e-7)


C3PO_PAPER = {  # flag: the paper preset's value, where the paper (or the authors' code, impl) gives it
    "model": "Qwen/Qwen2-0.5B",  # Tab. 6 (or Qwen2-1.5B); §6.1
    "llm": "hf:Qwen/Qwen2-72B-Instruct",  # §6.1: the fixed LLM server
    "encoder": "facebook/contriever-msmarco",  # §6.1, App. A.2
    "judge": "llm",  # App. D.2
    "templates": "paper",  # App. B.1, D.1 (as the authors' code writes them)
    "system_prompt": "You are a helpful assistant.",  # impl
    "top_k": 10,  # impl
    "max_documents": 10,  # impl
    "max_depth": 13,  # Tab. 7: maximal depth
    "max_depth_eval": 15,  # impl
    "branch_k": 2,  # Eq. 2
    "branch_until": 4,  # Eq. 2
    "roadmap_temperature": 0.3,  # impl
    "max_query_words": 100,  # impl
    "max_new_tokens": 2048,  # Tab. 7: generate max len
    "prompt_max_len": 4096,  # Tab. 7: prompt max len
    "credit_mode": "tree",  # §5.1
    "forced_weight": 1.0,  # §5.2: every node of the tree is a sample
    "teacher": "llm",  # §6.1, §6.7: C-3PO-ICL, Qwen2-72B-Instruct in the proxy roles
    "teacher_temperature": 0.6,  # impl
    "warmup_keep": 4,  # §6.1: 4 solutions per question
    "warmup_select": "uniform",  # §5.2: rejection sampling of successful paths
    "sft_epochs": 3.0,  # Tab. 6
    "sft_steps": 0,  # Tab. 6: epochs, not steps
    "sft_lr": 4e-5,  # Tab. 6
    "sft_batch_size": 512,  # Tab. 6
    "cutoff_len": 4096,  # Tab. 6
    "question_types": "",  # Tab. 8: every question of the data folder
    "augment_p": 0.0,  # no renaming outside the toy world
    "rl_augment_p": 0.0,  # no renaming outside the toy world
    "ppo_iterations": 150,  # impl (checkpoint names; the paper: chosen on validation)
    "ppo_batch_size": 1024,  # Tab. 7: batch size
    "policy_lr": 5e-7,  # Tab. 7
    "value_lr": 5e-6,  # Tab. 7
    "kl_coef": 0.005,  # Tab. 7
    "ppo_epochs": 1,  # OpenRLHF, App. A.2's framework (header 18: the toy preset's 2)
    "gamma": 1.0,  # OpenRLHF
    "lam": 0.95,  # OpenRLHF
    "clip": 0.2,  # OpenRLHF (Eq. 9's epsilon)
    "vf_coef": 0.5,  # OpenRLHF (Eq. 11's c_v)
    "value_clip": 0.2,  # OpenRLHF (header 5)
    "max_grad_norm": 1.0,  # OpenRLHF
    "rollout_batch": 64,  # ours: 64 trees give about 1024 agent-node samples (Tab. 7's batch)
    "micro_batch_size": 4,  # ours: memory only (every loss is the same for any micro-batch size)
    "answer_max_tokens": 256,  # ours (header 9)
    "gen_batch_size": 512,  # ours: memory only
}


def test_c3po_dry_run_prints_every_paper_value_and_each_is_the_papers(capsys):
    import json

    import c3po

    try:
        c3po.main(["--preset", "paper", "--dry_run"])
    except SystemExit:  # data/c3po is not in the repository: named after the configuration
        pass
    config, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert set(c3po.PRESETS) <= set(config) and set(C3PO_PAPER) <= set(config)
    assert {k: config[k] for k in C3PO_PAPER} == C3PO_PAPER


# ------------------------------------------------------------------ sparkle
def sparkle_oracle_eval(preset, ablation, monkeypatch, reasoning=False, n=100):
    """Algorithm 1 on the first n toy test questions with the noiseless toy oracle as the proxy (written in the
    template set's formats by common.toy.sparkle.oracle_text: the paper set's are Fig. 4's answers and Tab. 8's QF
    output), through sparkle.evaluate: the preset's top-k, triples, context cap, step caps and templates; the toy
    reader as the LLM (a reasoning LLM: common.toy.ReasoningReader)."""
    import sparkle
    from common import runs
    from common.data import load_split

    argv = ["--eval", "--preset", preset, "--data_dir", str(ROOT / "data" / "toy"), "--llm", "toy", "--encoder",
            "tfidf", "--model", "toy-lm", "--teacher_model", "oracle", "--ablation", ablation]  # fmt: skip
    args = sparkle.apply_preset(runs.parse_args(sparkle.Args, argv + ["--reasoning_llm"] * reasoning))
    args.teacher_noise = 0.0  # the noiseless oracle (a preset-only field)
    env = sparkle.environment(args)
    if reasoning:  # the toy reader as a reasoning LLM (Fig. 7): paragraphs, the answer in \boxed{}
        from common.toy import ReasoningReader

        env.llm = ReasoningReader(env.llm)
    monkeypatch.setattr(sparkle, "proxy_actor", lambda model, tokenizer, a, greedy: sparkle.teacher_actor(a, None, 0))
    return sparkle.evaluate(None, None, env, load_split(args.data_dir, "test")[:n], args)


@pytest.mark.parametrize("ablation, reasoning", [("none", False), ("no_ki", False), ("none", True)])
def test_sparkle_oracle_scores_the_same_under_the_paper_preset(ablation, reasoning, monkeypatch):
    # the paper preset (top-10 documents, 20 triples, a context of 5, 20 steps, the paper's templates) against the
    # toy preset (top-3, 5 triples, compact templates): F1, the reward R and the retrievals a question agree within
    # 0.02 (w/o KI appends every hit [App. D.2]: a cap keeping ranks 6-10 doubles the retrievals)
    toy, paper = (sparkle_oracle_eval(p, ablation, monkeypatch, reasoning) for p in ("toy", "paper"))
    assert toy["f1"] > (0.65 if ablation == "no_ki" else 0.85), toy
    for key in ("f1", "reward", "retrievals"):
        assert paper[key] == pytest.approx(toy[key], abs=0.02), (key, toy[key], paper[key])


@pytest.mark.parametrize("stage", ["sparkle:sft", "sparkle:ppo"])
def test_sparkle_losses_are_the_same_for_any_micro_batch(stage):
    # SFT (Tab. 5), the clipped surrogate and the value loss (PPO): micro-batch 1 against the whole batch
    from accelerate import Accelerator

    one, whole = (rehearsal_stages.STAGES[stage](Accelerator(cpu=True), micro=m) for m in (1, 64))
    for key in one:  # float32 sums in another order: equal to 1e-5 of the largest entry
        a, b = torch.as_tensor(one[key]), torch.as_tensor(whole[key])
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-9, key


SPARKLE_PAPER = {  # flag -> (value, where the paper or the authors' code has it)
    "model": ("Qwen/Qwen2.5-3B-Instruct", "§4.1, §D.3"),
    "llm": ("hf:Qwen/Qwen2.5-7B-Instruct", "§4.1, §D.3"),
    "reasoning_llm": (False, "§4.1: an instruct LLM (Fig. 6)"),
    "encoder": ("intfloat/e5-large-v2", "§D.3"),
    "templates": ("paper", "App. A, Fig. 4-8"),
    "top_k": (10, "§D.3"),
    "n_triples": (20, "§D.3 (impl: 25)"),
    "max_context": (5, "impl (the paper: no cap; header 8)"),
    "max_steps": (12, "impl"),
    "max_steps_eval": (20, "impl"),
    "max_retrievals": (5, "impl"),
    "max_rd_calls": (8, "impl"),
    "tree_depth": (4, "§3.1, §D.3: L = 4"),
    "standard_rollout": (False, "§3.1"),
    "ablation": ("none", "Tab. 4"),
    "alpha": (0.3, "§3.2, §D.3"),
    "max_new_tokens": (160, "impl"),
    "max_length": (2048, "Tab. 5, Tab. 6"),
    "llm_max_tokens": (256, "impl"),
    "teacher_model": ("hf:Qwen/Qwen2.5-72B-Instruct", "§D.3"),
    "teacher_temperature": (0.6, "ours: the paper states none"),
    "warmup_keep": (4, "ours: the paper states none"),
    "warmup_select": ("uniform", "§D.3: every trajectory with the correct answer"),
    "warmup_types": ("", "§D.3: every training question"),
    "sft_steps": (0, "Tab. 5: the epoch decides"),
    "sft_lr": (5e-6, "Tab. 5"),
    "sft_batch_size": (64, "Tab. 5"),
    "micro_batch_size": (4, "impl"),
    "augment_p": (0.0, "the toy world's renaming: off"),
    "rl_augment_p": (0.0, "the toy world's renaming: off"),
    "ppo_iterations": (120, "impl: one episode of 7,500 questions, 64 a rollout (App. E.1: converged after ~60)"),
    "rollout_batch": (64, "impl"),
    "ppo_batch_size": (1024, "Tab. 6"),
    "policy_lr": (5e-7, "Tab. 6"),
    "value_lr": (5e-6, "Tab. 6"),
    "kl_coef": (0.002, "Tab. 6"),
    "gamma": (1.0, "impl"),
    "lam": (0.95, "impl"),
    "clip": (0.2, "impl"),
    "code_shaping": (False, "the paper: plain Eq. 2"),
    "forced_weight": (1.0, "App. E.4: the forced decisions are recorded and trained"),
    "vf_coef": (0.5, "impl"),
    "value_clip": (0.2, "impl"),
    "max_grad_norm": (1.0, "impl"),
    "critic_init": ("base", "impl"),
    "n_train": (None, "every training row of --data_dir (§D.3: 7,500)"),
    "n_eval": (None, "every test row of --data_dir (§4.1: 1,000)"),
}


def test_sparkle_paper_preset_prints_the_papers_values(capsys):
    import sparkle

    with pytest.raises(SystemExit, match="not found"):  # the paper's data folder is not here
        sparkle.main(["--preset", "paper", "--dry_run"])
    out = capsys.readouterr().out
    printed = json.loads(out[: out.index("\n}") + 2])
    assert {k: printed[k] for k in SPARKLE_PAPER} == {k: v for k, (v, _) in SPARKLE_PAPER.items()}
    assert printed["preset"] == "paper" and printed["lam"] == 0.95


# ------------------------------------------------------------------ tearag
class TearagOracle:
    """common.llm.generate with TeaRAG's toy oracle as the policy (common.toy.tearag.oracle_tearag): each prompt's
    next turn, tokenized as a model's output (up to and with the <Reference> stop, EOS after a final answer, at most
    max_new_tokens). Paths alike so far draw their noise apart, seeded by question, text and rank in the call."""

    def __init__(self, rows, tokenizer, templates, noise=0.0):
        import tearag as T

        prompts = T.encode_prompts(tokenizer, [r["question"] for r in rows], templates)
        self.rows, self.noise, self.lengths = (
            {tuple(p): r for p, r in zip(prompts, rows)},
            noise,
            {len(p) for p in prompts},
        )

    def __call__(self, model, tokenizer, prompts, max_new_tokens, **sampling):
        import random
        from collections import Counter

        from common.llm import Generation
        from common.toy.tearag import oracle_tearag

        stop, seen, out = tokenizer.convert_tokens_to_ids("<Reference>"), Counter(), ([], [], [])
        for ids in prompts:
            n = next(n for n in self.lengths if tuple(ids[:n]) in self.rows)
            row, path = self.rows[tuple(ids[:n])], tokenizer.decode(ids[n:], skip_special_tokens=True)
            seen[row["question"], path] += 1
            rng = random.Random(f"{row['question']}|{path}|{seen[row['question'], path]}")
            turn = tokenizer(oracle_tearag(row, path, rng, self.noise), add_special_tokens=False)["input_ids"]
            turn = turn[: turn.index(stop) + 1] if stop in turn else turn + [tokenizer.eos_token_id]
            out[0].append(tokenizer.decode(turn[:max_new_tokens], skip_special_tokens=True))
            out[1].append(turn[:max_new_tokens])
            out[2].append(len(turn) <= max_new_tokens)
        return Generation(out[0], out[1], [list(p) for p in prompts], out[2])


@pytest.fixture(scope="module")
def tearag_oracle_runs():
    """The oracle as the policy in TeaRAG's greedy evaluation (66 test questions) and in an IP-DPO sampling round (R
    paths, rewards, pairs; noise 0.3, 24 questions), under --preset toy and --preset paper (toy-lm, TF-IDF and the
    lexical reranker for the paper's models): {preset: (evaluation, round paths, pairs, pair kinds)}."""
    import json

    import tearag as T
    from common.runs import flag_parser
    from common.toy.lm import load_toy_lm

    world = ROOT / "data" / "toy"
    rows = [json.loads(line) for line in (world / "test.jsonl").open()][::6]
    runs = {}
    for preset in ("toy", "paper"):
        flags = ["--preset", preset, "--data_dir", str(world), "--encoder", "tfidf", "--reranker", "lexical"]
        args = T.apply_preset(flag_parser(T.Args).parse_args_into_dataclasses(args=flags)[0])
        model, tokenizer = load_toy_lm(rehearsal_stages.TINY_LM, world=world)
        T.add_format_tokens(model, tokenizer)
        system = T.RetrievalSystem(args)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(T, "generate", TearagOracle(rows, tokenizer, args.templates))
            result = T.evaluate(model, tokenizer, system, rows, args)
            patch.setattr(T, "generate", TearagOracle(rows, tokenizer, args.templates, noise=0.3))
            runs[preset] = (result, *T.sample_round(model, tokenizer, system, rows[:24], args, 0, "oracle"))
    return runs


def test_tearag_oracle_scores_the_same_under_the_paper_preset(tearag_oracle_runs):
    """The paper preset's values and prompts (the instruction as system turn, 512 new tokens, rollout batches of 64)
    give the oracle the scores of the toy preset: evaluation EM, F1, format, steps; the round's rewards and pairs."""
    (toy, toy_paths, toy_pairs, toy_kinds), (paper, paper_paths, paper_pairs, paper_kinds) = (
        tearag_oracle_runs["toy"],
        tearag_oracle_runs["paper"],
    )
    assert toy["n"] == paper["n"] == 67 and toy["em"] > 0.8 and toy["format"] == 1.0  # the oracle reads its evidence
    for key in ("em", "f1", "format", "retrievals", "evidence_recall"):
        assert abs(toy[key] - paper[key]) <= 0.02, (key, toy[key], paper[key])
    mean = lambda paths, i: sum(p.rewards[i] for p in paths) / len(paths)
    for i in range(3):  # r_format, r_outcome, r_process
        assert abs(mean(toy_paths, i) - mean(paper_paths, i)) <= 0.02, i
    assert len(toy_paths) == len(paper_paths) == 24 * 8 and len(toy_pairs) == len(paper_pairs) > 0
    assert set(toy_kinds) == {"format", "easy"} and toy_kinds == paper_kinds  # noise: bad headers, wrong answers


def test_tearag_losses_give_the_same_gradient_at_micro_batch_1_and_the_whole_batch():
    """tearag.sft (the token mean of Eq. 4) and tearag.dpo_round (L_ALL of Eq. 15-17) on the rehearsal's data: the
    weight change of micro-batch 1 is that of the whole batch (3 paths, 3 pairs)."""
    from accelerate import Accelerator

    for stage in (rehearsal_stages.tearag_sft, rehearsal_stages.tearag_dpo):
        one, whole = (stage(Accelerator(cpu=True), micro_batch_size=size) for size in (1, 3))
        assert torch.allclose(one["grad"], whole["grad"], rtol=1e-4, atol=1e-6), stage.__name__
        assert one["loss"] == pytest.approx(whole["loss"], rel=1e-5) and whole["grad"].abs().max() > 0


TEARAG_PAPER = {  # flag: value under --preset paper, and where the paper gives it
    "model": "meta-llama/Meta-Llama-3-8B-Instruct",  # §5.1.3: Llama3-8B-Instruct (and Qwen2.5-14B-Instruct)
    "encoder": "intfloat/e5-base-v2",  # §5.1.3: E5-base-v2
    "reranker": "BAAI/bge-reranker-v2-m3",  # §5.1.3: BGE-reranker-v2
    "lora_r": 8,  # §5.1.3: LoRA rank 8 (alpha 32, dropout 0.1 on q/k/v/o_proj: tearag.load_policy)
    "templates": "paper",  # §4.2 (the instruction is ours: the paper prints none)
    "retrieval": "ppr",  # §4.2.5: KAG + PPR (Tab. 7's variants are flags)
    "chunk_candidates": 20,  # §5.1.3: top-20 chunks
    "k_d": 5,  # §5.1.3: reranked to k_d = 5
    "entity_candidates": 10,  # §5.1.3: top-10 entities
    "k_entities": 5,  # §5.1.3: reranked to 5 entities
    "triplet_candidates": 20,  # §5.1.3: 20 edges
    "k_t": 10,  # §5.1.3: reranked to k_t = 10
    "k_f": 5,  # §5.1.3: k_f = 5
    "tau": 0.2,  # §5.1.3, Eq. 2
    "alpha": 0.5,  # §5.1.3, Eq. 3
    "ppr_iterations": 200,  # §5.1.3: N = 200
    "max_steps": 5,  # §5.1.3: k <= 5
    "sft_steps": 0,  # §5.1.3: 1 epoch
    "sft_lr": 5e-4,  # §5.1.3
    "sft_batch_size": 128,  # §5.1.3: overall batch size 128
    "weight_decay": 0.001,  # §5.1.3
    "sft_single_steps": True,  # §4.3.1, Tab. 1: each step also as a single-hop question
    "sft_distractors": 0,  # §4.3.1 (4): the golden paragraphs and the evidence triplets
    "micro_batch_size": 2,  # §5.1.3: per-device batch size 2 (IP-DPO; SFT's 16): memory only, the loss is the same
    "rounds": 3,  # §5.4.3, Fig. 8: TeaRAG-1..3
    "n_rollouts": 8,  # §5.1.3: R = 8
    "dpo_epochs": "2,2,1",  # §5.1.3
    "eta": "1,0.5,0.25",  # §5.1.3: within [0.25, 0.5, 1], reduced over the rounds
    "beta": 0.5,  # §5.1.3, Eq. 16
    "dpo_lr": 1e-4,  # §5.1.3
    "dpo_batch_size": 16,  # §5.1.3: overall batch size 16
    "n_dpo": None,  # Tab. 2: the whole IP-DPO split (10,000 questions)
    "n_eval": None,  # §5.1.1: the whole test sets
    "data_dir": "data/tearag",  # not in the paper: where the data is
    "max_new_tokens": 512,  # not in the paper (ours)
    "temperature": 1.0,  # not in the paper (ours; Fig. 13 evaluates 0.2-1.0)
    "rollout_batch": 64,  # not in the paper: questions per batched rollout (throughput)
    "augment_p": 0.0,  # toy world only: off
    "sft_curriculum": "",  # toy world only: off (one SFT stage on the whole mix, §4.3.1)
}


def test_tearag_paper_preset_prints_the_papers_values(capsys):
    """--preset paper --dry_run prints every value of the paper preset, each the paper's (or marked as not in it)."""
    import contextlib
    import json

    import tearag as T

    with contextlib.suppress(SystemExit):  # exit 1 where data/tearag or a hub model is missing: printed first
        T.main(["--preset", "paper", "--dry_run", "--train"])
    config, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)
    assert set(T.PRESETS) <= set(TEARAG_PAPER), set(T.PRESETS) - set(TEARAG_PAPER)
    assert {flag: config[flag] for flag in TEARAG_PAPER} == TEARAG_PAPER


# ------------------------------------------------------------------ sparcrag
SPARCRAG_ORACLE = {"teacher_duplicate": 0.0, "teacher_accept_correct": 1.0, "teacher_accept_wrong": 0.0}


def sparcrag_oracle(preset, rows):
    """SPARC-RAG's toy oracle as the trained roles (Query Rewriter, Answer Evaluator) and the toy reader as the Context
    Manager and Answer Generator (--llm toy: no random model plays a role), under a preset's values and templates:
    (args, ctx, tokenizer, the runs of the tuned system: adaptive depth, capped at --depth)."""
    import sparcrag
    from common.toy import sparcrag as toy

    args = rehearsal_stages.sparcrag_args(preset=preset, **SPARCRAG_ORACLE)
    retrievers, llm = sparcrag.frozen_parts(args)
    policy, tokenizer = sparcrag.load_policy(args, torch.device("cpu"))  # its tokenizer counts the tokens
    ctx = sparcrag.make_ctx(
        policy, tokenizer, retrievers, llm, args, toy.teacher_roles(args, sparcrag.format_rewrites)
    )
    return args, ctx, tokenizer, sparcrag.sparc_rag(rows, ctx, args.width, args.depth, True, args.seed)


def test_sparcrag_oracle_scores_the_same_under_the_paper_preset_and_its_pairs_train_on_what_it_wrote():
    """On 60 toy test questions the oracle writing the paper's formats (a <think> block before the rewrites, a reason
    before the decision) under --preset paper (top-6, depth cap 8 and fixed depth 6, the App. D prompts, 600-token
    caps) scores within 0.02 of the oracle under the toy preset (top-3, depth 4, compact prompts), adaptive and at
    fixed depth; the preference pairs built from its runs (recall and correctness labels, against a sample cut inside
    its <think> block) train on the responses as written: the <think> block kept, the cut one without [END] or EOS."""
    import sparcrag
    from common.data import load_split

    rows, scores, cut = load_split(str(ROOT / "data" / "toy"), "test")[:60], {}, "<think> i need to know the"
    for preset in ("toy", "paper"):
        args, ctx, tokenizer, played = sparcrag_oracle(preset, rows)
        fixed = sparcrag.sparc_rag(rows, ctx, args.width, args.untuned_depth, False, args.seed)
        scores[preset] = [sparcrag.summarize([sparcrag.run_record(r, args) for r in runs], rows)["f1"]
                          for runs in (played, fixed)]  # fmt: skip
        written = {e["prompt"]: e["output"] for run in played for e in run.trace}
        sample = lambda prompts, n: [[written[p], cut] for p in prompts]  # the oracle's, a cut one
        pairs = sparcrag.build_pairs(played, ctx, sample, replace(args, n_samples=2))
        assert {p["role"] for p in pairs} == {"rewrite", "evaluate"} and all(p["rejected"] == cut for p in pairs)
        think = [p["chosen"].startswith("<think>") for p in pairs if p["role"] == "rewrite"]
        assert think and set(think) == {preset == "paper"}  # the paper's Rewrite prompt asks for the block
        tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        for pair in pairs:
            n = len(tokens(sparcrag.chat_prompts(tokenizer, [[{"role": "user", "content": pair["prompt"]}]])[0]))
            assert sparcrag.encode(tokenizer, pair["prompt"], pair["chosen"])[0][n:] == tokens(pair["chosen"]) + [
                tokenizer.eos_token_id
            ]
            assert sparcrag.encode(tokenizer, pair["prompt"], cut)[0][n:] == tokens(cut)
    for adaptive_or_fixed in (0, 1):
        assert abs(scores["paper"][adaptive_or_fixed] - scores["toy"][adaptive_or_fixed]) <= 0.02, scores
    assert min(min(s) for s in scores.values()) > 0.8  # the oracle answers (the toy reader: unanswerable ones aside)


def test_sparcrag_dpo_gives_the_same_step_at_micro_batch_1_and_the_whole_batch():
    """sparcrag.dpo_train on one batch of 4 pairs (a <think> block, a lambda-weighted pair, unequal lengths), at the
    paper's micro-batch 1 and at 4: the same loss, margins and weight change."""
    from accelerate import Accelerator

    one, whole = (rehearsal_stages.sparcrag_dpo(Accelerator(cpu=True), dpo_batch_size=4, micro_batch_size=m)
                  for m in (1, 4))  # fmt: skip
    assert one["grad"].abs().max() > 0 and len(one["loss"]) == 1
    for key in one:
        assert torch.allclose(one[key], whole[key], rtol=1e-5, atol=1e-7), key


def test_sparcrag_paper_preset_prints_every_value_pinned_to_the_paper(capsys):
    """`--preset paper --dry_run` prints the resolved configuration (then checks its paths); each value as
    the paper states it, or as the header's departures say."""
    import json

    import sparcrag

    try:
        sparcrag.main(["--preset", "paper", "--dry_run"])
    except SystemExit:  # the paper's corpora (data/sparcrag) are not in the repository, its models not cached
        pass
    printed = capsys.readouterr().out
    config = json.loads(printed[: printed.index("\n}\n") + 2])
    paper = {
        "model": "Qwen/Qwen2.5-7B-Instruct",  # [§4.2] (and Qwen3-32B)
        "llm": "policy",  # [§4.2] the backbone plays every agent
        "templates": "paper",  # [App. D]
        "width": 2,  # [§4.5: fixed W = 2]
        "depth": 8,  # [§4.5: capped at a maximum depth of 8; App. A.4: up to 8 rounds]
        "untuned_depth": 6,  # [§4.5: D = 6 for Qwen-2.5-7B-Instruct without fine-tuning]
        "early_exit": True,  # [§3.3] the winner's STOP ends the loop
        "top_k": 6,  # [App. A.3: k = 6]
        "temperature": 0.5,  # [App. A.4: generation modules]
        "max_new_tokens": 600,  # [App. A.4: maximum generation length 600]
        "evaluator_max_tokens": None,  # [App. A.4: 600]: --max_new_tokens, as every call (evaluator: T 0, make_ctx)
        "seed": 42,  # [App. A.4: global random seed 42]
        "dense_only": False,  # [§4.3: hybrid retrieval; Tab. 6 the dense-only ablation]
        "lam": 2.0,  # [§5.2: lambda = 2 in the final model]
        "beta": 0.1,  # [App. A.4]
        "reference_free": False,  # header item 2: TRL 0.23.1's DPO with LoRA [App. A.4]
        "lora_r": 16,  # [App. A.4]
        "lora_alpha": 32,  # [App. A.4]
        "lora_dropout": 0.05,  # [App. A.4]
        "dpo_lr": 5e-5,  # [App. A.4: 5e-5 (LoRA)]
        "dpo_epochs": 3,  # [App. A.4]
        "dpo_batch_size": 16,  # [App. A.4: effective batch size 16]
        "micro_batch_size": 1,  # [App. A.4: batch size 1, gradient accumulation]
        "max_length": 8192,  # [App. A.4: maximum sequence length 8192]
        "role_adapters": False,  # [§4.5: the base LLM fine-tuned on the combined data]
        "sft_steps": 0,  # no warm-up [§3.4: pairs from the base model's own runs]
        "n_train": None,  # [§4.1: the training splits]
        "n_eval": None,  # [§4.1: the test splits (500-question subsamples)]
        "correct_by": "acc",  # [§4.1: acc.]; the label itself the paper does not define (ours)
        "encoder": "intfloat/e5-base-v2",  # header item 3 (the paper: BGE-large-en-v1.5, App. A.2)
        "format_tokens": False,  # a pretrained tokenizer reads the tags as text (header item 10: the toy's tokens)
        "n_samples": 4,  # ours: samples per state [§3.4 gives none]
        "augment_p": 0.0,  # no toy renaming (header item 9)
        "evaluator_epochs": 3,  # [App. A.4: 3] (used with role_adapters only)
    }
    assert {k: config[k] for k in paper} == paper
    ignored = """preset train eval ask output_dir run_name resume dry_run report_to data_dir world corpus bm25_index
    dense_index llm_model gen_batch_size synthesize_missing sft_lr sft_batch_size warmup_widths
    teacher_accept_correct teacher_accept_wrong teacher_duplicate""".split()  # modes, paths, memory, the toy warm-up
    assert set(config) == set(paper) | set(ignored)  # every printed value pinned or named here
