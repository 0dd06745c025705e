"""SmartRAG: worked numbers by hand (rewards, returns, GAE, KL controller, PPO clipping, warm-up filter),
Algorithm 1 with a scripted policy, the loss mask, and an end-to-end toy run followed by --eval of its checkpoint."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import check_contract

import smartrag
from common import runs
from common.llm import Generation
from common.toy.lm import load_toy_lm
from common.toy.smartrag import RenamingEnv, pretrain_base

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tagged():
    """A tiny toy model and tokenizer with the two tags registered."""
    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64")
    return model, tokenizer, smartrag.add_tags(model, tokenizer)


# ---------------------------------------------------------------- rewards and returns [Eq. 5, Eq. 6]
@pytest.mark.parametrize(
    "pred, golds, reward",
    [
        ("Shane Acker", ["Shane Acker"], 2.0),
        ("Tim Burton", ["Shane Acker"], 0.0),
        ("England", ["London, England"], 2 / 3),
        ("Washington, D.C.", ["Washington, D.C."], 2.0),
        ("the Detroit Pistons", ["Detroit Pistons"], 2.0),
        ("Start date 2004", ["2004"], 0.5),
        ("", ["Cotija"], 0.0),
        ("England", ["London, England", "England"], 2.0),
    ],
)
def test_answer_reward_is_em_plus_f1(pred, golds, reward):
    assert smartrag.step_reward("answer", pred, golds, alpha=0.2, invalid_reward=-1.0) == pytest.approx(
        reward, abs=1e-4
    )


def test_retrieval_and_invalid_rewards():
    assert smartrag.step_reward("retrieve", "who produced 9", ["Shane Acker"], 0.2, -1.0) == -0.2
    assert smartrag.step_reward("invalid", "", ["Shane Acker"], 0.2, -1.0) == -1.0


@pytest.mark.parametrize(
    "rewards, undiscounted, discounted",
    [
        ([2.0], 2.0, 2.0),
        ([-0.2, 2.0], 1.8, 1.78),
        ([-0.2, 0.0], -0.2, -0.2),
        ([-0.2, 2 / 3], 0.4667, 0.46),
    ],
)
def test_discounted_return(rewards, undiscounted, discounted):
    assert smartrag.discounted_return(rewards, 1.0) == pytest.approx(undiscounted, abs=1e-4)
    assert smartrag.discounted_return(rewards, 0.99) == pytest.approx(discounted, abs=1e-4)


# ---------------------------------------------------------------- GAE across the two actions (impl: one episode)
def test_gae_carries_the_answer_reward_back_to_the_search_tokens():
    rewards = [0, 0, -0.2, 0, 2.0]  # [Search] q EOS | (forced [Answer] masked) ans EOS
    adv, _ = smartrag.gae(rewards, [0.0] * 5, 0.99, 0.95)
    assert adv == pytest.approx([1.387915, 1.47572, 1.569081, 1.881, 2.0], abs=1e-6)
    assert all(a > 0 for a in adv[:3])  # cut at the action boundary, the search tokens would be negative
    adv, _ = smartrag.gae(rewards, [0.0] * 5, 1.0, 1.0)
    assert adv == pytest.approx([1.8, 1.8, 1.8, 2.0, 2.0])
    adv, ret = smartrag.gae(rewards, [1.0, 1.0, 1.2, 1.5, 1.8], 0.99, 0.95)
    assert adv == pytest.approx([0.633081, 0.683765, 0.527129, 0.4701, 0.2], abs=1e-6)
    assert ret == pytest.approx([1.633081, 1.683765, 1.727129, 1.9701, 2.0], abs=1e-6)


def test_score_rollout_runs_one_gae_across_both_actions():
    """Two sequences of one episode (search, then forced answer): KL 0, values 0 -> the §8.8 advantages."""
    seqs = [
        dict(episode=0, ids=[7, 7, 1, 2, 3], loss_mask=[0, 0, 1, 1, 1], reward=-0.2),
        dict(episode=0, ids=[7, 7, 7, 9, 4, 5], loss_mask=[0, 0, 0, 0, 1, 1], reward=2.0),
    ]
    mask = smartrag.right_pad([s["loss_mask"] for s in seqs], 0)[:, 1:].float()
    zeros = torch.zeros_like(mask)
    args = smartrag.Args(gamma=0.99, lam=0.95)
    adv, ret, kl = smartrag.score_rollout(seqs, zeros, zeros, zeros, mask, 0.001, args)
    assert adv[0][mask[0].bool()].tolist() == pytest.approx([1.387915, 1.47572, 1.569081], abs=1e-5)
    assert adv[1][mask[1].bool()].tolist() == pytest.approx([1.881, 2.0], abs=1e-5)
    assert kl == 0.0 and adv[~mask.bool()].abs().sum() == 0


def test_kl_penalty_is_in_the_reward():
    seqs = [dict(episode=0, ids=[7, 1], loss_mask=[0, 1], reward=2.0)]
    mask = torch.tensor([[1.0]])
    args = smartrag.Args(gamma=1.0, lam=1.0)
    adv, _, kl = smartrag.score_rollout(
        seqs, torch.tensor([[-0.5]]), torch.tensor([[-1.0]]), torch.zeros(1, 1), mask, 0.001, args
    )
    assert kl == pytest.approx(0.5) and adv.item() == pytest.approx(2.0 - 0.0005)  # -beta * 0.5 on the token


@pytest.mark.parametrize("kl, beta", [(0.5, 0.00102), (0.1, 0.00098), (0.22, 0.00101)])
def test_adaptive_kl_controller(kl, beta):
    assert smartrag.update_kl_coef(0.001, kl, 0.2) == pytest.approx(beta, abs=1e-9)


# ---------------------------------------------------------------- PPO clipping [Schulman et al. 2017]
@pytest.mark.parametrize("advantage, ratio, loss", [(1.0, 1.3, -1.2), (-1.0, 0.7, 0.8), (1.0, 0.7, -0.7)])
def test_ppo_clipped_surrogate(advantage, ratio, loss):
    one = torch.ones(1, 1)
    pg, vf, _ = smartrag.ppo_losses(torch.log(one * ratio), 0 * one, advantage * one, 0 * one, 3 * one, one, 0.2)
    assert pg.item() == pytest.approx(loss, abs=1e-6)
    assert vf.item() == pytest.approx(9.0)


def test_ppo_losses_ignore_masked_tokens():
    mask = torch.tensor([[1.0, 0.0]])
    pg, vf, _ = smartrag.ppo_losses(
        torch.tensor([[0.0, 5.0]]),
        torch.zeros(1, 2),
        torch.tensor([[1.0, 100.0]]),
        torch.tensor([[1.0, 50.0]]),
        torch.zeros(1, 2),
        mask,
        0.2,
    )
    assert pg.item() == pytest.approx(-1.0) and vf.item() == pytest.approx(1.0)


# ---------------------------------------------------------------- templates, parsing, warm-up data
def test_templates_and_observation():
    hits = [{"title": "9 (2009)", "text": "Shane Acker made 9."}, {"title": "Acker", "text": "An animator."}]
    obs = smartrag.format_observation(hits)
    assert obs == "9 (2009): Shane Acker made 9. Acker: An animator."
    first = smartrag.render_state("Who was the producer of 9?", [], "paper")
    second = smartrag.render_state("Who was the producer of 9?", [obs], "paper")
    assert "Observation:" not in first and f"Observation: {obs}" in second
    assert "Question: Who was the producer of 9?" in first and first.endswith("Please output:")
    assert "'[Answer] YOUR_ANSWER'" in first and "'[Search] YOUR_SEARCH_QUERY'" in second
    assert smartrag.render_state("q ?", ["a", "b"], "compact") == "question : q ? observation : a b output :"


def test_parse_action_by_first_token(tagged):
    _, tokenizer, tags = tagged
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.tokenize(smartrag.ANSWER_TAG) == [smartrag.ANSWER_TAG]
    assert smartrag.parse_action([tags["answer"]] + encode("the city"), tags, tokenizer) == ("answer", "the city")
    assert smartrag.parse_action([tags["retrieve"]] + encode("capital city"), tags, tokenizer) == (
        "retrieve",
        "capital city",
    )
    assert smartrag.parse_action(encode("the city"), tags, tokenizer) == ("invalid", "")
    assert smartrag.parse_action([tags["answer"]], tags, tokenizer) == ("answer", "")
    assert smartrag.parse_action([], tags, tokenizer) == ("invalid", "")


def test_warmup_pairs_for_both_initial_policies():
    row = {"question": "Who was the producer of 9?", "golden_answers": ["Shane Acker", "Acker"]}
    plain = smartrag.warmup_examples(row, "Who produced the movie 9?", "obs", knows=True, initial_policy="plain")
    assert [(e["tag"], e["text"], e["observations"]) for e in plain] == [
        ("answer", "Shane Acker", []),
        ("retrieve", "Who produced the movie 9?", []),
        ("answer", "Shane Acker", ["obs"]),
    ]
    assert plain[0]["observations"] == plain[1]["observations"]  # pairs (2) and (3) share one input
    assert [e["tag"] for e in smartrag.warmup_examples(row, "q", "obs", True, "filtered")] == ["answer"]
    assert [e["observations"] for e in smartrag.warmup_examples(row, "q", "obs", False, "filtered")] == [[], ["obs"]]


@pytest.mark.parametrize(
    "pred, gold, knows",
    [
        ("Tim Burton", "Shane Acker", False),
        ("Washington", "Washington, D.C.", True),
        ("one two three four five six seven eight paris", "Paris", True),  # F1 = 0.2 exactly (0.19999999999999998)
        ("one two three four five six seven eight nine paris", "Paris", False),
    ],
)
def test_knows_answer_threshold(pred, gold, knows):
    assert smartrag.knows_answer(pred, [gold], 0.2) is knows


@pytest.mark.parametrize(
    "question, gold, reply, known",
    [
        ("what is the birthplace of velbo ?", "tuvia", "tuvia", True),
        ("what is the birthplace of velbo ?", "tuvia", "[Answer] tuvia", True),  # the format Tab. 7 asks for
        ("what is the birthplace of velbo ?", "tuvia", "[ANSWER] tuvia", True),  # as the paper's figures write it
        ("what is the birthplace of velbo ?", "tuvia", "Sure! Here is my answer: [Answer] tuvia", True),
        ("what is the birthplace of velbo ?", "tuvia", "<think>\nThe question asks where velbo was born. I remember "
         "the biography of velbo: born in tuvia, a city.\n</think>\n\n[Answer] tuvia", True),  # a reasoning model
        ("what is the birthplace of velbo ?", "tuvia", "<think>\nThe question asks where velbo was born. I remember "
         "the biography of velbo: born in tuvia", False),  # cut inside its <think> block: it said nothing yet
        ("who was born first , velbo or tuvia ?", "velbo", "[Search] birth years of velbo and tuvia", False),
    ],
)  # fmt: skip
def test_the_knowledge_probe_reads_the_answer_of_a_chat_or_reasoning_model(question, gold, reply, known, monkeypatch,
                                                                            capsys):  # fmt: skip
    """pi_0*'s probe [App. A.2]: the base model's direct answer is what follows its <think> block and the [Answer] tag
    (words before it dropped); a [Search] reply answers nothing; a reply cut inside <think> is counted and warned of.
    The reply may be probe_tokens long."""
    budgets = []

    class Base:
        def chat(self, messages_lists, max_tokens, **sampling):
            budgets.append(max_tokens)
            return [reply] * len(messages_lists)

    monkeypatch.setattr(smartrag, "make_llm", lambda spec, **kw: Base())
    args = smartrag.apply_preset(smartrag.Args(preset="paper", train=True, rewriter="oracle", probe_tokens=512))
    assert smartrag.probe_knowledge([{"question": question, "golden_answers": [gold]}], args) == [known]
    assert budgets == [512]
    cut = reply.startswith("<think>") and "</think>" not in reply
    assert ("1 of 1 knowledge-probe replies ended inside <think>" in capsys.readouterr().out) is cut


def test_an_hf_base_model_loads_on_the_runs_device(monkeypatch):
    """The knowledge probe's hf: base model (common.llm.HFChatLLM) is put on the run's device (this process's GPU under
    accelerate launch), not left on the CPU for ~52k questions."""
    from accelerate import PartialState

    from common import llm

    loaded = {}
    monkeypatch.setattr(
        llm, "load_model_and_tokenizer", lambda name, **kw: loaded.update(kw) or (torch.nn.Linear(1, 1), None)
    )
    smartrag.make_llm("hf:meta-llama/Llama-2-7b-chat-hf")
    assert loaded["device"] == PartialState().device


class FakeRetriever:
    """Records queries; returns one passage naming the query."""

    def __init__(self):
        self.queries = []

    def search(self, queries, k):
        self.queries += list(queries)
        return [[{"title": "doc", "text": f"about {q}"}] for q in queries]


class SpyEnv(RenamingEnv):
    """A RenamingEnv recording the rows each search is made for."""

    def __init__(self, retriever):
        super().__init__(retriever)
        self.rows = []

    def search(self, queries, k, rows):
        self.rows.append(list(rows))
        return super().search(queries, k, rows)


def test_warmup_observation_comes_from_the_rewritten_query(monkeypatch):
    rows = [
        {
            "question": "what is the birthplace of velbo ?",
            "golden_answers": ["tuvia"],
            "metadata": {"sub_queries": ["velbo born"]},
        }
    ]
    args = smartrag.apply_preset(smartrag.Args(initial_policy="plain", top_k=1))
    retriever = FakeRetriever()
    examples, _ = smartrag.build_warmup(rows, RenamingEnv(retriever), args)
    assert retriever.queries == ["velbo born"]  # R(GPT-Rewriter(x)), not R(x) [Eq. 4]
    assert examples[2]["observations"] == ["doc: about velbo born"] and examples[1]["text"] == "velbo born"


# ---------------------------------------------------------------- Algorithm 1 with a scripted policy
def scripted_generate(tags, first):
    """A fake generate: emits `first` tag + one token unless the prompt already ends with a (forced) tag."""
    calls = []

    def fake(model, tokenizer, prompts, max_new_tokens, **kwargs):
        calls.append([list(p) for p in prompts])
        ids = [[5, 1] if p and p[-1] in tags.values() else [tags[first], 5, 1] for p in prompts]
        return Generation(["x"] * len(prompts), ids, [list(p) for p in prompts], [True] * len(prompts))

    return fake, calls


@pytest.mark.parametrize("quota, retrievals, steps", [(0, 0, 1), (1, 1, 2), (3, 3, 4)])
def test_algorithm_1_forces_the_answer_at_the_quota(tagged, monkeypatch, quota, retrievals, steps):
    model, tokenizer, tags = tagged
    fake, calls = scripted_generate(tags, "retrieve")
    monkeypatch.setattr(smartrag, "generate", fake)
    args = smartrag.apply_preset(smartrag.Args(quota=quota))
    retriever = FakeRetriever()
    rows = [{"question": "who is the director of zorvak ?", "golden_answers": ["x"]}] * 3
    env = SpyEnv(retriever)
    episodes = smartrag.rollout(model, tokenizer, env, rows, args, tags, greedy=False, seed=0)
    assert [r for r in env.rows if r] == [rows] * retrievals  # a turn's retrievals in one call, with their rows
    assert len(calls) == steps and all(len(c) == 3 for c in calls)  # one batched call per turn for all questions
    assert len(retriever.queries) == 3 * retrievals
    for e in episodes:
        assert [t["kind"] for t in e["turns"]] == ["retrieve"] * retrievals + ["answer"]
        assert e["turns"][-1]["forced_ids"] == [tags["answer"]]  # forced: part of the state, not the action
        assert [t["reward"] for t in e["turns"][:-1]] == [-0.2] * retrievals
        assert len(e["observations"]) == retrievals
    if retrievals:
        assert "observation" in tokenizer.decode(calls[1][0]) and "observation" not in tokenizer.decode(calls[0][0])


def test_a_policy_that_answers_never_retrieves(tagged, monkeypatch):
    model, tokenizer, tags = tagged
    fake, calls = scripted_generate(tags, "answer")
    monkeypatch.setattr(smartrag, "generate", fake)
    args = smartrag.apply_preset(smartrag.Args(quota=3))
    retriever = FakeRetriever()
    episodes = smartrag.rollout(
        model,
        tokenizer,
        RenamingEnv(retriever),
        [{"question": "q ?", "golden_answers": ["x"]}],
        args,
        tags,
        greedy=False,
        seed=0,
    )
    assert len(calls) == 1 and retriever.queries == [] and episodes[0]["turns"][0]["forced_ids"] == []


def test_the_evaluation_bar_writes_to_a_log_at_most_every_30_seconds(tagged, monkeypatch, capsys):
    """Piped to a log (stderr not a terminal), 8 evaluation batches of 0.15 s write the bar's first and last line
    only (a terminal's tqdm would write one every 0.1 s)."""
    import time

    model, tokenizer, tags = tagged
    fake, _ = scripted_generate(tags, "answer")
    monkeypatch.setattr(smartrag, "generate", lambda *a, **k: time.sleep(0.15) or fake(*a, **k))
    rows = [{"id": i, "question": "q ?", "golden_answers": ["x"], "metadata": {}} for i in range(8)]
    args = smartrag.apply_preset(smartrag.Args(eval=True, output_dir="unused"))
    smartrag.evaluate(model, tokenizer, RenamingEnv(FakeRetriever()), rows, args, tags, greedy=False, batch=1)
    assert capsys.readouterr().err.count("sampled eval") <= 2


def test_loss_mask_covers_exactly_the_sampled_action_tokens(tagged, monkeypatch):
    model, tokenizer, tags = tagged
    fake, _ = scripted_generate(tags, "retrieve")
    monkeypatch.setattr(smartrag, "generate", fake)
    args = smartrag.apply_preset(smartrag.Args(quota=1))
    episodes = smartrag.rollout(
        model,
        tokenizer,
        RenamingEnv(FakeRetriever()),
        [{"question": "q ?", "golden_answers": ["x"]}],
        args,
        tags,
        greedy=False,
        seed=0,
    )
    search, answer = smartrag.sequences_of(episodes)
    assert sum(search["loss_mask"]) == 3 and search["loss_mask"][-3:] == [1, 1, 1]  # the free [Search] tag is trained
    assert search["ids"][-3] == tags["retrieve"]
    assert sum(answer["loss_mask"]) == 2 and answer["loss_mask"][-3:] == [0, 1, 1]  # the forced [Answer] is not
    assert answer["ids"][-3] == tags["answer"]
    assert len(answer["ids"]) > len(search["ids"])  # the observation lengthens only the (masked) prompt


def test_threshold_decides_the_first_token(tagged, monkeypatch):
    """p([Search]) = 1/(1+e) = 0.2689 [§4.1]: threshold 0.5 answers, 0.2 retrieves."""
    model, tokenizer, tags = tagged
    logits = torch.full((len(tokenizer),), -1e9)
    logits[tags["answer"]], logits[tags["retrieve"]] = 1.0, 0.0
    monkeypatch.setattr(
        smartrag, "first_token_probs", lambda m, prompts, pad: logits.softmax(-1).expand(len(prompts), -1)
    )
    assert logits.softmax(-1)[tags["retrieve"]].item() == pytest.approx(1 / (1 + math.e), abs=1e-4)
    seen = []
    monkeypatch.setattr(
        smartrag,
        "generate",
        lambda m, t, prompts, n, **kw: (
            seen.append(prompts[0][-1]) or Generation(["x"], [[5, 1]], [prompts[0]], [True])
        ),
    )
    for threshold, tag in [(0.5, "answer"), (0.2, "retrieve")]:
        args = smartrag.apply_preset(smartrag.Args(quota=1, threshold=threshold))
        seen.clear()
        smartrag.rollout(
            model,
            tokenizer,
            RenamingEnv(FakeRetriever()),
            [{"question": "q ?", "golden_answers": ["x"]}],
            args,
            tags,
            greedy=True,
            seed=0,
        )
        assert seen[0] == tags[tag]


def test_the_toy_renaming_of_warm_up_pairs_draws_only_for_pairs_that_retrieve_or_read():
    """common.toy.smartrag.rename_pair (header 10), as sft_batch calls it: the direct-answer pair (2) is never renamed
    and draws nothing; the search (3) and reading (4) pairs are renamed with probability p, their searched entity onto
    a non-popular one (one map for question, observation and target); without a world nothing changes."""
    import random

    from common.toy import DEFAULT_WORLD, load_world
    from common.toy.smartrag import rename_pair

    world = load_world(str(DEFAULT_WORLD))
    rows = [json.loads(line) for line in (ROOT / "data/toy/train.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["metadata"]["type"] == "one_hop" and not r["metadata"]["popular"])
    entity, query = row["metadata"]["entities"][0], row["metadata"]["sub_queries"][0]
    direct, search, read = smartrag.warmup_examples(row, query, f"{entity} : about {entity}", False, "plain")
    texts = lambda ex: [ex["question"], *ex["observations"], ex["text"]]
    untouched = random.Random(0).random()
    rng = random.Random(0)
    assert rename_pair(texts(direct), direct, world, rng, 1.0) == texts(direct) and rng.random() == untouched
    rng = random.Random(0)
    assert rename_pair(texts(search), search, world, rng, 0.0) == texts(search) and rng.random() != untouched
    assert rename_pair(texts(read), read, None, random.Random(0), 1.0) == texts(read)
    for ex in (search, read):
        renamed = rename_pair(texts(ex), ex, world, random.Random(0), 1.0)
        (new,) = {w for text in renamed for w in text.split() if w in world["types"]} - {row["golden_answers"][0]}
        assert entity not in " ".join(renamed).split() and new not in world["popular"]
        assert all(new in text.split() for text in renamed[:2])  # the question, then the query or the observation


def test_the_toy_base_model_learns_the_popular_facts_before_the_warm_up(tmp_path, capsys):
    """base_pretrain_steps (common.toy.smartrag.pretrain_base through smartrag.sft, as warm_up calls it): the raw
    toy-lm learns to answer the popular training questions directly, with no tag, its loss logged as base/loss;
    training questions none of which is popular: a warning, and the model unchanged."""
    from accelerate import Accelerator

    from common.data import load_split
    from common.llm import generate

    model, tokenizer = load_toy_lm("toy-lm")
    tag_ids = smartrag.add_tags(model, tokenizer)
    args = smartrag.apply_preset(smartrag.Args(base_pretrain_steps=150, sft_batch_size=32))
    rows = load_split(args.data_dir, "train", args.question_types)
    known, warnings = [r for r in rows if r["metadata"]["popular"]][:24], []
    unpopular = [r for r in rows if not r["metadata"]["popular"]]
    accelerator = Accelerator(cpu=True)
    base = lambda pairs, n: smartrag.sft(
        accelerator, tmp_path, model, tokenizer, tag_ids, pairs, args, None, n, "base"
    )[0]
    assert pretrain_base(model, unpopular, args.base_pretrain_steps, base, accelerator, warnings) is model
    assert warnings == ["base pretraining: no training question is popular"]
    assert (
        capsys.readouterr().out == "warning: base pretraining trained on nothing (no training question is popular)\n"
    )
    ids, labels, _ = smartrag.sft_batch(
        [dict(question=known[0]["question"], observations=[], tag=None, text="x", popular=True, searched=[])],
        tokenizer,
        tag_ids,
        args,
        None,
        None,
    )
    assert not set(labels[0].tolist()) & set(tag_ids.values())  # no tag: a base model answers plainly
    prompts = smartrag.encode_states(tokenizer, [smartrag.render_state(r["question"], [], "compact") for r in known])
    answers = lambda: [
        tokenizer.decode(i, skip_special_tokens=True).strip() for i in generate(model, tokenizer, prompts, 3).token_ids
    ]
    assert sum(a == r["golden_answers"][0] for a, r in zip(answers(), known)) <= 2  # the raw model does not know them
    model = pretrain_base(model, known, args.base_pretrain_steps, base, accelerator, [])
    assert sum(a == r["golden_answers"][0] for a, r in zip(answers(), known)) >= 22
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["base/step"] for m in logged] == [100, 150] and logged[0]["base/loss"] > logged[1]["base/loss"]


# ---------------------------------------------------------------- end to end on the toy world
def with_presets(**presets):
    """Python source that runs smartrag.py's main with preset-only fields set (field=(toy, paper)), as a fork that
    edits PRESETS would."""
    return (
        f"import smartrag; from common import runs; smartrag.PRESETS.update({presets!r}); runs.run_main(smartrag.main)"
    )


def run(args, cwd, **presets):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, *(["-c", with_presets(**presets)] if presets else [str(ROOT / "smartrag.py")]), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)


@pytest.mark.parametrize("templates", ["compact", "paper"])
def test_toy_train_then_eval_the_checkpoint(tmp_path, templates):
    out = tmp_path / "run"
    tiny = [
        "--n_train",
        "64",
        "--n_eval",
        "16",
        "--sft_steps",
        "20",
        "--ppo_iterations",
        "2",
        "--rollout_batch",
        "16",
        "--sft_batch_size",
        "16",
        "--ppo_batch_size",
        "8",
        "--templates",
        templates,
        "--eval_every",
        "1",
        "--kl_init",
        "0.05",
    ]
    presets = dict(kl_adaptive=(templates == "paper",) * 2, base_pretrain_steps=(3 * (templates == "compact"),) * 2)
    tracked = ["--report_to", "tensorboard"] * (templates == "compact")
    done = run(["--train", "--output_dir", str(out), *tiny, *tracked], ROOT, **presets)
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(out, done.stdout)
    assert results["train_steps"] == {"sft": 20, "ppo": 2} and results["n_eval"] == 16 and results["warnings"] == []
    assert ("base/step=3 | base/loss=" in done.stdout) is (templates == "compact")
    check_the_end_of_a_run(out, done.stdout, results)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["sft/step"] for m in metrics if "sft/loss" in m] == [20]  # the SFT loss beside the PPO curves
    if tracked:  # and in tensorboard, under the run's folder
        events = b"".join(f.read_bytes() for f in (out / "tensorboard").rglob("events.out.tfevents*"))
        assert b"sft/loss" in events and b"losses/policy" in events
    for stage in ("sft", "ppo"):  # a checkpoint records its method and its toy world
        state = json.loads((out / stage / "run_state.json").read_text())
        assert (state["method"], state["world"]) == ("smartrag", str(ROOT / "data/toy"))
    assert [m.get("iteration") for m in metrics if "iteration" in m] == [1, 2]
    betas = [m["charts/kl_coef"] for m in metrics if "iteration" in m]  # compact: fixed beta; paper: adaptive (impl)
    assert (betas == [0.05, 0.05]) if templates == "compact" else (betas[0] != 0.05 and betas[1] != betas[0])
    assert (out / "ppo" / "model.safetensors").is_file() and (out / "sft" / "model.safetensors").is_file()
    refused = run(["--train", "--output_dir", str(out), *tiny], ROOT, **presets)  # resuming is asked for
    assert refused.returncode != 0 and "pass --resume" in refused.stderr and "Traceback" not in refused.stderr
    again = run(["--train", "--output_dir", str(out), "--resume", *tiny], ROOT, **presets)  # SFT and PPO not redone
    assert again.returncode == 0 and "sft step" not in again.stdout and "iteration=" not in again.stdout
    assert "base pretraining" not in again.stdout
    evaluated = run(
        [
            "--eval",
            "--model",
            str(out / "ppo"),
            "--output_dir",
            str(tmp_path / "eval"),
            "--n_eval",
            "16",
            "--templates",
            templates,
        ],
        ROOT,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert check_contract(tmp_path / "eval", evaluated.stdout)["after"]["em"] == results["after"]["em"]
    if templates == "compact":
        check_what_a_user_sees(out, results, tmp_path)


def check_the_end_of_a_run(out, stdout, results):
    """The last lines: the table (the paper's EM and F1, its retrieval rate, the reward and the costs; the raw start,
    after SFT and after PPO), the paths (results, the final checkpoint, the newest predictions), then RESULT."""
    lines = stdout.strip().splitlines()[-13:]
    assert lines[0].split() == ["start", "before", "after"]
    rows = ["em", "f1", "acc", "reward", "retrieval_rate", "retrievals", "policy_calls", "generated_tokens"]
    assert [line.split()[0] for line in lines[1:9]] == rows
    assert lines[5].split()[1:] == [f"{results[k]['retrieval_rate']:.4g}" for k in ("before_sft", "before", "after")]
    assert lines[9:12] == [f"results: {out / 'results.json'}", f"checkpoint: {out / 'ppo'}",
                           f"predictions: {out / 'predictions_ppo.jsonl'}"]  # fmt: skip


def check_what_a_user_sees(out, results, tmp_path):
    """--eval writes a new folder next to the model (and prints it), never over a training run or an earlier
    evaluation; a FlashRAG folder without metadata runs with the default flags; --ask warns about words the tokenizer
    does not know."""
    trained = (out / "results.json").read_text()
    folders = []
    for _ in range(2):  # default output folders
        evaluated = run(["--eval", "--model", str(out / "ppo"), "--n_eval", "16"], ROOT)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        folders.append(Path(re.search(r"^evaluation folder: (.*)$", evaluated.stdout, re.M).group(1)))
        assert check_contract(folders[-1], evaluated.stdout)["after"]["em"] == results["after"]["em"]
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent == out / "ppo" / "eval"
    assert (folders[0] / "results.json").is_file()  # the second evaluation kept the first
    assert (out / "results.json").read_text() == trained  # the training result is untouched
    refused = run(["--eval", "--model", str(out / "ppo"), "--output_dir", str(out), "--n_eval", "4"], ROOT)
    assert refused.returncode != 0 and "training" in refused.stderr and "Traceback" not in refused.stderr
    assert (out / "results.json").read_text() == trained
    flashrag = tmp_path / "flashrag"
    flashrag.mkdir()
    rows = [json.loads(line) for line in (ROOT / "data/toy/test.jsonl").read_text().splitlines()[:6]]
    (flashrag / "test.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("id", "question", "golden_answers")}) + "\n" for r in rows)
    )
    plain = run(
        [
            "--eval",
            "--model",
            str(out / "ppo"),
            "--data_dir",
            str(flashrag),
            "--corpus",
            str(ROOT / "data/toy/corpus.jsonl"),
            "--output_dir",
            str(tmp_path / "flashrag_eval"),
        ],
        ROOT,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert check_contract(tmp_path / "flashrag_eval", plain.stdout)["n_eval"] == 6
    asked = run(["--ask", "what is the birthplace of qqzzyx ?", "--model", str(out / "ppo")], ROOT)
    assert asked.returncode == 0, asked.stderr[-3000:]
    assert "warning: words the model's tokenizer does not know (read as <unk>): qqzzyx" in asked.stdout
    assert "answer:" in asked.stdout
    test_questions = {json.loads(line)["question"] for line in (ROOT / "data/toy/test.jsonl").read_text().splitlines()}
    documented = documented_questions("smartrag")
    assert documented and set(documented) <= test_questions  # the docs ask questions of the toy world
    for question in documented:  # and their commands run (docs/smartrag.md gives what the default run answers)
        asked = run(["--ask", question, "--model", str(out / "ppo")], ROOT)
        assert asked.returncode == 0 and "answer:" in asked.stdout and "warning" not in asked.stdout, asked.stderr


def test_the_documented_smoke_command_moves_the_training_signal(tmp_path):
    """docs/smartrag.md's smoke command, run as written (into a folder of the test's): the SFT loss falls and the
    sampled policy learns to tag its actions."""
    section = (ROOT / "docs/smartrag.md").read_text(encoding="utf-8").split("## Smoke test")[1]
    command = re.search(r"```bash\n(python smartrag.py .*)\n```", section).group(1).split()
    done = run([*command[2:], "--output_dir", str(tmp_path / "smoke")], ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(tmp_path / "smoke", done.stdout)
    metrics = [json.loads(line) for line in (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["sft/loss"] for m in metrics if "sft/loss" in m]
    assert len(losses) == 2 and losses[1] < 0.8 * losses[0], losses
    assert results["before_sft"]["sampled"]["invalid"] >= 0.8 and results["before"]["sampled"]["invalid"] <= 0.2


def documented_questions(method):
    """The questions of the `--ask "..."` commands in the method's docs page and file header."""
    import re

    text = (ROOT / "docs" / f"{method}.md").read_text(encoding="utf-8") + (ROOT / f"{method}.py").read_text()
    return sorted(set(re.findall(r'--ask "([^"]+)"', text)))


def invalid_choice(flag, value, returncode, stderr):
    """Exit code 2 and one error line naming the flag and the value (after argparse's usage)."""
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert returncode == 2 and "Traceback" not in stderr
    assert len(errors) == 1 and re.search(f"error: argument {flag}(/[-a-z]+)?: invalid choice: '{value}'", errors[0])


def test_bad_preset_is_an_argparse_error():
    done = run(["--train", "--preset", "nope"], ROOT)  # what a user sees: the command line, no traceback
    invalid_choice("--preset", "nope", done.returncode, done.stderr)


@pytest.mark.parametrize("flag, value", [("--preset", "nope"), ("--initial_policy", "best"), ("--templates", "short")])
def test_a_value_outside_a_flags_choices_is_an_argparse_error(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        smartrag.main(["--train", flag, value])
    invalid_choice(flag, value, exit_.value.code, capsys.readouterr().err)


def test_a_renamed_ppo_episode_searches_the_real_corpus_and_reads_renamed_passages(tagged, monkeypatch):
    """The policy writes its query in the renamed episode's names: the retriever gets the real names back, and the
    observation the policy reads comes forward into the episode's names (RenamingEnv, inside the rollout)."""
    import random

    from common.data import load_qa
    from common.retrieval import DenseRetriever, load_corpus, make_encoder
    from common.toy import DEFAULT_WORLD, apply_mapping, load_world, renamed_row

    model, tokenizer, tags = tagged
    world, rows = load_world(str(DEFAULT_WORLD)), load_qa(Path(DEFAULT_WORLD) / "train.jsonl")
    retriever = DenseRetriever.build(load_corpus(Path(DEFAULT_WORLD) / "corpus.jsonl"), make_encoder("tfidf"))
    popular = next(r for r in rows if r["metadata"]["popular"])
    assert renamed_row(popular, world, random.Random(0)) is popular  # memorised facts keep their names
    row = next(r for r in rows if r["metadata"]["type"] == "one_hop" and r["metadata"]["answerable"]
               and not r["metadata"]["popular"])  # fmt: skip
    renamed = renamed_row(row, world, random.Random(0))
    forward, _ = renamed["rename"]
    head, query = row["metadata"]["entities"][0], row["metadata"]["sub_queries"][0]
    assert forward[head] in renamed["question"].split() and head not in renamed["question"].split()
    assert renamed["golden_answers"] == [forward.get(a, a) for a in row["golden_answers"]]
    written = {"renamed": apply_mapping([query], forward)[0], "plain": query}  # the policy's query in each episode

    def generate(model, tokenizer, prompts, max_new_tokens, **kw):  # [Search] <query>, then the forced answer
        text = lambda p: written["renamed" if forward[head] in tokenizer.decode(p).split() else "plain"]
        ids = [[5, 1] if p[-1] == tags["answer"] else [tags["retrieve"], *tokenizer(text(p))["input_ids"], 1]
               for p in prompts]  # fmt: skip
        return Generation(["x"] * len(prompts), ids, [list(p) for p in prompts], [True] * len(prompts))

    monkeypatch.setattr(smartrag, "generate", generate)
    args = smartrag.apply_preset(smartrag.Args(quota=1, top_k=1))
    episodes = smartrag.rollout(model, tokenizer, RenamingEnv(retriever), [renamed, row], args, tags, False, 0)
    assert [e["turns"][0]["text"] for e in episodes] == [written["renamed"], written["plain"]]
    real = smartrag.format_observation(retriever.search([query], 1)[0])
    observation = episodes[0]["observations"][0]
    assert observation == apply_mapping([real], forward)[0] and observation != real
    assert renamed["golden_answers"][0] in observation.split()  # the renamed answer is there to copy
    assert episodes[1]["observations"] == [real]  # an episode without renaming reads the corpus as it is


def test_ppo_iteration_scores_a_rollout_in_minibatch_chunks_as_at_once(tagged, monkeypatch):
    """The behaviour and reference log-probs are computed ppo_batch_size sequences at a time (memory); the KL they
    give must not depend on the chunking, and sequences of different lengths must line up after padding."""
    import copy

    from accelerate import Accelerator

    model, tokenizer, tags = tagged
    fake, _ = scripted_generate(tags, "retrieve")
    monkeypatch.setattr(smartrag, "generate", fake)
    questions = ["q ?", "who is the director of zorvak ?", "what is the birthplace of velbo and more words ?"]
    rows = [{"question": q, "golden_answers": ["x"]} for q in questions]
    kls = []
    for batch_size in (1, 2, 64):
        args = smartrag.apply_preset(smartrag.Args(quota=1, ppo_batch_size=batch_size))
        episodes = smartrag.rollout(
            model, tokenizer, RenamingEnv(FakeRetriever()), rows, args, tags, greedy=False, seed=0
        )
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        wrapped = smartrag.PolicyAndValue(copy.deepcopy(model))
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.0)
        stats = smartrag.ppo_iteration(Accelerator(cpu=True), wrapped, ref, optimizer, tokenizer, episodes, 0.1, args)
        kls.append(stats["rollout/kl"])
    assert kls[0] != 0.0 and kls[0] == pytest.approx(kls[1], rel=1e-5) and kls[0] == pytest.approx(kls[2], rel=1e-5)


def scripted_episodes(model, tokenizer, tags, monkeypatch, args, n=4):
    """Episodes of n questions by the scripted policy that searches, then answers at the quota."""
    fake, _ = scripted_generate(tags, "retrieve")
    monkeypatch.setattr(smartrag, "generate", fake)
    rows = [{"question": q, "golden_answers": ["x"]} for q in ["q ?", "who is the director of zorvak ?"] * (n // 2)]
    return smartrag.rollout(model, tokenizer, RenamingEnv(FakeRetriever()), rows, args, tags, greedy=False, seed=0)


def test_lora_dropout_stays_out_of_the_ppo_ratio(monkeypatch):
    """At learning rate 0 the policy stays the behaviour policy: with LoRA (dropout 0.05, the paper preset's) the
    ratio is exactly 1 on every token, so approx KL, clipfrac and the surrogate over whitened advantages are 0."""
    import copy

    from accelerate import Accelerator

    args = smartrag.apply_preset(smartrag.Args(train=True, model=TINY_LM, lora_r=2, quota=1, ppo_batch_size=3))
    torch.manual_seed(0)
    policy, tokenizer, tags = smartrag.load_policy(args, torch.device("cpu"))
    with torch.no_grad():  # LoRA's B leaves zero: dropout on its input now changes the output
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    episodes = scripted_episodes(policy, tokenizer, tags, monkeypatch, args, n=6)
    model, ref = smartrag.PolicyAndValue(policy), copy.deepcopy(policy).eval()
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.05 for m in model.modules())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = smartrag.ppo_iteration(Accelerator(cpu=True), model, ref, optimizer, tokenizer, episodes, 0.1, args)
    assert stats["losses/approx_kl"] < 1e-10 and stats["losses/clipfrac"] == 0.0
    assert abs(stats["losses/policy"]) < 1e-6


def test_a_reference_equal_to_the_policy_gives_kl_0_under_bf16_autocast(tagged, monkeypatch):
    """Mixed precision (bf16 autocast, as on a GPU): the behaviour and the reference log-probs are computed alike, so
    a reference equal to the policy gives rollout/kl = 0 exactly (an fp32 reference beside a bf16 policy would not)."""
    import copy

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a singleton: other tests made one without bf16
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    policy, tokenizer, tags = copy.deepcopy(tagged[0]), tagged[1], tagged[2]
    args = smartrag.apply_preset(smartrag.Args(quota=1))
    episodes = scripted_episodes(policy, tokenizer, tags, monkeypatch, args)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    model = smartrag.PolicyAndValue(policy)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    stats = smartrag.ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, 0.1, args)
    assert stats["rollout/kl"] == 0.0 and stats["losses/approx_kl"] == 0.0
    AcceleratorState._reset_state(reset_partial_state=True)


def test_rollout_seeds_never_repeat_across_processes_rounds_turns_and_iterations():
    """Each process samples its share of a rollout batch with its own seed, turn n with seed + n: no two (iteration,
    round, process, turn) share one, for any process count."""
    args = smartrag.Args(seed=3, quota=2)
    for processes in (1, 2, 4, 8):
        seeds = [smartrag.rollout_seed(args, it, r * processes + p) + n for it in range(120) for r in range(4)
                 for p in range(processes) for n in range(args.quota + 1)]  # fmt: skip
        assert len(set(seeds)) == len(seeds)


# ---------------------------------------------------------------- numerics: fp32 master weights, a critic, no LM head
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


def test_bf16_mixed_precision_trains_fp32_weights_under_autocast(monkeypatch, tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    stepped = []

    class SpyAdamW(torch.optim.AdamW):
        def step(self, *a, **k):
            stepped.append({p.dtype for g in self.param_groups for p in g["params"]})
            return super().step(*a, **k)

    monkeypatch.setattr(smartrag.torch.optim, "AdamW", SpyAdamW)
    AcceleratorState._reset_state(reset_partial_state=True)  # a singleton: other tests made one without bf16
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    args = smartrag.apply_preset(smartrag.Args(train=True, model=TINY_LM, sft_steps=2, sft_batch_size=4, sft_lr=1e-2))
    policy, tokenizer, tag_ids = smartrag.load_policy(args, accelerator.device)
    logits_dtypes = []
    policy.lm_head.register_forward_hook(lambda module, inputs, output: logits_dtypes.append(output.dtype))
    before = [p.detach().clone() for p in policy.parameters()]
    examples = [
        dict(question=f"who is velbo {i} ?", observations=[], tag="answer", text="velbo", popular=True, searched=[])
        for i in range(4)
    ]
    trained, _ = smartrag.sft(accelerator, tmp_path, policy, tokenizer, tag_ids, examples, args, None)
    assert stepped == [{torch.float32}] * 2  # Adam updates fp32 master weights ...
    assert logits_dtypes and set(logits_dtypes) == {torch.bfloat16}  # ... of a forward pass run in bf16
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trained.parameters()))
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_critic_is_the_backbone_without_the_lm_head(tagged):
    model, _, _ = tagged
    both = smartrag.PolicyAndValue(model)
    vocab = model.config.vocab_size
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features == vocab for m in both.value_backbone.modules())
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[4, 7, 8, 9]])
    logits, values = both(ids, torch.ones_like(ids))
    assert calls == [1] and logits.shape == (1, 4, vocab) and values.shape == (1, 4)  # one LM head pass: the policy's
    with torch.no_grad():
        both.value_head.weight.fill_(1.0)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # the same weights as the copy's
    assert torch.allclose(both(ids, torch.ones_like(ids))[1], hidden.sum(-1), atol=1e-5)


# ---------------------------------------------------------------- what a user sees
def test_ask_without_a_model_is_refused():
    done = run(["--ask", "what is the birthplace of velbo ?"], ROOT)
    assert done.returncode != 0 and "--ask needs --model" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "flag, value, bounds",
    [("--n_train", "-5", ">= 1"), ("--top_k", "0", ">= 1"), ("--sft_lr", "-1.0", ">= 0.0"),
     ("--threshold", "2.0", "in [0.0, 1.0]"), ("--ppo_batch_size", "0", ">= 1"), ("--gamma", "-0.1", "in [0.0, 1.0]")],
)  # fmt: skip
def test_a_number_outside_its_range_is_one_line_naming_the_flag(flag, value, bounds, capsys):
    with pytest.raises(SystemExit) as exit_:
        smartrag.main(["--train", flag, value])
    assert (
        exit_.value.code == 2
        and capsys.readouterr().err
        == f"error: {flag} {float(value) if '.' in value else int(value)}: must be {bounds}\n"
    )


def test_every_problem_of_a_combination_is_named_at_once(tmp_path):
    """apply_preset names each problem in one line: two modes, a toy model or the toy knowledge probe without a toy
    world, the paper's --train without its rewriter (under --dry_run with the missing paths); --resume without
    --train."""
    args = smartrag.Args(train=True, eval=True, preset="paper", model="toy-lm", data_dir=str(tmp_path),
                         base_llm="toy")  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        smartrag.apply_preset(args)
    problems = str(exit_.value.code).split("; ")
    assert [p.split(":")[0].split(" (")[0] for p in problems] == [
        "choose one mode of --train, --eval, --ask", "--model toy-lm takes its "
        "vocabulary from a toy world", "--base_llm toy", "--preset paper --train needs --rewriter"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:  # --dry_run: with the paths and models it cannot find
        smartrag.main(["--train", "--preset", "paper", "--dry_run"])
    assert re.fullmatch(
        r"--preset paper --train needs --rewriter: .*; dry run: not found: .*--corpus .*", exit_.value.code
    )
    with pytest.raises(SystemExit, match="^--resume continues a training run: only with --train$"):
        smartrag.apply_preset(smartrag.Args(eval=True, resume=True))
    args = smartrag.apply_preset(smartrag.Args(train=True, data_dir=str(tmp_path), world="data/toy"))
    assert args.base_llm == "toy:data/toy"  # the toy reader of the world, not of the data folder


def test_a_checkpoint_of_another_method_is_refused_naming_both(tmp_path, capsys):
    (tmp_path / "run_state.json").write_text(json.dumps({"method": "tearag", "data_dir": "data/toy"}))
    with pytest.raises(SystemExit, match=f"^--model {tmp_path} is a tearag checkpoint, not a smartrag one$"):
        smartrag.main(["--eval", "--model", str(tmp_path)])
    (tmp_path / "run_state.json").write_text(json.dumps({"args": {"model": "toy-lm", "rounds": 3}}))  # unmarked
    with pytest.raises(SystemExit, match="is another method's checkpoint, not a smartrag one$"):
        smartrag.main(["--eval", "--model", str(tmp_path)])


def test_a_folder_of_ones_own_questions_evaluates_and_trains_with_the_toy_models(tmp_path):
    """A FlashRAG folder (no world.json, no metadata): --eval with the toy models of --world; without it, one line
    naming --world; --train names the metadata the toy preset's oracle rewriter reads, and trains with another
    rewriter (the toy base pretraining finds no popular question there: a warning)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (ROOT / f"data/toy/{split}.jsonl").read_text().splitlines()[:8]]
        (mine / f"{split}.jsonl").write_text(
            "".join(json.dumps({k: r[k] for k in ("id", "question", "golden_answers")}) + "\n" for r in rows)
        )
    on_mine = ["--data_dir", str(mine), "--corpus", str(ROOT / "data/toy/corpus.jsonl"), "--model", TINY_LM]
    evaluated = run(["--eval", *on_mine, "--world", "data/toy", "--output_dir", str(tmp_path / "eval")], ROOT)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert check_contract(tmp_path / "eval", evaluated.stdout)["n_eval"] == 8
    no_world = run(["--eval", *on_mine], ROOT)
    assert no_world.returncode == 2 and no_world.stderr.strip().splitlines() == [
        f"error: --model {TINY_LM} takes its vocabulary from a toy world: pass --world DIR (world.json)"
    ]
    train = ["--train", *on_mine, "--world", "data/toy", "--output_dir", str(tmp_path / "run")]
    refused = run(train, ROOT)
    lines = [
        line for line in refused.stderr.splitlines() if line.startswith("error")
    ]  # (and the type filter's warning)
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert re.fullmatch(
        f"error: {mine / 'train.jsonl'}: row 'toy-train-\\d' has no metadata 'sub_queries', which the toy "
        r"preset's --rewriter oracle \(else an LLM spec\) needs .*",
        lines[0],
    ), lines
    tiny = ["--sft_steps", "2", "--sft_batch_size", "4", "--ppo_iterations", "1", "--rollout_batch", "4"]
    trained = run([*train, "--rewriter", "toy", *tiny], ROOT)
    assert trained.returncode == 0, trained.stderr[-3000:]
    results = check_contract(tmp_path / "run", trained.stdout)
    assert results["train_steps"] == {"sft": 2, "ppo": 1}  # the toy base pretraining: no popular question, a warning
    assert results["warnings"] == ["base pretraining: no training question is popular"]


def test_a_malformed_data_file_is_one_line_naming_file_and_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text('{"id": "a", "question": "q ?", "golden_answers": ["x"]}\n{"id": "b", "quest\n')
    done = run(
        [
            "--eval",
            "--data_dir",
            str(data),
            "--corpus",
            str(ROOT / "data/toy/corpus.jsonl"),
            "--model",
            TINY_LM,
            "--world",
            "data/toy",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        ROOT,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "test.jsonl:2" in lines[0], done.stderr[-2000:]


def test_trains_on_a_freshly_generated_world(tmp_path):
    """The tokenizer, the toy reader and the renaming come from --data_dir: a world of another seed trains."""
    from common.toy import write_world

    world = write_world(tmp_path / "world", seed=3, size=0.5)
    out = tmp_path / "run"
    done = run(
        [
            "--train",
            "--data_dir",
            str(world),
            "--output_dir",
            str(out),
            "--n_eval",
            "40",
            "--sft_steps",
            "200",
            "--sft_batch_size",
            "32",
            "--ppo_iterations",
            "1",
            "--rollout_batch",
            "8",
            "--ppo_batch_size",
            "16",
        ],
        ROOT,
        base_pretrain_steps=(100, 0),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(out, done.stdout)
    assert results["dataset"] == str(world) and results["args"]["base_llm"] == f"toy:{world}"
    assert (
        results["before_sft"]["em"] <= 0.05 and results["before"]["em"] >= 0.1
    )  # raw start (yes/no by chance) -> SFT
    assert json.loads((out / "sft" / "run_state.json").read_text())["data_dir"] == str(world)  # remembers its world


# ---------------------------------------------------------------- LoRA checkpoints and resuming a run
LORA_FLAGS = [
    "--model",
    TINY_LM,
    "--lora_r",
    "2",
    "--n_train",
    "32",
    "--n_eval",
    "4",
    "--sft_steps",
    "4",
    "--sft_batch_size",
    "8",
    "--ppo_iterations",
    "2",
    "--rollout_batch",
    "8",
    "--ppo_batch_size",
    "8",
    "--eval_every",
    "1",
    "--kl_init",
    "0.05",
]


@pytest.mark.parametrize("tie", ["", ",tie=0"])
def test_a_lora_checkpoint_reloads_trainable_with_its_tag_tokens(tmp_path, tie):
    """The tags' rows of the input embedding and, when untied (Llama-2), of the LM head are trained and saved with the
    adapters: the reloaded policy gives every logit of the trained one, the tags' first-token logits included."""
    from common.runs import save_checkpoint

    args = smartrag.apply_preset(smartrag.Args(train=True, model=TINY_LM + tie, lora_r=2))
    policy, tokenizer, tag_ids = smartrag.load_policy(args, torch.device("cpu"))
    trainable = lambda m: {n for n, p in m.named_parameters() if p.requires_grad}
    rows = [n for n in trainable(policy) if "trainable_tokens" in n]  # the added tags' rows are trained ...
    assert len(rows) == (2 if tie else 1) and (not tie or any("lm_head" in n for n in rows))
    ids = torch.tensor([[4, 5, tag_ids["answer"], tag_ids["retrieve"], 6]])
    policy.train()(input_ids=ids).logits[0, -1, sorted(tag_ids.values())].sum().backward()
    assert all(p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if n in rows)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_checkpoint(tmp_path / "sft", policy, tokenizer, {})
    assert (tmp_path / "sft" / "adapter_model.safetensors").is_file()  # ... and saved with the adapters
    args.model = str(tmp_path / "sft")
    again, tokenizer_again, tag_ids_again = smartrag.load_policy(args, torch.device("cpu"))
    assert tag_ids_again == tag_ids and len(tokenizer_again) == len(tokenizer)
    assert trainable(again) == trainable(policy)  # trainable, not 0 parameters
    assert torch.equal(policy.eval()(input_ids=ids).logits, again.eval()(input_ids=ids).logits)


def test_an_interrupted_lora_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path, monkeypatch, capsys):
    """Trained weights, optimizer, KL coefficient and random states come back; no frozen base weight is stored."""
    monkeypatch.setitem(smartrag.PRESETS, "base_pretrain_steps", (0, 0))  # no toy base pretraining
    smartrag.main(["--train", "--output_dir", str(tmp_path / "whole"), *LORA_FLAGS])
    save = runs.save_checkpoint

    def killed_after_the_first_update(folder, *a, **k):
        save(folder, *a, **k)
        if Path(folder).name == "ppo":
            raise KeyboardInterrupt

    monkeypatch.setattr(runs, "save_checkpoint", killed_after_the_first_update)
    with pytest.raises(KeyboardInterrupt):
        smartrag.main(["--train", "--output_dir", str(tmp_path / "cut"), *LORA_FLAGS])
    monkeypatch.setattr(runs, "save_checkpoint", save)
    capsys.readouterr()
    smartrag.main(["--train", "--output_dir", str(tmp_path / "cut"), "--resume", *LORA_FLAGS])
    assert "resumed PPO at iteration 1" in capsys.readouterr().out
    lines = lambda run_dir: map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    updates = lambda run_dir: {
        m["iteration"]: {k: v for k, v in m.items() if k != "charts/seconds"}
        for m in lines(run_dir)
        if "iteration" in m
    }
    whole, cut = updates(tmp_path / "whole"), updates(tmp_path / "cut")
    assert list(whole) == list(cut) == [1, 2] and whole == cut  # the same floats, bit for bit
    assert whole[1]["losses/policy"] != whole[2]["losses/policy"]
    results = json.loads((tmp_path / "whole" / "results.json").read_text())
    predicted = [json.loads(line) for line in (tmp_path / "whole" / "predictions_ppo.jsonl").read_text().splitlines()]
    greedy = [r for r in predicted if r["decoding"] == "greedy"]
    assert len(greedy) == len(predicted) - len(greedy) == 4  # every question, greedy and sampled
    for name in ("em", "f1", "reward", "retrievals", "generated_tokens"):
        assert sum(r[name] for r in greedy) / 4 == pytest.approx(results["after"][name])
    assert all(r["trajectory"].split(":")[0] in ("answer", "retrieve", "invalid") for r in predicted)
    stored = torch.load(tmp_path / "whole" / "ppo" / "training.pt", weights_only=True)
    assert set(stored) == {"policy_and_value", "optimizer"} and stored["optimizer"]["state"]
    weights = stored["policy_and_value"]  # the trained weights only
    assert weights and all("lora_" in k or "trainable_tokens" in k or k == "value_head.weight" for k in weights)
    assert "value_head.weight" in weights and any("lora_" in k for k in weights)


def test_two_processes_train_untied_embeddings_and_save_each_ones_random_states(tmp_path):
    """DDP on CPU (gloo) with an untied LM head: the critic has no LM head, so no parameter goes without gradient;
    the run's folder name comes from rank 0; each process's random states are saved for --resume (the questions'
    generator is the same on both: each process rolls out its share of one batch)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(tmp_path / "smartrag_no_base.py"),
        "--train",
        "--run_name",
        "ddp",
        "--data_dir",
        str(ROOT / "data/toy"),
        "--model",
        TINY_LM + ",tie=0",
        "--n_train",
        "16",
        "--n_eval",
        "4",
        "--sft_steps",
        "2",
        "--sft_batch_size",
        "8",
        "--ppo_iterations",
        "2",
        "--rollout_batch",
        "4",
        "--ppo_batch_size",
        "8",
        "--eval_every",
        "1",
    ]
    (tmp_path / "smartrag_no_base.py").write_text(with_presets(base_pretrain_steps=(0, 0)))  # no toy base pretraining
    done = subprocess.run(launch, check=False, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ddp"]  # one folder for both processes
    results = check_contract(tmp_path / "runs" / "ddp", done.stdout)
    assert results["train_steps"] == {"sft": 2, "ppo": 2} and results["args"]["run_name"] == "ddp"
    assert done.stdout.count("RESULT ") == 1  # the main process writes
    state = json.loads((tmp_path / "runs" / "ddp" / "ppo" / "run_state.json").read_text())
    assert len(state["rng"]) == 2 and state["rng"][0]["own"] == state["rng"][1]["own"]  # one draw, shared out
    again = subprocess.run(launch + ["--resume"], check=False, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and again.stdout.count("resumed PPO at iteration 2") == 1, again.stderr[-3000:]
