"""C-3PO: worked numbers (K(t), stop rules, Eq. 5 credit on a hand-built tree, GAE, PPO clipping, value
clipping, advantage whitening), the three agents' parsers (malformed outputs included), SFT and PPO loss masks, the
value model, the batched tree rollout with a scripted proxy, the toy and LLM teachers, the LLM judge, and an
end-to-end toy run followed by --eval of its checkpoint."""

import copy
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import check_contract

import c3po
from common import runs
from common.data import DataError
from common.llm import ModelLoadError
from common.toy import RenamingEnv

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- K(t) [Eq. 2] and the stop rules (impl)
def test_branching_factor_schedule():
    assert [c3po.branching(t) for t in range(1, 8)] == [2, 2, 2, 2, 1, 1, 1]
    assert [c3po.branching(t, k=3, until=2) for t in (1, 2, 3)] == [3, 3, 1]


@pytest.mark.parametrize(
    "n_docs, depth, forced",
    [(0, 11, True), (0, 9, False), (11, 5, True), (10, 5, False), (0, 10, False), (0, 13, True)],
)
def test_decision_maker_is_forced_by_depth_or_documents(n_docs, depth, forced):
    assert c3po.dm_forced(n_docs, depth, max_documents=10, max_depth=13) is forced


# ---------------------------------------------------------------- Monte Carlo credit [Eq. 5]
def hand_tree():
    """A hand-built tree of all three strategies: names -> index, nodes in parent-first order."""
    layout = [
        ("root", None, "root"),
        ("RR1", "root", "router"),
        ("L1", "RR1", 0.0),
        ("RR2", "root", "router"),
        ("F1", "RR2", "filter"),
        ("L2", "F1", 1.0),
        ("F2", "RR2", "filter"),
        ("L3", "F2", 0.0),
        ("RR3", "root", "router"),
        ("P", "RR3", "roadmap"),
        ("DM1", "P", "dm"),
        ("L4", "DM1", 0.0),
        ("DM2", "P", "dm"),
        ("F3", "DM2", "filter"),
        ("DM3", "F3", "dm"),
        ("L5", "DM3", 1.0),
        ("F4", "DM2", "filter"),
        ("DM4", "F4", "dm"),
        ("F5", "DM4", "filter"),
        ("DM5", "F5", "dm"),
        ("L6", "DM5", 0.0),
    ]
    index = {name: i for i, (name, _, _) in enumerate(layout)}
    nodes = [
        dict(kind="leaf", reward=k, parent=index[p])
        if isinstance(k, float)
        else dict(kind=k, parent=None if p is None else index[p])
        for _, p, k in layout
    ]
    return nodes, index


def test_credit_is_the_mean_over_reachable_leaves():
    nodes, at = hand_tree()
    credit = c3po.leaf_credits(nodes)
    expected = {
        "RR1": 0.0,
        "RR2": 0.5,
        "F1": 1.0,
        "F2": 0.0,
        "RR3": 1 / 3,
        "DM1": 0.0,
        "DM2": 0.5,
        "F3": 1.0,
        "DM3": 1.0,
        "F4": 0.0,
        "DM4": 0.0,
        "F5": 0.0,
        "DM5": 0.0,
        "root": 1 / 3,
    }
    for name, value in expected.items():
        assert credit[at[name]] == pytest.approx(value), name
    # the mean of the children's means is NOT Eq. 5: RR3's children DM1 (0) and DM2 (0.5) average to 0.25
    assert (credit[at["DM1"]] + credit[at["DM2"]]) / 2 == pytest.approx(0.25) != pytest.approx(credit[at["RR3"]])
    assert credit[at["RR3"]] == pytest.approx((1 * 0.0 + 2 * 0.5) / 3)  # leaf-count-weighted mean of children
    assert sum(n["kind"] in c3po.AGENTS for n in nodes) == 13  # RR 3 + filter 5 + DM 5 samples; roadmap, leaves none


def test_single_trajectory_gives_every_node_the_trajectory_reward():
    nodes, at = hand_tree()
    path = [
        "root",
        "RR3",
        "P",
        "DM2",
        "F4",
        "DM4",
        "F5",
        "DM5",
        "L6",
    ]  # w/o tree (§6.4): DM2's credit would be 0, not 0.5
    keep = {at[n] for n in path}
    remap = {old: new for new, old in enumerate(sorted(keep))}
    single = [
        dict(n, parent=None if n["parent"] is None else remap[n["parent"]]) for i, n in enumerate(nodes) if i in keep
    ]
    assert c3po.leaf_credits(single) == [0.0] * len(single)


# ---------------------------------------------------------------- parsers [§4.1, impl] (and the toy tokenizer)
@pytest.mark.parametrize(
    "text, parsed",
    [
        ("[Retrieval] who wrote Hamlet", ("Retrieval", "who wrote Hamlet")),
        ("[Retrieval]", None),
        ("[Retrieval]   ", None),
        ("[No Retrieval]", ("No Retrieval", "")),
        ("[Planning]", ("Planning", "")),
        ("Retrieval: x", None),
        ("[Search] x", None),
        ("", None),
        ("[ retrieval ] zekil directed", ("Retrieval", "zekil directed")),
        ("[ no retrieval ]", ("No Retrieval", "")),
    ],
)
def test_parse_router(text, parsed):
    assert c3po.parse_router(text) == parsed


def test_router_query_is_truncated_to_100_words():
    action, query = c3po.parse_router("[Retrieval] " + " ".join(f"w{i}" for i in range(150)))
    assert action == "Retrieval" and query.split() == [f"w{i}" for i in range(100)]


@pytest.mark.parametrize(
    "text, strict, parsed",
    [
        ("Thought: d1 ok\nAction: [1, 3]", True, ("d1 ok", [1, 3])),
        ("Thought: x\nAction: [3, 3, 1]", True, ("x", [3, 1])),
        ("Thought: x\nAction: []", True, ("x", [])),
        ("Thought: x\nAction: [7]", True, None),
        ("Thought: x\nAction: [7]", False, ("x", [])),
        ("Thought: x\nAction: [2, 7]", False, ("x", [2])),
        ("Action: [1]", True, None),
        ("Thought: x\nAction: [a]", True, None),
        ("Thought: x\nAction: 1, 2", True, None),
        ("thought : keep 1 , 3 . action : [ 1 , 3 ]", True, ("keep 1 , 3 .", [1, 3])),
        ("thought : x . action : [ 1 ] action : [ 2 ]", True, ("x .", [1])),  # lower case: the first `action : [`
    ],
)
def test_parse_filter(text, strict, parsed):
    assert c3po.parse_filter(text, n_docs=5, strict=strict) == parsed


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("Thought: need director\nAction: [Retrieval] director of X", ("need director", "Retrieval", "director of X")),
        ("Thought: enough\nAction: [LLM]", ("enough", "LLM", "")),
        ("Thought: t\nAction: [Retrieval]", None),
        ("Action: [LLM]", None),
        ("Thought: t\nAction: [Planning]", None),
        ("Thought: t\nAction: LLM", None),
        ("thought : need step 2 . action : [ retrieval ] velbo born", ("need step 2 .", "Retrieval", "velbo born")),
    ],
)
def test_parse_decision_maker(text, parsed):
    assert c3po.parse_dm(text) == parsed


@pytest.mark.parametrize(
    "text, parsed",
    [  # the word "action:" inside a thought, which only the authors' case-sensitive `Action:` passes over
        ("Thought: the next action: find Y's birthplace [1].\nAction: [Retrieval] Y birthplace",
         ("the next action: find Y's birthplace [1].", "Retrieval", "Y birthplace")),
        ("Thought: the transaction: [2] is done.\nAction: [LLM]", ("the transaction: [2] is done.", "LLM", "")),
        ("Thought: a reaction: [1]\nAction: [LLM]", ("a reaction: [1]", "LLM", "")),
        ("thought : the next action : find [ 1 ] . action : [ llm ]", ("the next action : find [ 1 ] .", "LLM", "")),
        ("<think>\nShould I stop? Action: [LLM] is early.\n</think>\n\nThought: need Y.\nAction: [Retrieval] Y born",
         ("need Y.", "Retrieval", "Y born")),
        ("<think>\nThought: enough.\nAction: [LLM]", None),  # the reasoning never ended: no output
    ],
)  # fmt: skip
def test_parse_decision_maker_reads_the_action_line_not_the_word_in_a_thought(text, parsed):
    assert c3po.parse_dm(text) == parsed


def test_parsers_read_the_output_after_a_think_block():
    """A reasoning model's <think> block names other actions first: the router and the filter read what follows."""
    think = "<think>\nCould the LLM answer alone, [No Retrieval]? Or keep [1, 2, 3]? No.\n</think>\n\n"
    assert c3po.parse_router(think + "[Retrieval] who directed zekil") == ("Retrieval", "who directed zekil")
    assert c3po.parse_router(think + "[Planning]") == ("Planning", "")
    assert c3po.parse_router("<think>\n[No Retrieval] would do") is None
    assert c3po.parse_filter(think + "Thought: only 2 names it.\nAction: [2]", 3) == ("only 2 names it.", [2])
    assert c3po.parse_router("...</think>\n[No Retrieval]") == ("No Retrieval", "")  # a template opened the block
    assert c3po.visible("plain [Planning]") == "plain [Planning]"


def test_templates_and_documents():
    docs = [{"title": "Hamlet", "text": "A play."}, {"title": "Macbeth", "text": "Another."}]
    assert (
        c3po.format_documents(docs) == "Document 1 (Title: Hamlet): A play.\n\nDocument 2 (Title: Macbeth): Another."
    )
    paper = c3po.TEMPLATES["paper"]
    assert paper["router"].endswith("Question: {question}") and "[Retrieval] `YOUR QUERY HERE`" in paper["router"]
    assert (
        "Current step's objectives: {objective}" in paper["filter_plan"]
        and "{objective}" not in paper["filter_direct"]
    )
    assert (
        "Plan: {roadmap}" in paper["dm"]
        and "Action: [LLM]" in paper["dm_llm"]
        and "[Retrieval]" not in paper["dm_llm"]
    )
    assert paper["roadmap"].startswith("You are an expert assistant tasked with analyzing the following question")
    for name in ("answer", "answer_no_docs"):  # the roadmap is never passed to the answer [Alg. 1 L18]
        assert "{roadmap}" not in paper[name] and "{roadmap}" not in c3po.TEMPLATES["compact"][name]
    assert set(paper) == set(c3po.TEMPLATES["compact"])
    assert c3po.placeholder("q1") == {"title": "q1", "text": "None relevant information about q1"}


def test_llm_prompt_is_the_roadmap_or_the_answer_prompt():
    tpl, docs = c3po.TEMPLATES["compact"], [{"title": "zekil", "text": "zekil is a film directed by mipon ."}]
    assert c3po.llm_prompt(tpl, "q ?", ("roadmap",)) == "write a plan . question : q ?"
    assert c3po.llm_prompt(tpl, "q ?", ("answer", [])) == "answer the question . question : q ?"
    assert c3po.llm_prompt(tpl, "q ?", ("answer", docs)) == (
        "answer the question using the documents . documents : Document 1 (Title: zekil): zekil is a film directed by "
        "mipon . question : q ?"
    )


CTX = dict(acc=[], used={}, roadmap="", objective="", docs=[], query="", strategy="", forced=False)
DOCS = [{"title": "zekil", "text": "a"}, {"title": "zekel", "text": "b"}, {"title": "mipon", "text": "c"}]


@pytest.mark.parametrize(
    "text, event, strategy",
    [("[No Retrieval]", ("answer", []), "No Retrieval"), ("[Retrieval] zekil directed", ("search", "zekil directed"),
     "Retrieval"), ("[Planning]", ("roadmap",), "Planning"), ("Retrieval: x", ("invalid",), "")],
)  # fmt: skip
def test_transition_of_the_router(text, event, strategy):
    got, ctx = c3po.transition("router", text, CTX, True, 100)
    assert got == event and ctx["strategy"] == strategy


def test_transition_of_the_filter_answers_under_retrieval_and_accumulates_under_planning():
    ctx = dict(CTX, docs=DOCS, query="zekil directed", strategy="Retrieval")
    assert c3po.transition("filter", "Thought: t\nAction: [3, 1]", ctx, True, 100)[0] == ("answer", [DOCS[2], DOCS[0]])
    assert c3po.transition("filter", "Thought: t\nAction: []", ctx, True, 100)[0] == (
        "answer", [c3po.placeholder("zekil directed")])  # fmt: skip
    assert c3po.transition("filter", "Thought: t\nAction: [4]", ctx, True, 100)[0] == ("invalid",)  # training
    assert c3po.transition("filter", "Thought: t\nAction: [4]", ctx, False, 100)[0] == (
        "answer", [c3po.placeholder("zekil directed")])  # fmt: skip  # at test the id is dropped
    planning = dict(ctx, strategy="Planning", acc=[DOCS[0]], used={"mipon born": 1})
    event, after = c3po.transition("filter", "Thought: t\nAction: [1, 3]", planning, True, 100)
    assert event == ("decide",) and after["acc"] == [DOCS[0], DOCS[2]]  # no document twice
    assert after["used"] == {"mipon born": 1, "zekil directed": 1}
    assert planning["acc"] == [DOCS[0]] and planning["used"] == {"mipon born": 1}  # the parent's state is unchanged
    event, empty = c3po.transition("filter", "Thought: t\nAction: []", planning, True, 100)
    assert empty["acc"] == [DOCS[0], c3po.placeholder("zekil directed")]
    event, later = c3po.transition("filter", "Thought: t\nAction: [2]", empty, True, 100)  # the same query again
    assert later["acc"] == [DOCS[0], DOCS[1]] and later["used"]["zekil directed"] == 2  # the placeholder goes


def test_transition_of_the_decision_maker():
    ctx = dict(CTX, acc=[DOCS[0]], strategy="Planning", objective="old")
    event, after = c3po.transition("dm", "Thought: find the director\nAction: [Retrieval] a b c d", ctx, True, 2)
    assert event == ("search", "a b") and after["objective"] == "find the director"  # the filter's next objective
    assert c3po.transition("dm", "Thought: enough\nAction: [LLM]", ctx, True, 100)[0] == ("answer", [DOCS[0]])
    assert c3po.transition("dm", "Action: [LLM]", ctx, True, 100)[0] == ("invalid",)
    forced = dict(ctx, forced=True)  # a forced stop answers whatever was written
    assert c3po.transition("dm", "gibberish", forced, True, 100)[0] == ("answer", [DOCS[0]])


def test_the_toy_oracle_writes_what_the_agents_parse():
    from common.toy.c3po import oracle_c3po

    meta = dict(type="two_hop", hops=2, entities=["zekil", "mipon", "tuvia"], popular=False,
                popular_hops=[False, False], sub_queries=["zekil directed", "mipon born"])  # fmt: skip
    row, rng = {"question": "q ?", "golden_answers": ["tuvia"], "metadata": meta}, random.Random(0)
    for noise in (0.0, 1.0):
        ctx = dict(CTX, docs=DOCS, query="zekil directed", strategy="Planning")
        assert c3po.transition("router", oracle_c3po(row, "router", ctx, "", rng, noise), ctx, True, 100)[0] == (
            "roadmap",)  # fmt: skip
        query = "[Retrieval]" + oracle_c3po(row, "router", ctx, "[Retrieval]", rng, noise)
        assert c3po.transition("router", query, ctx, True, 100)[0] == ("search", "zekil directed")
        event, ctx = c3po.transition("filter", oracle_c3po(row, "filter", ctx, "", rng, noise), ctx, True, 100)
        assert event == ("decide",) and ctx["acc"] == ([DOCS[0], DOCS[2]] if noise == 0 else DOCS)
        event, _ = c3po.transition(
            "dm", oracle_c3po(row, "dm", dict(ctx, acc=[DOCS[0]]), "", rng, noise), ctx, True, 100
        )
        assert event == (("search", "mipon born") if noise == 0 else ("answer", ctx["acc"]))


@pytest.mark.parametrize("style", ["paper", "think"])
def test_the_toy_oracle_in_the_paper_formats_leads_to_the_events_of_the_compact_one(style):
    """The oracle as the paper's figures show the agents writing (a thought per document, the plan's step in the
    Decision Maker's thought) and after a <think> block: the same transitions as its compact outputs."""
    from common.toy.c3po import oracle_c3po

    meta = dict(type="two_hop", hops=2, entities=["zekil", "mipon", "tuvia"], popular=False, relations=["directed_by",
                "born_in"], popular_hops=[False, False], sub_queries=["zekil directed", "mipon born"])  # fmt: skip
    row = {"question": "q ?", "golden_answers": ["tuvia"], "metadata": meta}
    states = [("router", dict(CTX)), ("filter", dict(CTX, docs=DOCS, query="zekil directed", strategy="Planning")),
              ("dm", dict(CTX, strategy="Planning")), ("dm", dict(CTX, acc=[DOCS[0]], strategy="Planning")),
              ("dm", dict(CTX, acc=[DOCS[0], DOCS[2]], strategy="Planning"))]  # fmt: skip
    for agent, ctx in states:
        compact = oracle_c3po(row, agent, ctx, "", random.Random(0), 0.0)
        paper = oracle_c3po(row, agent, ctx, "", random.Random(0), 0.0, style)
        assert (paper != compact or agent == "router") and paper.startswith("<think>") == (style == "think")
        assert c3po.transition(agent, paper, ctx, True, 100)[0] == c3po.transition(agent, compact, ctx, True, 100)[0]
    dm = oracle_c3po(row, "dm", dict(CTX, acc=[DOCS[0]]), "", random.Random(0), 0.0, "paper")
    assert dm.endswith("the next action: find the birthplace of mipon [step 2].\nAction: [Retrieval] mipon born")
    assert oracle_c3po(row, "router", CTX, "[Retrieval]", random.Random(0), 0.0, style) == " zekil directed"


# ---------------------------------------------------------------- GAE, KL in the reward, PPO clipping [App. A.1]
def test_gae_within_a_node():
    adv, ret = c3po.gae([0, 0, 1], [0.2, 0.4, 0.5], 1.0, 0.95)
    assert adv == pytest.approx([0.74625, 0.575, 0.5]) and ret == pytest.approx([0.94625, 0.975, 1.0])
    adv, ret = c3po.gae(c3po.token_rewards(0.5, [0, 0, 0], [0, 0, 0], 0.005), [0.3] * 3, 1.0, 0.95)
    assert adv == pytest.approx([0.1805, 0.19, 0.2]) and ret == pytest.approx([0.4805, 0.49, 0.5])


def test_kl_penalty_enters_the_token_rewards():
    rewards = c3po.token_rewards(1.0, [0.1, -0.2, 0.05], [0.0, 0.0, 0.0], 0.005)
    assert rewards == pytest.approx([-0.0005, 0.001, 0.99975])
    adv, ret = c3po.gae(rewards, [0.2, 0.4, 0.5], 1.0, 0.95)
    assert adv == pytest.approx([0.746474375, 0.5757625, 0.49975]) and ret == pytest.approx(
        [0.946474375, 0.9757625, 0.99975]
    )


@pytest.mark.parametrize(
    "ratio, advantage, loss", [(1.3, 0.5, -0.6), (0.7, -1.0, 0.8), (1.0, 0.7, -0.7), (1.0, -0.3, 0.3)]
)
def test_clipped_surrogate(ratio, advantage, loss):
    one = torch.ones(1, 1)
    pg, r = c3po.clipped_surrogate(torch.log(one * ratio), 0 * one, advantage * one, one, 0.2)
    assert pg.item() == pytest.approx(loss, abs=1e-6) and r.item() == pytest.approx(ratio)


def test_no_gradient_beyond_the_clip_and_masked_tokens_ignored():
    new = torch.log(torch.tensor([[1.3, 1.1]])).requires_grad_()
    pg, _ = c3po.clipped_surrogate(new, torch.zeros(1, 2), torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 1.0]]), 0.2)
    pg.backward()
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 1].item() == pytest.approx(-0.5 * 1.1 / 2)
    pg, _ = c3po.clipped_surrogate(
        torch.tensor([[0.0, 5.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 99.0]]), torch.tensor([[1.0, 0.0]]), 0.2
    )
    assert pg.item() == pytest.approx(-1.0)


def test_forced_tokens_can_be_down_weighted_in_the_surrogate():
    """Forced root tokens count in the token mean but their term is scaled by --forced_weight (header 15)."""
    new_logp, old_logp = torch.zeros(1, 3), torch.zeros(1, 3)  # ratio 1: the surrogate is A per token
    advantages, mask = torch.tensor([[2.0, -1.0, 4.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    full, _ = c3po.clipped_surrogate(new_logp, old_logp, advantages, mask, 0.2)
    weighted, _ = c3po.clipped_surrogate(new_logp, old_logp, advantages, mask, 0.2, torch.tensor([[0.1, 1.0, 1.0]]))
    assert full.item() == pytest.approx(-(2.0 - 1.0) / 2) and weighted.item() == pytest.approx(-(0.2 - 1.0) / 2)


def test_node_samples_count_the_forced_root_tokens():
    nodes = [
        dict(kind="root", parent=None),
        dict(kind="router", parent=0, prompt_ids=[5], action_ids=[7, 8, 1], fixed="[Planning]", prefix=""),
        dict(kind="router", parent=0, prompt_ids=[5], action_ids=[7, 9, 6, 6, 1], fixed=None, prefix="[Retrieval]"),
        dict(kind="filter", parent=2, prompt_ids=[5], action_ids=[4, 1], fixed=None, prefix=""),
        dict(kind="leaf", parent=1, reward=1.0),
        dict(kind="leaf", parent=3, reward=0.0),
    ]
    count = lambda text: {"[Retrieval]": 2}[text]  # a stand-in tokenizer: the forced prefix is 2 tokens
    assert [s["forced"] for s in c3po.node_samples([{"nodes": nodes}], count)] == [3, 2, 0]
    assert [s["forced"] for s in c3po.node_samples([{"nodes": nodes}])] == [3, 0, 0]  # no tokenizer: prefix unknown


def test_value_loss_clips_around_the_old_values():
    """OpenRLHF's value clipping (header 5), eps 0.2, by hand; the fifth token is masked out."""
    values = torch.tensor([[1.0, 0.6, 1.0, 1.0, 9.0]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.0]]), torch.tensor([[1.2, 0.0, 0.9, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # V_clip = 0.7, 0.6, 0.7, 0.7; max((V_clip - G)^2, (V - G)^2) =
    #   max(.25, .04), max(.36, .36), max(.04, .01), max(.49, 1)
    loss = c3po.value_loss(values, old, ret, mask, 0.2)
    assert loss.item() == pytest.approx((0.25 + 0.36 + 0.04 + 1.0) / 4)
    loss.backward()  # no gradient where the clipped (saturated) term is the larger one
    assert values.grad.tolist()[0] == pytest.approx([0.0, 2 * 0.6 / 4, 0.0, 2 * 1.0 / 4, 0.0])
    assert c3po.value_loss(values, old, ret, mask, 0.0).item() == pytest.approx(
        (0.04 + 0.36 + 0.01 + 1.0) / 4
    )  # Eq. 10


TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


def test_value_model_is_a_copy_of_the_policy_with_a_zero_scalar_head():
    from common.llm import right_pad
    from common.toy.lm import load_toy_lm

    model, _ = load_toy_lm(TINY_LM)
    value = c3po.ValueModel(model)
    ids, attention = right_pad([[4, 7, 8, 9], [4, 7]], 0), right_pad([[1] * 4, [1] * 2], 0)
    assert torch.equal(value(ids, attention), torch.zeros(2, 4))  # (B, T), zero at the start of PPO
    assert value.head.weight.shape == (1, 32) and value.head.bias is None
    with torch.no_grad():
        value.head.weight.fill_(1.0)  # then V(s_t) = the sum of the last hidden state at t
    hidden = model(input_ids=ids, attention_mask=attention, output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(value(ids, attention), hidden.sum(-1), atol=1e-5)
    with torch.no_grad():
        next(value.backbone.parameters()).add_(1.0)  # a copy: training the critic leaves the policy alone
    assert not torch.equal(next(value.backbone.parameters()), next(model.parameters()))


@pytest.mark.parametrize("value_clip, value_loss", [(0.2, (1.0 + 0.09 + 0.25) / 3), (0.0, (1.0 + 0.0 + 0.04) / 3)])
def test_ppo_update_whitens_advantages_over_the_rollout(monkeypatch, value_clip, value_loss):
    """Advantages 1, 2 | 3 (two nodes) whiten over the rollout to -1, 0 | 1 (mean 2, std 1), not per node; the critic
    starts at V = 0, so its clipped loss follows from the stored old values by hand."""
    from accelerate import Accelerator

    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    samples = [
        dict(ids=[4, 7, 8], loss_mask=[0, 1, 1], credit=1.0, agent="router", forced=0),
        dict(ids=[4, 9], loss_mask=[0, 1], credit=0.0, agent="dm", forced=0),
    ]  # as node_samples makes them
    hand = [dict(adv=[1.0, 2.0], ret=[1.0, 0.0], val=[0.5, 0.5]), dict(adv=[3.0], ret=[0.2], val=[-0.5])]
    score, surrogate, seen = c3po.score_samples, c3po.clipped_surrogate, []

    def fake_score(*a):
        score(*a)  # the real old and reference log-probs, then hand-set advantages, returns and old values
        for sample, h in zip(samples, hand):
            sample.update(h)

    def spy(new, old, adv, mask, clip, weights=None):
        seen.append(adv[mask.bool()].tolist())
        return surrogate(new, old, adv, mask, clip, weights)

    monkeypatch.setattr(c3po, "score_samples", fake_score)
    monkeypatch.setattr(c3po, "clipped_surrogate", spy)
    args = args_for(micro_batch_size=4, ppo_batch_size=8, value_clip=value_clip, ppo_epochs=1)  # one pass: by hand
    ref, value = copy.deepcopy(model), c3po.ValueModel(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, value)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
    pad = tokenizer.pad_token_id
    stats = c3po.ppo_update(Accelerator(cpu=True), model, value, ref, optimizers, schedulers, samples, pad, args)
    assert len(seen) == 1 and sorted(seen[0]) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert stats["losses/policy"] == pytest.approx(0.0, abs=1e-6)  # ratio 1 and whitened advantages of mean 0
    assert stats["losses/value"] == pytest.approx(value_loss, abs=1e-6) and stats["losses/clipfrac"] == 0.0


class OneOfTwoProcesses:
    """What ppo_update asks of an Accelerator, for process 0 of two whose other process holds two node samples (as
    a gather reads it) and sums like this one (as a global sum reads it)."""

    num_processes, process_index, device = 2, 0, torch.device("cpu")

    def reduce(self, tensor, reduction):
        return tensor * 2

    def gather(self, tensor):
        return torch.cat([tensor, torch.tensor([2])])

    def unwrap_model(self, model):
        return model

    def no_sync(self, model):
        import contextlib

        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm_(self, parameters, norm):
        return torch.nn.utils.clip_grad_norm_(parameters, norm)


def test_ppo_micro_batches_hold_micro_batch_size_sequences_whatever_another_process_holds(monkeypatch):
    """Each process runs as many micro-batches of --micro_batch_size as its own share needs (DDP all-reduces once per
    minibatch: runs.micro_backward), never fewer and fuller ones because another process holds fewer samples."""
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    samples = [
        dict(ids=[4, 7 + i, 8, 9], loss_mask=[0, 1, 1, 1], credit=i % 2, agent="dm", forced=0) for i in range(10)
    ]
    widths, token_logp = [], c3po.token_logp
    monkeypatch.setattr(c3po, "token_logp", lambda m, ids, att: widths.append(len(ids)) or token_logp(m, ids, att))
    value = c3po.ValueModel(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, value)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
    args = args_for(micro_batch_size=4, ppo_batch_size=1024, ppo_epochs=1)
    ref = copy.deepcopy(model)
    c3po.ppo_update(
        OneOfTwoProcesses(), model, value, ref, optimizers, schedulers, samples, tokenizer.pad_token_id, args
    )
    assert widths == [4, 4, 4, 4, 2, 2] + [4, 4, 2]  # scoring: policy and reference per chunk; then the update


def test_node_samples_mask_exactly_the_action_tokens():
    nodes = [
        dict(kind="root", parent=None),
        dict(kind="router", parent=0, prompt_ids=[5, 6, 7], action_ids=[8, 1]),
        dict(kind="roadmap", parent=1),
        dict(kind="dm", parent=2, prompt_ids=[5], action_ids=[9, 9, 1]),
        dict(kind="leaf", parent=3, reward=1.0),
        dict(kind="dm", parent=2, prompt_ids=[5], action_ids=[4, 1]),
        dict(kind="leaf", parent=5, reward=0.0),
    ]
    samples = c3po.node_samples([{"nodes": nodes}])
    assert [(s["agent"], s["ids"], s["loss_mask"], s["credit"]) for s in samples] == [
        ("router", [5, 6, 7, 8, 1], [0, 0, 0, 1, 1], 0.5),
        ("dm", [5, 9, 9, 1], [0, 1, 1, 1], 1.0),
        ("dm", [5, 4, 1], [0, 1, 1], 0.0),
    ]
    ids, attention, mask = c3po.batch_tensors(samples, pad=0, device="cpu")
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]  # shifted with the labels, padding 0
    assert attention.tolist()[2] == [1, 1, 1, 0, 0]


# ---------------------------------------------------------------- the batched tree rollout with a scripted proxy
class FakeRetriever:
    def __init__(self):
        self.calls = []

    def search(self, queries, k):
        self.calls.append((list(queries), k))
        return [[{"id": f"{q}-{i}", "title": q, "text": f"{q} passage {i}"} for i in range(k)] for q in queries]


class FakeLLM:
    def __init__(self):
        self.calls = []

    def chat(self, messages_lists, **kw):
        prompts = [m[-1]["content"] for m in messages_lists]
        self.calls.append(prompts)
        return ["step 1 : find it ." if p.startswith("write a plan") else "gold" for p in prompts]


def scripted(dm_text="Thought: t\nAction: [Retrieval] sub", filter_text="Thought: t\nAction: [1]", router_text=None):
    """A fake proxy actor recording each call's requests; fixed texts are returned as they are."""
    calls = []

    def act(requests, seed):
        calls.append(requests)
        out = []
        for r in requests:
            router = router_text or r.prefix + " q"
            text = r.fixed or {"router": router, "filter": filter_text, "dm": dm_text}[r.agent]
            out.append([(text, [3], [4, 1])] * (1 if r.fixed else r.n))
        return out

    return act, calls


def args_for(**kw):
    return c3po.apply_preset(c3po.Args(**{"top_k": 2, "max_documents": 10, **kw}))


ROWS = [{"question": f"question {i} ?", "golden_answers": ["gold"], "metadata": {}} for i in range(3)]


def env():
    """The scripted frozen retriever and LLM as the rollout sees them (rows without renaming pass through)."""
    return RenamingEnv(FakeRetriever(), FakeLLM())


def test_forced_top_and_one_proxy_call_per_level_for_all_trees():
    act, calls = scripted(dm_text="Thought: t\nAction: [LLM]")
    llm, retriever = FakeLLM(), FakeRetriever()
    trees = c3po.rollout(ROWS, act, RenamingEnv(retriever, llm), args_for(), "tree")
    for tree in trees:
        routers = [n for n in tree["nodes"] if n["kind"] == "router"]
        assert sorted(n["strategy"] for n in routers) == ["No Retrieval", "Planning", "Retrieval"]
        leaves = sorted((n["depth"], n["reward"]) for n in tree["nodes"] if n["kind"] == "leaf")
        assert leaves == [(3, 1.0), (4, 1.0), (5, 1.0)]  # No Retrieval 3, single-pass 4, planning with 0 loops 5
    assert len(calls) == 2 and len(calls[0]) == 9  # level 1: 3 routers x 3 trees; level 2: filters and DMs together
    assert sorted(r.agent for r in calls[1]) == ["dm"] * 3 + ["filter"] * 3
    assert all(r.n == 2 for r in calls[1])  # K(2) = K(3) = 2 (identical outputs deduplicated)
    assert len(retriever.calls) == 1 and len(retriever.calls[0][0]) == 3  # one retriever call per level
    assert [len(c) for c in llm.calls] == [3, 3, 6]  # level 1: roadmaps, then answers; level 2: answers


@pytest.mark.parametrize("mode", ["single_trajectory", "single"])  # the --credit_mode value, and any mode but "tree"
@pytest.mark.parametrize("answer, reward", [("gold", 1.0), ("wrong", 0.0)])
def test_single_trajectory_rollout_is_one_free_path_whose_reward_every_node_gets(answer, reward, mode):
    """The w/o-tree ablation (§6.4): the router is sampled, not forced, K = 1 everywhere, one leaf per question."""
    act, calls = scripted(dm_text="Thought: t\nAction: [Retrieval] sub", router_text="[Planning]")
    llm = FakeLLM()
    llm.chat = lambda msgs, **kw: [
        "step 1 : find it ." if m[-1]["content"].startswith("write a plan") else answer for m in msgs
    ]
    trees = c3po.rollout(ROWS, act, RenamingEnv(FakeRetriever(), llm), args_for(credit_mode="single_trajectory"), mode)
    assert all(r.fixed is None and r.prefix == "" and r.n == 1 for c in calls for r in c)
    for tree in trees:
        kinds = [n["kind"] for n in tree["nodes"]]
        assert kinds.count("router") == 1 and kinds.count("leaf") == 1
        assert [n["strategy"] for n in tree["nodes"] if n["kind"] == "router"] == ["Planning"]
        assert kinds.count("dm") == 5 and kinds.count("filter") == 4  # 4 retrieval loops, then the forced [LLM]
    samples = c3po.node_samples(trees)
    assert len(samples) == 3 * 10 and {s["credit"] for s in samples} == {reward}


def test_proxy_actor_forces_root_texts_and_prefix(monkeypatch):
    from common.llm import Generation
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64")
    seen = []
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]

    def fake(model, tokenizer, prompts, max_new_tokens, **kw):
        seen.extend(prompts)
        return Generation(
            ["x"] * len(prompts), [encode("capital city") + [1]] * len(prompts), prompts, [True] * len(prompts)
        )

    monkeypatch.setattr(c3po, "generate", fake)
    args = args_for(system_prompt="")
    act = c3po.proxy_actor(model, tokenizer, args, greedy=False)
    tree = {"row": ROWS[0]}
    out = act(c3po.router_requests(tree, "tree", args), seed=0)
    assert [o[0][0] for o in out] == ["[No Retrieval]", "[ retrieval ] capital city", "[Planning]"]
    assert len(seen) == 1 and seen[0][-3:] == encode("[Retrieval]")  # one generate call; the prefix is in the prompt
    assert out[1][0][2] == encode("[Retrieval] capital city") + [1]  # the action includes the forced prefix
    assert out[0][0][2] == encode("[No Retrieval]") + [tokenizer.eos_token_id]
    assert tokenizer.decode(out[0][0][1]).endswith("<assistant>")  # chat-templated prompt


def test_proxy_prompts_over_the_prompt_max_len_lose_their_middle_and_ppo_scores_what_was_read(monkeypatch):
    """[Tab. 7] prompt max len: a longer agent prompt keeps its first and last tokens (instruction, question and the
    assistant turn); the node stores the ids generate read (cut once more if the model's context asks), so that PPO
    scores the context the action was sampled in."""
    from common.llm import Generation
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    fed, cut_more = [], {"on": False}

    def fake(model, tokenizer, prompts, max_new_tokens, **kw):
        read = [p[:3] + p[-5:] if cut_more["on"] else p for p in prompts]  # as fit_context cuts to the context
        fed.extend(read)
        return Generation(["x"] * len(prompts), [[7, 1]] * len(prompts), read, [True] * len(prompts))

    monkeypatch.setattr(c3po, "generate", fake)
    args = args_for(system_prompt="", prompt_max_len=12)
    prompt = "filter documents . question : " + " ".join(["zekil"] * 40) + " ?"
    full = c3po.encode_prompts(tokenizer, [prompt], "")[0]
    act = c3po.proxy_actor(model, tokenizer, args, greedy=True)
    requests = [c3po.Request({"row": ROWS[0]}, 0, "filter", 2, prompt, CTX, 1),
                c3po.Request({"row": ROWS[0]}, 0, "router", 1, prompt, CTX, 1, prefix="[Retrieval]"),
                c3po.Request({"row": ROWS[0]}, 0, "router", 1, prompt, CTX, 1, fixed="[Planning]")]  # fmt: skip
    (free,), (prefixed,), (fixed,) = act(requests, 0)
    prefix = tokenizer("[Retrieval]", add_special_tokens=False)["input_ids"]
    assert len(full) > 40 and free[1] == full[:6] + full[-6:] == fixed[1] == prefixed[1]  # instruction ... <assistant>
    assert fed == [free[1], free[1] + prefix] and prefixed[2] == prefix + [7, 1]
    cut_more["on"] = True
    (free,), (prefixed,), _ = act(requests, 0)
    assert free[1] == fed[2] and prefixed[1] + prefix == fed[3] and len(free[1]) == 8  # what generate read


def test_sft_pairs_over_the_cutoff_len_lose_the_middle_of_their_prompt():
    """[Tab. 6] cutoff length: prompt + output + EOS fit --cutoff_len; the output whole, the prompt keeps its ends."""
    from common.toy.lm import load_toy_lm

    _, tokenizer = load_toy_lm(TINY_LM)
    prompt, output = "filter documents . question : " + " ".join(["zekil"] * 40) + " ?", "thought : t . action : [ 1 ]"
    full = c3po.encode_prompts(tokenizer, [prompt], "")[0]
    target = tokenizer(output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids, labels, _ = c3po.sft_batch([(prompt, output)], tokenizer, args_for(system_prompt="", cutoff_len=24))
    room = 24 - len(target)
    assert ids[0].tolist() == full[: room // 2] + full[len(full) - (room - room // 2) :] + target and len(full) > 40
    assert labels[0].tolist() == [-100] * room + target
    ids, _, _ = c3po.sft_batch([(prompt, output)], tokenizer, args_for(system_prompt=""))  # 4096: whole
    assert ids[0].tolist() == full + target


def planning_act(filter_texts=("Thought: t\nAction: [1]",), dm_text="Thought: t\nAction: [Retrieval] sub"):
    """Router always plans, DM always retrieves `sub`, the filter cycles through filter_texts."""
    calls, count = [], [0]

    def act(requests, seed):
        calls.append(requests)
        out = []
        for r in requests:
            if r.agent == "filter":
                text = filter_texts[count[0] % len(filter_texts)]
                count[0] += 1
            else:
                text = {"router": "[Planning]", "dm": dm_text}[r.agent]
            out.append([(text, [3], [4, 1])])
        return out

    return act, calls


@pytest.mark.parametrize("mode, loops, leaf_depth", [("single_trajectory", 4, 13), ("greedy", 5, 15)])
def test_depth_limit_allows_4_loops_in_training_and_5_at_test(mode, loops, leaf_depth):
    act, calls = planning_act()
    retriever = FakeRetriever()
    tree = c3po.rollout(ROWS[:1], act, RenamingEnv(retriever, FakeLLM()), args_for(), mode)[0]
    assert tree["retrievals"] == loops and len(retriever.calls) == loops
    leaf = next(n for n in tree["nodes"] if n["kind"] == "leaf")
    assert leaf["depth"] == leaf_depth and leaf["reward"] == 1.0 and leaf["why"] == "answer"
    dms = [r for c in calls for r in c if r.agent == "dm"]
    assert [r.depth for r in dms] == [3 + 2 * i for i in range(loops + 1)]
    assert [r.ctx["forced"] for r in dms] == [False] * loops + [True]  # the last DM is forced to [LLM]
    assert dms[-1].prompt.startswith("use llm") and dms[0].prompt.startswith("decide next action")
    # paging: the repeated sub-query "sub" gets ranks 1-2, 3-4, ...; accumulated documents never repeat
    assert [k for _, k in retriever.calls] == [2 * (i + 1) for i in range(loops)]
    assert [d["text"] for d in dms[-1].ctx["acc"]] == [f"sub passage {2 * i}" for i in range(loops)]
    assert max(n["depth"] for n in tree["nodes"]) == leaf_depth


def test_tree_size_bound_with_one_roadmap():
    """Distinct samples everywhere and a DM that always retrieves give 7 leaves and 39 agent nodes (one roadmap)."""

    def act(requests, seed):
        texts = {
            "router": "[Retrieval] q{k}",
            "filter": "Thought: t{k}\nAction: [1]",
            "dm": "Thought: t{k}\nAction: [Retrieval] sub",
        }
        return [
            [(r.fixed, [3], [4])] if r.fixed else [(texts[r.agent].format(k=k), [3], [4]) for k in range(r.n)]
            for r in requests
        ]

    tree = c3po.rollout(ROWS[:1], act, env(), args_for(), "tree")[0]
    kinds = [n["kind"] for n in tree["nodes"]]
    assert kinds.count("leaf") == 7 and sum(k in c3po.AGENTS for k in kinds) == 39
    assert sorted(n["depth"] for n in tree["nodes"] if n["kind"] == "leaf") == [3, 4, 4, 13, 13, 13, 13]
    assert len(c3po.node_samples([tree])) == 39


def test_document_limit_forces_the_answer():
    act, calls = planning_act(filter_texts=("Thought: t\nAction: [1, 2]",))
    args = args_for(max_documents=3)
    tree = c3po.rollout(ROWS[:1], act, env(), args, "single_trajectory")[0]
    dms = [r for c in calls for r in c if r.agent == "dm"]
    assert [len(r.ctx["acc"]) for r in dms] == [0, 2, 4] and [r.ctx["forced"] for r in dms] == [
        False,
        False,
        True,
    ]
    assert tree["retrievals"] == 2


def test_placeholder_for_an_empty_selection_is_removed_when_the_query_later_selects():
    act, calls = planning_act(
        filter_texts=("Thought: t\nAction: []", "Thought: t\nAction: []", "Thought: t\nAction: [2]")
    )
    c3po.rollout(ROWS[:1], act, env(), args_for(), "single_trajectory")
    dms = [r for c in calls for r in c if r.agent == "dm"]
    assert dms[1].ctx["acc"] == [c3po.placeholder("sub")] == dms[2].ctx["acc"]  # deduplicated
    assert [d["text"] for d in dms[3].ctx["acc"]] == ["sub passage 5"]  # third page, 2nd doc; placeholder gone


def test_filter_objective_is_the_decision_makers_thought():
    act, calls = planning_act(dm_text="Thought: find the director\nAction: [Retrieval] sub")
    c3po.rollout(ROWS[:1], act, env(), args_for(), "single_trajectory")
    filt = next(r for c in calls for r in c if r.agent == "filter")
    assert filt.prompt.startswith("filter documents . goal : find the director question : question 0 ?")


@pytest.mark.parametrize(
    "router, filter_text, why",
    [
        ("Retrieval: q", "x", "invalid"),
        ("[Retrieval] q", "Action: [1]", "invalid"),
        ("[Retrieval] q", "Thought: t\nAction: [9]", "invalid"),
    ],
)
def test_invalid_outputs_end_in_a_zero_leaf(router, filter_text, why):
    def act(requests, seed):
        return [[({"router": router, "filter": filter_text}[r.agent], [3], [4])] for r in requests]

    tree = c3po.rollout(ROWS[:1], act, env(), args_for(), "single_trajectory")[0]
    leaves = [n for n in tree["nodes"] if n["kind"] == "leaf"]
    assert len(leaves) == 1 and leaves[0]["why"] == why and leaves[0]["reward"] == 0.0
    tree = c3po.rollout(ROWS[:1], act, env(), args_for(), "greedy")[0]  # at test an id > k is dropped
    leaf = next(n for n in tree["nodes"] if n["kind"] == "leaf")
    assert (leaf["why"] == "answer") is (filter_text == "Thought: t\nAction: [9]")


def ppo_once(seed, forced_weight=1.0, only_fixed=False):
    """A tree rollout of a tiny random proxy (scripted LLM and retriever) and one PPO update: (texts, stats, policy,
    ref, samples)."""
    from accelerate import Accelerator

    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64")
    args = args_for(
        max_new_tokens=6,
        policy_lr=1e-2,
        value_lr=1e-2,
        micro_batch_size=4,
        ppo_batch_size=8,
        seed=seed,
        forced_weight=forced_weight,
    )
    trees = c3po.rollout(ROWS, c3po.proxy_actor(model, tokenizer, args, greedy=False), env(), args, "tree", seed=seed)
    samples = c3po.node_samples(trees)
    if only_fixed:  # the forced [No Retrieval] / [Planning] router texts alone
        samples = [s for s in samples if s["forced"] == len(s["loss_mask"]) - s["loss_mask"].index(1)]
    ref, value = copy.deepcopy(model), c3po.ValueModel(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, value)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
    pad = tokenizer.pad_token_id
    stats = c3po.ppo_update(Accelerator(cpu=True), model, value, ref, optimizers, schedulers, samples, pad, args)
    return [n.get("text") for t in trees for n in t["nodes"]], stats, model, ref, samples


def test_ppo_update_is_reproducible_and_moves_the_policy():
    texts, stats, policy, ref, samples = ppo_once(0)
    again, stats_again, _, _, _ = ppo_once(0)
    assert texts == again and stats == stats_again  # same seed, same rollout and losses on CPU
    assert {s["credit"] for s in samples} >= {0.0, 1.0}  # forced [No Retrieval] leaves are correct, random text is not
    assert all(len(s["adv"]) == sum(s["loss_mask"]) for s in samples) and stats["rollout/kl"] == pytest.approx(
        0.0, abs=1e-6
    )
    moved = [not torch.equal(p, q) for p, q in zip(policy.parameters(), ref.parameters())]
    assert any(moved) and all(torch.isfinite(p).all() for p in policy.parameters())


@pytest.mark.parametrize("forced_weight, moves", [(1.0, True), (0.0, False)])
def test_forced_weight_zero_leaves_the_policy_untouched_by_forced_texts(forced_weight, moves):
    _, _, policy, ref, samples = ppo_once(0, forced_weight, only_fixed=True)
    assert len(samples) == 6 and {s["credit"] for s in samples} == {0.0, 1.0}  # 3 trees x 2 fixed texts
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), ref.parameters())) is moves


# ---------------------------------------------------------------- the toy teacher and rejection sampling [§5.2]
@pytest.fixture(scope="module")
def toy():
    args = c3po.apply_preset(c3po.Args(teacher_noise=0.0))
    rows = c3po.load_split(args.data_dir, "train", args.question_types)
    environment = c3po.environment(args)
    return args, rows, environment.llm, environment.retriever


def test_a_renamed_tree_is_the_same_tree_under_other_names(toy):
    """PPO's toy renaming (--rl_augment_p): the proxy reads renamed names, the retriever and the LLM the real ones, so
    an actor that writes the same actions in the renamed names grows the same tree with the same rewards."""
    from common.toy import apply_mapping, load_world, renamed_row

    args, rows, llm, retriever = toy
    row = next(
        r
        for r in rows
        if r["metadata"]["type"] == "two_hop"
        and not any(r["metadata"]["popular_hops"])
        and r["metadata"]["answerable"]
    )
    renamed = renamed_row(row, load_world(args.data_dir), random.Random(0))
    forward, inverse = renamed["rename"]
    assert renamed["question"] != row["question"] and renamed["golden_answers"] != row["golden_answers"]
    back = lambda text: apply_mapping([text], inverse)[0]
    real_docs = lambda docs: [dict(d, title=back(d["title"]), text=back(d["text"])) for d in docs]
    queries = []

    class Recording:  # the retriever, recording the queries it is sent
        def search(self, qs, k):
            queries.append(list(qs))
            return retriever.search(qs, k)

    def renamed_oracle(seed):  # the oracle teacher, reading a renamed tree's state through the inverse map
        oracle = c3po.teacher_actor(args, llm)

        def act(requests, s):
            real = [
                replace(
                    r,
                    tree=dict(r.tree, row=row),
                    ctx=dict(
                        r.ctx,
                        docs=real_docs(r.ctx["docs"]),
                        acc=real_docs(r.ctx["acc"]),
                        used={back(q): n for q, n in r.ctx["used"].items()},
                    ),
                )
                for r in requests
            ]
            return [[(apply_mapping([t], forward)[0], p, a) for t, p, a in outs] for outs in oracle(real, s)]

        return act

    plain = c3po.rollout([row], c3po.teacher_actor(args, llm), RenamingEnv(Recording(), llm), args, "tree")[0]
    real_queries, queries[:] = list(queries), []
    other = c3po.rollout([renamed], renamed_oracle(0), RenamingEnv(Recording(), llm), args, "tree")[0]
    assert queries == real_queries  # the retriever saw the real names
    assert [n["kind"] for n in other["nodes"]] == [n["kind"] for n in plain["nodes"]]
    assert [n.get("reward") for n in other["nodes"]] == [n.get("reward") for n in plain["nodes"]]
    assert 1.0 in [n.get("reward") for n in other["nodes"]]
    texts = [(n.get("text"), n.get("prompt"), n.get("answer")) for n in plain["nodes"]]
    assert [(n.get("text"), n.get("prompt"), n.get("answer")) for n in other["nodes"]] == [
        tuple(None if x is None else apply_mapping([x], forward)[0] for x in t) for t in texts
    ]  # the proxy's view


def test_oracle_teacher_solves_a_two_hop_question_by_planning(toy):
    args, rows, llm, retriever = toy
    row = next(
        r
        for r in rows
        if r["metadata"]["type"] == "two_hop"
        and not any(r["metadata"]["popular_hops"])
        and r["metadata"]["answerable"]
    )
    tree = c3po.rollout([row], c3po.teacher_actor(args, llm), RenamingEnv(retriever, llm), args, "tree")[0]
    credit = dict(zip([n.get("strategy") for n in tree["nodes"]], c3po.leaf_credits(tree["nodes"])))
    assert credit["Planning"] == 1.0 and credit["No Retrieval"] == 0.0
    pairs = c3po.successful_paths(tree, 4, random.Random(0))
    outputs = [p["output"] for p in pairs]
    sub = row["metadata"]["sub_queries"]
    assert "[Planning]" in outputs and f"Thought: need step 2 .\nAction: [Retrieval] {sub[1]}" in outputs
    assert (
        f"Thought: need step 1 .\nAction: [Retrieval] {sub[0]}" in outputs
        and "Thought: done .\nAction: [LLM]" in outputs
    )
    assert len(pairs) == len({(p["prompt"], p["output"]) for p in pairs})


def test_the_warm_up_is_the_same_for_any_split_of_the_questions_over_processes(toy):
    """runs.map_shared gives each process every other question: the oracle's noisy draws and the kept paths are
    seeded by question, so two halves built apart make the set one process builds (and every process gets it)."""
    from dataclasses import replace

    args, rows, llm, retriever = toy
    args, rows, env = replace(args, teacher_noise=0.5), rows[:24], RenamingEnv(retriever, llm)
    whole, solved = c3po.build_warmup(rows, llm, env, args)
    halves = [c3po.build_warmup(rows[i::2], llm, env, args) for i in (0, 1)]
    key = lambda examples: sorted((e["row"]["question"], e["prompt"], e["output"]) for e in examples)
    assert key(whole) == key(halves[0][0] + halves[1][0]) and len(whole) > 24
    assert solved == pytest.approx((halves[0][1] * 12 + halves[1][1] * 12) / 24) and 0 < solved < 1
    assert {"Thought: keep 1, 2, 3 .\nAction: [1, 2, 3]", "Thought: done .\nAction: [LLM]"} & {
        e["output"] for e in whole
    }


def test_rejection_sampling_keeps_at_most_four_successful_paths():
    nodes = [dict(kind="root", parent=None)]
    for i in range(6):  # six router children, each with a leaf; five succeed
        nodes.append(dict(kind="router", parent=0, prompt="p", text=f"[Retrieval] q{i}"))
        nodes.append(dict(kind="leaf", parent=len(nodes) - 1, reward=float(i != 0)))
    pairs = c3po.successful_paths({"nodes": nodes, "row": ROWS[0]}, 4, random.Random(0))
    assert len(pairs) == 4 and "[Retrieval] q0" not in [p["output"] for p in pairs]


def test_cheapest_selection_keeps_only_the_cheapest_successful_strategy():
    nodes = [dict(kind="root", parent=None)]
    for strategy, text, rewards in (
        ("No Retrieval", "[No Retrieval]", [0.0]),
        ("Retrieval", "[Retrieval] q", [1.0, 1.0]),
        ("Planning", "[Planning]", [1.0, 1.0, 1.0]),
    ):
        nodes.append(dict(kind="router", parent=0, prompt="p", text=text, strategy=strategy))
        router = len(nodes) - 1
        for j, r in enumerate(rewards):  # router -> filter -> leaf
            nodes.append(dict(kind="filter", parent=router, prompt=f"f{strategy}{j}", text=f"Action: [{j + 1}]"))
            nodes.append(dict(kind="leaf", parent=len(nodes) - 1, reward=r))
    tree = {"nodes": nodes, "row": ROWS[0]}
    cheap = c3po.successful_paths(tree, 4, random.Random(0), "cheapest")
    # No Retrieval failed, so both Retrieval paths and nothing of Planning: router once + 2 filters
    assert sorted(p["output"] for p in cheap) == ["Action: [1]", "Action: [2]", "[Retrieval] q"]
    uniform = c3po.successful_paths(tree, 5, random.Random(0))
    assert {p["output"] for p in uniform} >= {"[Retrieval] q", "[Planning]"}
    nodes[3]["reward"] = 1.0  # now the No Retrieval path succeeds: it alone is kept
    assert [(p["agent"], p["output"]) for p in c3po.successful_paths(tree, 4, random.Random(0), "cheapest")] == [
        ("filter", "Action: [1]"),
        ("router", "[No Retrieval]"),
    ]


# ---------------------------------------------------------------- the LLM judge and the LLM teacher (fake frozen LLM)
class ChatLLM:
    """A frozen LLM with common.llm's chat interface (HFChatLLM / EndpointLLM): reply(prompt) gives each reply."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def chat(self, messages_lists, temperature=0.0, top_p=1.0, max_tokens=256, stop=(), seed=None):
        self.calls.append(dict(messages=messages_lists, temperature=temperature, max_tokens=max_tokens))
        return [self.reply(messages[-1]["content"]) for messages in messages_lists]


@pytest.mark.parametrize(
    "verdicts, rewards",
    [(["True", "False", "TRUE."], [1.0, 0.0, 1.0]), (["  true\n", "false", "False."], [1.0, 0.0, 0.0])],
)
def test_llm_judge_scores_answer_leaves_only(verdicts, rewards):
    """[App. D.2] prompt with the gold list as str(list); correct iff "true" in the reply, lower-cased (impl)."""
    row = {"question": "who directed zekil ?", "golden_answers": ["mipon", "Mipon Jr"]}
    answers = ["mipon directed it .", "nobody .", "it was mipon ."]
    nodes = [dict(kind="root", parent=None)] + [
        dict(kind="leaf", parent=0, why="answer", answer=a, reward=0.0) for a in answers
    ]
    nodes.insert(2, dict(kind="leaf", parent=0, why="invalid", answer="", reward=0.0))  # never judged, stays 0
    replies = iter(verdicts)
    llm = ChatLLM(lambda prompt: next(replies))
    c3po.score_leaves([{"row": row, "nodes": nodes}], RenamingEnv(None, llm), args_for(judge="llm"))
    assert [n["reward"] for n in nodes if n.get("why") == "answer"] == rewards and nodes[2]["reward"] == 0.0
    (call,) = llm.calls
    assert call["temperature"] == 0.0 and call["max_tokens"] == 256  # --answer_max_tokens: room for a thinking judge
    assert [m[-1]["content"] for m in call["messages"]] == [
        c3po.JUDGE_PROMPT.format(question=row["question"], golds="['mipon', 'Mipon Jr']", prediction=a)
        for a in answers
    ]
    assert call["messages"][0][-1]["content"].endswith(
        "Correct Answer: ['mipon', 'Mipon Jr']\nPredicted Answer: mipon directed it .\n"
    )


def test_a_thinking_llm_is_judged_and_read_by_what_follows_its_reasoning():
    """A reasoning model as the LLM: the judge's verdict follows its <think> block (which may say "true" and must have
    room, --answer_max_tokens, not 8 tokens), and the answers and the roadmap leave their reasoning out."""
    row = {"question": "who directed zekil ?", "golden_answers": ["mipon"], "metadata": {}}
    nodes = [dict(kind="root", parent=None)] + [
        dict(kind="leaf", parent=0, why="answer", answer=a, reward=0.0) for a in ("mipon .", "tuvia .")
    ]
    verdicts = iter(["<think>\nIs it true that mipon directed it? The correct answers say so.\n</think>\n\nTrue",
                     "<think>\nTrue or false? tuvia is not in the correct answers.\n</think>\n\nFalse"])  # fmt: skip
    llm = ChatLLM(lambda prompt: next(verdicts))
    c3po.score_leaves([{"row": row, "nodes": nodes}], RenamingEnv(None, llm), args_for(judge="llm"))
    assert [n["reward"] for n in nodes[1:]] == [1.0, 0.0] and llm.calls[0]["max_tokens"] == 256
    thinking = FakeLLM()
    answer = thinking.chat
    thinking.chat = lambda msgs, **kw: [f"<think>\nmaybe tuvia, [LLM]\n</think>\n\n{r}" for r in answer(msgs, **kw)]
    act, _ = planning_act(dm_text="Thought: t\nAction: [LLM]")
    tree = c3po.rollout(ROWS[:1], act, RenamingEnv(FakeRetriever(), thinking), args_for(), "greedy")[0]
    assert [n.get("text", n.get("answer")) for n in tree["nodes"] if n["kind"] in ("roadmap", "leaf")] == [
        "step 1 : find it .", "gold"]  # fmt: skip


def paper_llm(router_reply):
    """Canned replies of a frozen LLM to the paper prompts: it plays the three agents (the --teacher llm warm-up),
    writes the roadmap and the answers, and judges. The planning path retrieves once and stops; direct answers are
    wrong."""

    def reply(prompt):
        if "evaluating whether a given question" in prompt:
            return router_reply
        if "analyzing the retrieved documents" in prompt:
            return "Thought: Document 1 names the director.\nAction: [1]"
        if "determining the next appropriate action" in prompt:
            return (
                "Thought: find the director first.\nAction: [Retrieval] director of zekil"
                if "Existing Documents: \n\nPlan:" in prompt
                else "Thought: the documents suffice.\nAction: [LLM]"
            )
        if "formulating a detailed plan" in prompt:
            return "Step 1: find the director of zekil."
        if "precise answer validator" in prompt:
            return str("Predicted Answer: The director is mipon.\n" in prompt)
        return "The director is mipon." if "Existing documents:" in prompt else "I am not sure."

    return reply


@pytest.mark.parametrize("router_reply", ["[Retrieval] director of zekil", "director of zekil"])
def test_llm_teacher_outputs_become_tree_nodes_and_sft_examples(router_reply):
    """--teacher llm (paper preset): the frozen LLM plays the proxy roles zero-shot [§5.2]; its outputs are the tree's
    agent nodes, leaves are judged by the same LLM, and successful paths become (prompt, output) SFT pairs."""
    args = args_for(
        templates="paper",
        system_prompt="You are a helpful assistant.",
        teacher="llm",
        judge="llm",
        warmup_select="uniform",
    )
    row = {"id": "q0", "question": "who directed zekil ?", "golden_answers": ["mipon"], "metadata": {}}
    llm = ChatLLM(paper_llm(router_reply))
    tree = c3po.rollout([row], c3po.teacher_actor(args, llm), RenamingEnv(FakeRetriever(), llm), args, "tree")[0]
    agents = [(n["kind"], n["text"]) for n in tree["nodes"] if n["kind"] in c3po.AGENTS]
    assert agents == [
        ("router", "[No Retrieval]"),
        ("router", "[Retrieval] director of zekil"),
        ("router", "[Planning]"),
        ("filter", "Thought: Document 1 names the director.\nAction: [1]"),  # K = 2 identical: one node
        ("dm", "Thought: find the director first.\nAction: [Retrieval] director of zekil"),
        ("filter", "Thought: Document 1 names the director.\nAction: [1]"),
        ("dm", "Thought: the documents suffice.\nAction: [LLM]"),
    ]
    assert sorted((n["depth"], n["reward"]) for n in tree["nodes"] if n["kind"] == "leaf") == [
        (3, 0.0),
        (4, 1.0),
        (7, 1.0),
    ]
    teacher = [c for c in llm.calls if c["temperature"] == args.teacher_temperature]
    assert [len(c["messages"]) for c in teacher] == [
        1,
        4,
        2,
        1,
    ]  # one call per level, K(t) samples: 1 query; 2 x (F2, DM3); 2 F4; 1 DM5
    first = teacher[0]["messages"][0]
    assert first[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert first[1]["content"] == c3po.TEMPLATES["paper"]["router"].format(question=row["question"]) + "\n[Retrieval]"
    examples, solved = c3po.build_warmup([row], llm, RenamingEnv(FakeRetriever(), llm), args)
    assert solved == 1.0 and len(examples) == 6  # the failed [No Retrieval] path gives none
    assert sorted((e["agent"], e["output"]) for e in examples) == sorted(agents[1:])
    router = next(e for e in examples if e["output"] == "[Planning]")
    assert router["prompt"] == c3po.TEMPLATES["paper"]["router"].format(
        question=row["question"]
    )  # zero-shot, no prefix


def test_the_llm_teacher_writes_at_the_proxys_length_and_its_reasoning_is_dropped():
    """The LLM teacher plays the proxy, so it gets the proxy's cap [Tab. 7: 2048], not --answer_max_tokens (256): an
    Information Filter's analysis of ten documents (about 300 tokens) keeps its `Action:`; a <think> block is cut."""
    doc = "Document {} is about zekil , a film of 1931 ; it names no director , so it cannot say who directed it ."
    analysis = "Thought: " + " ".join(doc.format(i) + " It is not relevant at all ." for i in range(1, 11))

    def reply(prompt):
        if "analyzing the retrieved documents" in prompt:
            return analysis + "\nAction: [1]"
        return "<think>\nA plan? [No Retrieval]?\n</think>\n\nzekil director" if "evaluating" in prompt else "x"

    class Capped(ChatLLM):  # a served LLM stops at max_tokens (a word each here)
        def chat(self, messages_lists, max_tokens=256, **kw):
            replies = super().chat(messages_lists, max_tokens=max_tokens, **kw)
            return [" ".join(r.split(" ")[:max_tokens]) for r in replies]

    args = args_for(templates="paper", teacher="llm", max_new_tokens=2048, top_k=10)
    llm = Capped(reply)
    requests = [c3po.Request({"row": ROWS[0]}, 0, "filter", 2, c3po.TEMPLATES["paper"]["filter_direct"], CTX, 1),
                c3po.Request({"row": ROWS[0]}, 0, "router", 1, c3po.TEMPLATES["paper"]["router"], CTX, 1,
                             prefix="[Retrieval]")]  # fmt: skip
    (filter_text,), (router_text,) = ([t for t, _, _ in out] for out in c3po.teacher_actor(args, llm)(requests, 0))
    assert len(analysis.split()) > 256 and all(c["max_tokens"] == 2048 for c in llm.calls)
    assert c3po.parse_filter(filter_text, 10) == (analysis.removeprefix("Thought: "), [1])
    assert router_text == "[Retrieval] zekil director"


# ---------------------------------------------------------------- SFT warm-up: the loss is on the output tokens only
def test_sft_batch_puts_labels_on_the_output_and_eos_only():
    from common.toy.lm import load_toy_lm

    _, tokenizer = load_toy_lm(TINY_LM)
    examples = [
        dict(prompt="write a plan . question : x ?", output="[Planning]"),
        dict(prompt="decide : no retrieval , retrieval or planning . question : x ?", output="[No Retrieval]"),
    ]
    # given longest first, the rows come back sorted by length (the shorter planning example first)
    pairs = [(ex["prompt"], ex["output"]) for ex in examples[::-1]]
    ids, labels, attention = c3po.sft_batch(pairs, tokenizer, args_for(system_prompt=""))
    assert (labels != -100).sum(1).tolist() == [3 + 1, 4 + 1]  # `[ planning ]` + EOS, `[ no retrieval ]` + EOS
    for row, ex in enumerate(examples):
        prompt = c3po.encode_prompts(tokenizer, [ex["prompt"]], "")[0]
        target = tokenizer(ex["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n, width = len(prompt) + len(target), ids.shape[1]
        assert ids[row].tolist() == prompt + target + [tokenizer.pad_token_id] * (width - n)
        assert labels[row].tolist() == [-100] * len(prompt) + target + [-100] * (width - n)
        assert attention[row].tolist() == [1] * n + [0] * (width - n)


def test_length_sorted_micro_batches_give_the_full_batch_gradient(tmp_path):
    """Micro-batches cut to their own longest sequence change the padding, not the gradient of the SFT step."""
    from accelerate import Accelerator

    from common.toy.lm import load_toy_lm

    examples = [
        dict(prompt="question : " + "x " * n + "?", output=["[Planning]", "[No Retrieval]"][n % 2])
        for n in (1, 9, 3, 14, 6, 2)
    ]
    grads = {}
    for micro in (6, 2):
        torch.manual_seed(0)
        model, tokenizer = load_toy_lm(TINY_LM)
        accelerator = Accelerator(cpu=True)
        accelerator.clip_grad_norm_ = lambda params, norm, m=micro: grads.setdefault(
            m, [p.grad.clone() for p in params]
        )
        c3po.sft(
            accelerator,
            model,
            tokenizer,
            examples,
            args_for(sft_steps=1, sft_batch_size=6, micro_batch_size=micro, augment_p=0.0, system_prompt=""),
            None,
            tmp_path,
        )
    assert len(grads[6]) == len(grads[2]) > 0 and any(g.abs().sum() > 0 for g in grads[6])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[6], grads[2]))


# ---------------------------------------------------------------- CLI and end to end on the toy world
def run(args, capsys):
    """c3po.main in this process (no interpreter start-up per run); returns the captured stdout."""
    capsys.readouterr()
    c3po.main(args)
    return capsys.readouterr().out


TINY = [
    "--n_train",
    "32",
    "--n_eval",
    "8",
    "--sft_steps",
    "8",
    "--ppo_iterations",
    "2",
    "--rollout_batch",
    "4",
    "--sft_batch_size",
    "16",
    "--ppo_batch_size",
    "64",
    "--eval_every",
    "1",
]


def outcome(result):
    """What an evaluation measured, without its wall-clock latency."""
    return [{k: v for k, v in r.items() if k not in ("latency_s", "sampled")} for r in (result, result["sampled"])]


def test_toy_train_then_resume_then_eval_the_checkpoint(tmp_path, capsys, monkeypatch):
    out, bars, progress = tmp_path / "run", [], runs.progress
    monkeypatch.setattr(runs, "progress", lambda it, desc, **kw: bars.append(desc) or progress(it, desc, **kw))
    stdout = run(["--train", "--output_dir", str(out), *TINY], capsys)
    results = check_contract(out, stdout)
    assert results["train_steps"] == {"sft": 8, "ppo": 2} and results["n_eval"] == 8 and results["warnings"] == []
    assert {"eval", "warm-up trees"} <= set(bars)  # runs.progress: a line every 30 s at most in a log
    # the run ends with the table (the judge's accuracy first), the paths, and RESULT with the accuracy before/after
    end = stdout.strip().splitlines()
    table = end[end.index(next(line for line in end if line.split() == ["start", "before", "after"])) :]
    assert [row.split()[0] for row in table[1:10]] == list(c3po.TABLE_ROWS)
    assert table[10:13] == [f"results: {out / 'results.json'}", f"checkpoint: {out / 'ppo'}",
                            f"predictions: {out / 'predictions_ppo.jsonl'}"]  # fmt: skip
    head = json.loads(end[-1][len("RESULT ") :])
    assert head["after"]["accuracy"] == round(results["after"]["accuracy"], 4) and "accuracy" in head["before"]
    for stage in ("sft", "ppo"):  # a checkpoint records its method and the toy world its toy-lm was built on
        state = json.loads((out / stage / "run_state.json").read_text())
        assert state["method"] == "c3po" and state["world"] == str((ROOT / "data" / "toy").resolve())
    assert {"accuracy", "strategies", "latency_s", "sampled"} <= set(results["after"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if "iteration" in m] == [1, 2]
    assert [m["sft/step"] for m in metrics if "sft/loss" in m] == list(range(1, 9))  # every step of 8 (a tenth: 0)
    assert all(m["rollout/samples"] > 0 for m in metrics if "iteration" in m)
    assert (out / "ppo" / "model.safetensors").is_file() and (out / "sft" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["ppo", "sft"]  # --report_to none: no tracker logs
    for stage, result in (("raw", results["before_sft"]), ("sft", results["before"]), ("ppo", results["after"])):
        lines = [json.loads(line) for line in (out / f"predictions_{stage}.jsonl").read_text().splitlines()]
        greedy = [r for r in lines if r["decoding"] == "greedy"]
        assert len(greedy) == len(lines) - len(greedy) == 8  # every question, greedy and sampled
        assert sum(r["accuracy"] for r in greedy) / 8 == pytest.approx(result["accuracy"])
        assert sum(r["retrievals"] for r in greedy) / 8 == pytest.approx(result["retrievals"])
        assert all(r["trajectory"].startswith("router") and "leaf" in r["trajectory"] for r in lines)
        assert {"id", "question", "golden_answers", "prediction", "llm_calls", "generated_tokens"} <= set(lines[0])
    with pytest.raises(SystemExit, match="pass --resume or another --run_name"):  # resuming is asked for
        run(["--train", "--output_dir", str(out), *TINY], capsys)
    with pytest.raises(SystemExit, match=r"other arguments \(seed: 0 -> 1\)"):  # never another run's checkpoint
        run(["--train", "--output_dir", str(out), "--resume", "--seed", "1", *TINY], capsys)
    again = run(["--train", "--output_dir", str(out), "--resume", *TINY], capsys)  # neither SFT nor PPO is redone
    assert "sft/step" not in again and "iteration=" not in again
    assert outcome(check_contract(out, again)["after"]) == outcome(results["after"])
    stdout = run(
        ["--eval", "--model", str(out / "ppo"), "--output_dir", str(tmp_path / "eval"), "--n_eval", "8"], capsys
    )
    assert outcome(check_contract(tmp_path / "eval", stdout)["after"]) == outcome(
        results["after"]
    )  # greedy and sampled
    assert (tmp_path / "eval" / "predictions_eval.jsonl").read_text() == (out / "predictions_ppo.jsonl").read_text()
    # --eval writes next to the model by default, a new folder each time, never over a training run's results
    trained, folders = (out / "results.json").read_text(), []
    for n_eval in (8, 2):
        stdout = run(["--eval", "--model", str(out / "ppo"), "--n_eval", str(n_eval)], capsys)
        folders.append(Path(re.search(r"^evaluation folder: (.+)$", stdout, re.M).group(1)))
        assert check_contract(folders[-1], stdout)["n_eval"] == n_eval and folders[-1].parent == out / "ppo" / "eval"
    assert outcome(json.loads((folders[0] / "results.json").read_text())["after"]) == outcome(results["after"])
    with pytest.raises(SystemExit, match="training"):
        run(["--eval", "--model", str(out / "ppo"), "--output_dir", str(out), "--n_eval", "2"], capsys)
    assert (out / "results.json").read_text() == trained
    # a FlashRAG folder of one's own questions (no world.json, no metadata): the checkpoint's world (toy-lm, reader,
    # corpus) evaluates it; --world names one for the raw toy-lm; the oracle teacher's fields are named, not guessed
    flashrag = own_questions(tmp_path / "flashrag")
    mine = ["--eval", "--data_dir", str(flashrag), "--output_dir"]
    stdout = run([*mine, str(tmp_path / "mine_ckpt"), "--model", str(out / "ppo")], capsys)
    assert check_contract(tmp_path / "mine_ckpt", stdout)["n_eval"] == 4
    stdout = run([*mine, str(tmp_path / "mine_raw"), "--world", str(ROOT / "data" / "toy")], capsys)
    assert check_contract(tmp_path / "mine_raw", stdout)["n_eval"] == 4
    with pytest.raises(ModelLoadError, match="pass --world DIR"):  # toy-lm: which world's vocabulary
        run([*mine, str(tmp_path / "mine_none")], capsys)
    with pytest.raises(DataError, match=r"has no metadata 'type', 'entities', .*which the oracle teacher"):
        run(["--train", "--data_dir", str(flashrag), "--output_dir", str(tmp_path / "mine_train"), *TINY], capsys)
    stdout = run(["--ask", "what is the birthplace of qqzzyx ?", "--model", str(out / "ppo")], capsys)
    assert "warning: words the proxy's tokenizer does not know (read as <unk>): qqzzyx" in stdout
    text = (ROOT / "docs" / "c3po.md").read_text(encoding="utf-8") + (ROOT / "c3po.py").read_text(encoding="utf-8")
    documented = sorted(set(re.findall(r'--ask "([^"]+)"', text)))
    test_questions = {json.loads(line)["question"] for line in (ROOT / "data/toy/test.jsonl").read_text().splitlines()}
    assert documented and set(documented) <= test_questions  # the docs ask questions of the toy world
    for question in documented:  # and their commands run (docs/c3po.md gives what the default run answers)
        stdout = run(["--ask", question, "--model", str(out / "ppo")], capsys)
        assert "leaf" in stdout and "warning" not in stdout


def own_questions(folder, n=4):
    """A FlashRAG folder of one's own questions: train and test splits without metadata, no world.json, no corpus."""
    folder.mkdir()
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (ROOT / f"data/toy/{split}.jsonl").read_text().splitlines()[:n]]
        lines = [json.dumps({k: r[k] for k in ("id", "question", "golden_answers")}) for r in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_an_interrupted_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path, capsys, monkeypatch):
    """Weights, optimizers, schedulers and the random states (python, numpy, torch, the run's rng) come back."""
    flags = [*TINY, "--ppo_iterations", "3", "--n_eval", "2"]
    monkeypatch.setitem(c3po.PRESETS, "rl_augment_p", (0.5, 0.0))  # renaming draws from the rng
    run(["--train", "--output_dir", str(tmp_path / "whole"), *flags], capsys)
    save = runs.save_checkpoint

    def killed_after_the_first_update(folder, *a, **k):
        save(folder, *a, **k)
        if Path(folder).name == "ppo":
            raise KeyboardInterrupt

    monkeypatch.setattr(runs, "save_checkpoint", killed_after_the_first_update)
    with pytest.raises(KeyboardInterrupt):
        run(["--train", "--output_dir", str(tmp_path / "cut"), *flags], capsys)
    monkeypatch.setattr(runs, "save_checkpoint", save)
    resumed = run(["--train", "--output_dir", str(tmp_path / "cut"), "--resume", *flags], capsys)
    assert "resumed PPO at iteration 1" in resumed
    lines = lambda run_dir: map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    updates = lambda run_dir: {
        m["iteration"]: {k: v for k, v in m.items() if k != "charts/seconds"}
        for m in lines(run_dir)
        if "iteration" in m
    }
    whole, cut = updates(tmp_path / "whole"), updates(tmp_path / "cut")
    assert list(whole) == list(cut) == [1, 2, 3] and whole == cut  # the same floats, bit for bit
    assert whole[2]["losses/policy"] != whole[3]["losses/policy"]


def test_a_warm_up_without_a_successful_path_warns_and_ppo_starts_from_the_raw_proxy(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(c3po, "build_warmup", lambda rows, llm, env, args: ([], 0.0))  # the teacher solved nothing
    flags = ["--train", "--output_dir", str(tmp_path / "run"), *TINY, "--ppo_iterations", "1", "--n_eval", "2"]
    stdout = run(flags, capsys)
    results = check_contract(tmp_path / "run", stdout)
    assert "warning: sft trained on nothing (no successful warm-up path: check --teacher)" in stdout.splitlines()
    assert results["warnings"] == ["sft: no successful warm-up path: check --teacher"]
    assert results["train_steps"] == {"sft": 0, "ppo": 1}
    assert check_contract(tmp_path / "run", run([*flags, "--resume"], capsys))["warnings"] == results["warnings"]


def test_the_smoke_command_of_the_docs_shows_the_training_signal_move(tmp_path, capsys, monkeypatch):
    """docs/c3po.md's "Smoke test" command as written (in a fresh folder that sees the repository's data): the SFT
    loss falls, the teacher's warm-up paths are there, SFT lifts the raw proxy's accuracy off 0, PPO updates."""
    import ast
    import shlex

    section = (ROOT / "docs" / "c3po.md").read_text(encoding="utf-8").split("## Smoke test", 1)[1]
    command = shlex.split(re.search(r"```bash\n(python c3po\.py [^\n]+)\n", section).group(1))
    (tmp_path / "data").symlink_to(ROOT / "data")
    monkeypatch.chdir(tmp_path)
    stdout = run(command[2:], capsys)
    out = tmp_path / "runs" / command[command.index("--run_name") + 1]
    results = check_contract(out, stdout)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["sft/loss"] for m in metrics if "sft/loss" in m]
    assert len(losses) == 10 and losses[-1] < losses[0] / 5  # every tenth of the steps
    assert (
        sum(ast.literal_eval(re.search(r"^warm-up: (\{.*\});", stdout, re.M).group(1)).values()) > 50
    )  # SFT examples
    assert results["before_sft"]["accuracy"] == 0 and results["before"]["accuracy"] >= 0.1
    assert [m["rollout/samples"] > 0 for m in metrics if "iteration" in m] == [True, True]


def test_report_to_a_tracker_that_is_not_installed_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"--report_to wandb needs the wandb package \(pip install wandb\)"):
        c3po.main(["--train", "--output_dir", str(tmp_path / "run"), "--report_to", "wandb", *TINY])
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        c3po.main(["--train", "--output_dir", str(tmp_path / "run"), "--report_to", "mlflow", *TINY])


def test_report_to_tensorboard_logs_the_updates_beside_metrics_jsonl(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(["--train", "--output_dir", str(tmp_path / "run"), "--report_to", "tensorboard", *TINY], capsys)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()  # <output_dir>/tensorboard
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    policy = [(e.step, e.value) for e in events.Scalars("losses/policy")]
    assert policy == [(m["iteration"], pytest.approx(m["losses/policy"])) for m in logged if "iteration" in m]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2]  # after SFT, after PPO
    sft = [(e.step, e.value) for e in events.Scalars("sft/loss")]  # the SFT loss beside the PPO curves
    assert sft == [(m["sft/step"], pytest.approx(m["sft/loss"])) for m in logged if "sft/loss" in m] and len(sft) == 8


def test_paper_templates_run_a_few_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(c3po.PRESETS, "templates", ("paper", "paper"))  # a preset-only field
    stdout = run(
        [
            "--train",
            "--output_dir",
            str(tmp_path / "paper"),
            "--n_train",
            "8",
            "--n_eval",
            "2",
            "--sft_steps",
            "2",
            "--ppo_iterations",
            "1",
            "--rollout_batch",
            "2",
        ],
        capsys,
    )
    assert "iteration=1" in stdout and stdout.strip().splitlines()[-1].startswith("RESULT ")


@pytest.mark.parametrize(
    "flag, message",
    [
        ([], "choose a mode"),
        (["--ask", "who ?"], "--ask needs --model"),
        (["--train", "--eval"], "choose one mode: --train, --eval or --ask"),
        (["--eval", "--ask", "who ?", "--model", "toy-lm"], "choose one mode"),
    ],
)
def test_bad_flags_are_clear_errors(flag, message):
    with pytest.raises(SystemExit, match=message):
        c3po.main(flag)


@pytest.mark.parametrize(
    "flag, value, message",
    [("--n_train", "-5", "-5: must be >= 1"), ("--n_eval", "0", "0: must be >= 1"),
     ("--kl_coef", "-1", "-1.0: must be >= 0.0"), ("--value_clip", "-1", "-1.0: must be >= 0.0"),
     ("--sft_lr", "0", "0.0: must be >= 1e-12"), ("--ppo_batch_size", "0", "0: must be >= 1"),
     ("--seed", "-1", "-1: must be >= 0"), ("--micro_batch_size", "0", "0: must be >= 1"),
     ("--branch_k", "0", "0: must be >= 1"), ("--top_k", "0", "0: must be >= 1"),
     ("--cutoff_len", "0", "0: must be >= 1"), ("--value_lr", "0", "0.0: must be >= 1e-12")],
)  # fmt: skip
def test_a_number_out_of_its_range_is_one_line_and_exit_2(flag, value, message, capsys):
    """Counts >= 1, probabilities in [0, 1], learning rates > 0 ...: refused before any work, never a traceback."""
    with pytest.raises(SystemExit) as exit_:
        c3po.main(["--train", flag, value])
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {flag} {message}"]


@pytest.mark.parametrize(
    "name, toy, paper",
    [("teacher_noise", 0.2, 0.2), ("warmup_select", "cheapest", "uniform"), ("augment_p", 1.0, 0.0),
     ("rl_augment_p", 1.0, 0.0), ("forced_weight", 0.1, 1.0), ("templates", "compact", "paper"),
     ("max_documents", 6, 10), ("ppo_epochs", 2, 1), ("lam", 0.95, 0.95), ("max_grad_norm", 1.0, 1.0)],
)  # fmt: skip
def test_toy_tuning_and_impl_constants_are_preset_values_not_flags(name, toy, paper, capsys):
    """A preset-only field is no flag (one line, exit 2), each preset sets it, --help lists it after the flags."""
    with pytest.raises(SystemExit) as exit_:
        c3po.main(["--train", f"--{name}", "1"])
    assert exit_.value.code == 2 and f"unknown flags ['--{name}', '1']" in capsys.readouterr().err
    assert [getattr(c3po.apply_preset(c3po.Args(preset=p)), name) for p in ("toy", "paper")] == [toy, paper]
    with pytest.raises(SystemExit):
        c3po.main(["--help"])
    listed = capsys.readouterr().out.partition("not flags:")[2]
    assert f"\n  {name}: " in listed and f"\n  --{name}" not in listed


def test_another_methods_checkpoint_is_refused_naming_both(tmp_path):
    for method in ("sparkle", "tearag"):
        (tmp_path / method).mkdir()
        (tmp_path / method / runs.STATE).write_text(json.dumps({"method": method, "data_dir": "data/toy"}))
        for mode in (["--eval"], ["--ask", "who ?"], ["--train", "--resume"]):
            with pytest.raises(SystemExit, match=f"is a {method} checkpoint, not a c3po one"):
                c3po.main([*mode, "--model", str(tmp_path / method)])


@pytest.mark.parametrize(
    "flag, value",
    [("--preset", "nope"), ("--judge", "nope"), ("--teacher", "gpt"), ("--credit_mode", "single"),
     ("--report_to", "mlflow")],
)  # fmt: skip
def test_a_value_outside_a_flags_choices_is_an_argparse_error(flag, value, capsys):
    """Not one of the choices: exit code 2 and one error line naming the flag and the value (after the usage)."""
    with pytest.raises(SystemExit) as exit_:
        c3po.main(["--train", flag, value])
    assert exit_.value.code == 2
    errors = capsys.readouterr().err.splitlines()  # the one line, never argparse's usage
    assert len(errors) == 1 and re.search(f"error: argument {flag}(/[-a-z]+)?: invalid choice: '{value}'", errors[0])


# ---------------------------------------------------------------- numerics: fp32 master weights, a critic, no LM head
def test_bf16_mixed_precision_trains_fp32_weights_under_autocast(monkeypatch, tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    stepped = []

    class SpyAdamW(torch.optim.AdamW):
        def step(self, *a, **k):
            stepped.append({p.dtype for g in self.param_groups for p in g["params"]})
            return super().step(*a, **k)

    monkeypatch.setattr(c3po.torch.optim, "AdamW", SpyAdamW)
    AcceleratorState._reset_state(reset_partial_state=True)  # a singleton: other tests made one without bf16
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    args = c3po.apply_preset(c3po.Args(train=True, model=TINY_LM, sft_steps=2, sft_batch_size=4, sft_lr=1e-2))
    policy, tokenizer = c3po.load_proxy(args, accelerator.device)
    logits_dtypes = []
    policy.lm_head.register_forward_hook(lambda module, inputs, output: logits_dtypes.append(output.dtype))
    before = [p.detach().clone() for p in policy.parameters()]
    examples = [
        dict(prompt=f"decide : question : who is velbo {i} ?", output="[No Retrieval]", agent="router", row={})
        for i in range(4)
    ]
    trained, _ = c3po.sft(accelerator, policy, tokenizer, examples, args, None, tmp_path)
    assert stepped == [{torch.float32}] * 2  # Adam updates fp32 master weights ...
    assert logits_dtypes and set(logits_dtypes) == {torch.bfloat16}  # ... of a forward pass run in bf16
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trained.parameters()))
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_critic_runs_no_lm_head():
    from common.toy.lm import load_toy_lm

    model, _ = load_toy_lm(TINY_LM)
    value = c3po.ValueModel(model)
    vocab = model.config.vocab_size
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features == vocab for m in value.modules())
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[4, 7, 8, 9]])
    assert value(ids, torch.ones_like(ids)).shape == (1, 4) and calls == []


def test_trains_on_a_freshly_generated_world(tmp_path, capsys):
    """The tokenizer, the toy reader and the renaming come from --data_dir: a world of another seed trains."""
    from common.toy import write_world

    world = write_world(tmp_path / "world", seed=3, size=0.5)
    out = tmp_path / "run"
    stdout = run(
        [
            "--train",
            "--data_dir",
            str(world),
            "--output_dir",
            str(out),
            "--n_eval",
            "40",
            "--n_train",
            "120",
            "--sft_steps",
            "200",
            "--ppo_iterations",
            "1",
            "--rollout_batch",
            "4",
        ],
        capsys,
    )
    results = check_contract(out, stdout)
    assert results["dataset"] == str(world) and results["args"]["world"] == str(world.resolve())  # reader, toy-lm
    assert results["before_sft"]["accuracy"] == 0.0 and results["before"]["accuracy"] >= 0.1  # raw start -> after SFT
    assert json.loads((out / "sft" / "run_state.json").read_text())["world"] == str(world.resolve())  # remembered
