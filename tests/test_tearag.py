"""TeaRAG: the KAG and PPR against a worked graph (Fig. 4c), the rewards, pairs and DPO loss against hand-computed
numbers, the parser and format check, the masks, the agent loop with a scripted LLM; then the CLI end to end."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import check_contract

import tearag as T
from common import runs
from common.llm import Generation
from common.toy.lm import load_toy_lm

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "data" / "toy"


# --------------------------------------------------------------------------- the KAG and PPR [§4.2.4-4.2.5, Eq. 1-3]
def chunk(i, title, score):
    return {"kind": "chunk", "id": i, "doc_id": i, "title": title, "text": f"{title} text", "score": score}


def triplet(i, head, rel, tail, doc, score):
    return {"kind": "triplet", "id": i, "head": head, "relation": rel, "tail": tail, "doc_id": doc, "score": score}


def citibank(d2_score=0.0, e1_doc="d1"):
    """A graph after Fig. 4c: subquery "In what year was Citibank founded?", key entity Citibank."""
    chunks = [chunk("d1", "Citibank", 3.0), chunk("d2", "Citigroup", d2_score)]
    triplets = [triplet("e1", "Citibank", "founded in", "1812", e1_doc, 2.0),
                triplet("e2", "Citibank (China)", "founded on", "1 April 2007", "dx", -1.0)]  # fmt: skip
    return chunks, triplets


def ppr_of(entities, chunks, triplets, alpha=0.5, p_scale=1.0, n_iter=200):
    nodes, adjacency = T.build_kag(entities, chunks, triplets, tau=0.2)
    p = p_scale * T.personalization(nodes, entities)
    return nodes, adjacency, T.personalized_pagerank(adjacency, p, alpha, n_iter)


def test_kag_of_the_worked_graph_has_its_edges_and_weights():
    nodes, adjacency = T.build_kag(["Citibank"], *citibank(), tau=0.2)
    index = {n: i for i, n in enumerate(nodes)}
    assert len(nodes) == 10 and np.count_nonzero(np.triu(adjacency)) == 14
    assert np.allclose(adjacency, adjacency.T)
    w = lambda a, b: adjacency[index[a], index[b]]
    q, d1, d2, e1, e2 = ("Q",), ("D", "d1"), ("D", "d2"), ("T", "e1"), ("T", "e2")
    v = lambda name: ("V", name)
    assert w(q, d1) == pytest.approx(0.952574, abs=1e-6)  # sigmoid(3) [Eq. 1]
    assert w(q, d2) == pytest.approx(0.5)
    assert w(q, e1) == pytest.approx(0.680797, abs=1e-6)  # sigmoid(2) - 0.2 [Eq. 2]
    assert w(q, e2) == pytest.approx(0.068941, abs=1e-6)  # sigmoid(-1) - 0.2
    ones = [(v("citibank"), v("1812")), (v("citibank (china)"), v("1 april 2007")), (e1, v("citibank")),
            (e1, v("1812")), (e2, v("citibank (china)")), (e2, v("1 april 2007")), (d1, e1), (d1, v("citibank")),
            (d1, v("1812")), (d2, v("citigroup"))]  # fmt: skip
    assert all(w(a, b) == 1.0 for a, b in ones)  # co-occurrence: weight 1, the title edge of d1 not doubled
    assert w(e2, d1) == w(e2, d2) == 0  # e2's source chunk was not retrieved: no chunk-triplet edge


def test_triplet_below_tau_has_no_subquery_edge_but_keeps_its_co_occurrence_edges():
    assert T.sigmoid(-1.5) - 0.2 < 0  # weight max(sigmoid(-1.5) - 0.2, 0) = 0 [Eq. 2]
    chunks, triplets = citibank()
    triplets[0]["score"] = -1.5
    nodes, adjacency = T.build_kag(["Citibank"], chunks, triplets, tau=0.2)
    index = {n: i for i, n in enumerate(nodes)}
    e1 = index[("T", "e1")]
    assert adjacency[index[("Q",)], e1] == 0
    assert adjacency[e1, index[("D", "d1")]] == adjacency[e1, index[("V", "1812")]] == 1.0


def test_ppr_on_the_worked_graph_matches_hand_computed_values():
    chunks, triplets = citibank()
    nodes, adjacency, pi = ppr_of(["Citibank"], chunks, triplets)
    expected = {("Q",): 0.370587, ("V", "citibank"): 0.213326, ("D", "d1"): 0.144128, ("T", "e1"): 0.122811,
                ("V", "1812"): 0.070469, ("D", "d2"): 0.050482, ("V", "citigroup"): 0.016827, ("T", "e2"): 0.006914,
                ("V", "citibank (china)"): 0.002228, ("V", "1 april 2007"): 0.002228}  # fmt: skip
    for node, value in expected.items():
        assert pi[nodes.index(node)] == pytest.approx(value, abs=1e-6), node
    assert pi.sum() == pytest.approx(1.0, abs=1e-12)
    assert [it["id"] for it in T.top_nodes(nodes, pi, chunks + triplets, 5)] == ["d1", "e1", "d2", "e2"]
    assert [it["id"] for it in T.top_nodes(nodes, pi, chunks + triplets, 3)] == ["d1", "e1", "d2"]
    # (d) an unnormalised p gives the same pi (p is normalised); (e) the closed form; (f) a uniform start
    assert np.allclose(ppr_of(["Citibank"], chunks, triplets, p_scale=1.5)[2], pi, atol=1e-15)
    degree = adjacency.sum(0)
    W = adjacency / degree
    p = np.array([1.0 if n == ("Q",) else 0.5 if n == ("V", "citibank") else 0.0 for n in nodes])
    closed = 0.5 * np.linalg.solve(np.eye(len(nodes)) - 0.5 * W, p / p.sum())
    assert np.allclose(closed, pi, atol=1e-12)
    assert not np.allclose(ppr_of(["Citibank"], chunks, triplets, n_iter=1)[2], pi, atol=1e-3)  # iterations matter


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_ppr_ranking_of_the_worked_graph_is_robust_to_alpha(alpha):
    chunks, triplets = citibank()
    nodes, _, pi = ppr_of(["Citibank"], chunks, triplets, alpha=alpha)
    assert [it["id"] for it in T.top_nodes(nodes, pi, chunks + triplets, 4)] == ["d1", "e1", "d2", "e2"]


def test_co_occurrence_and_the_entity_seed_beat_raw_similarity():
    chunks, triplets = citibank(d2_score=3.5)  # d2 now more similar than d1
    nodes, _, pi = ppr_of(["Citibank"], chunks, triplets)
    at = lambda key: pi[nodes.index(key)]
    assert at(("D", "d1")) == pytest.approx(0.128219, abs=1e-6) and at(("D", "d2")) == pytest.approx(
        0.078701, abs=1e-6
    )
    chunks, triplets = citibank(d2_score=3.5, e1_doc="elsewhere")  # no co-occurrence of d1 and e1, no key entity
    nodes, _, pi = ppr_of([], chunks, triplets)
    assert at(("D", "d2")) == pytest.approx(0.117883, abs=1e-6) and at(("D", "d1")) == pytest.approx(
        0.109396, abs=1e-6
    )


@pytest.mark.parametrize("alpha,expected", [(0.5, [2 / 3, 0.1875, 0.104167, 0.041667]),
                                            (0.2, [0.833333, 0.09375, 0.052083, 0.020833]),
                                            (0.8, [0.555556, 0.25, 0.138889, 0.055556])])  # fmt: skip
def test_ppr_on_a_star_graph_ranks_by_relevance_weight(alpha, expected):
    """pi = alpha W pi + (1 - alpha) p on a star around the subquery: pi_Q = 1 / (1 + alpha), a chunk of relevance
    weight w_i alpha / (1 + alpha) w_i / sum w (alpha and 1 - alpha swapped in Eq. 3 give other values off 0.5)."""
    chunks = [chunk(f"c{i}", "", float(np.log(w / (1 - w)))) for i, w in enumerate([0.9, 0.5, 0.2])]
    _, _, pi = ppr_of([], chunks, [], alpha=alpha)
    assert np.allclose(pi, expected, atol=1e-6)


def test_select_seeds_the_ppr_with_the_subquery_and_the_key_entities(monkeypatch):
    """p of Eq. 3 [§4.2.5]: 1 on the subquery node, 0.5 on each key entity's node, 0 elsewhere, as select hands it to
    the PPR; its context is the top k_f chunk/triplet nodes of the worked graph."""
    nodes = [("Q",), ("V", "citibank"), ("D", "d1"), ("V", "citigroup"), ("T", "e1"), ("V", "1812")]
    assert T.personalization(nodes, ["Citibank ", "nobody"]).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert T.personalization(nodes, ["Citibank", "1812"]).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.5]
    seen, ppr = [], T.personalized_pagerank
    monkeypatch.setattr(T, "personalized_pagerank", lambda adjacency, p, *a: seen.append(p) or ppr(adjacency, p, *a))
    system = T.RetrievalSystem.__new__(T.RetrievalSystem)  # select needs only the flags
    system.args = SimpleNamespace(retrieval="ppr", tau=0.2, alpha=0.5, ppr_iterations=200, k_f=3)
    chunks, triplets = citibank()
    assert [it["id"] for it in system.select(["Citibank"], chunks, triplets)] == ["d1", "e1", "d2"]
    kag_nodes = T.build_kag(["Citibank"], chunks, triplets, 0.2)[0]
    assert dict(zip(kag_nodes, seen[0])) == {n: 1.0 if n == ("Q",) else 0.5 if n == ("V", "citibank") else 0.0
                                             for n in kag_nodes}  # fmt: skip


# --------------------------------------------------------------------------- rewards [Eq. 5-13]
@pytest.mark.parametrize(
    "answer,gold,f1",
    [
        ("Kreuzlingen", "Kreuzlingen", 1.0),
        ("the city of Kreuzlingen", "Kreuzlingen", 0.5),
        ("Kreuzlingen, Switzerland", "Kreuzlingen", 2 / 3),
        ("Berlin", "Kreuzlingen", 0.0),
        ("Carl Friedrich Otto Westphal", "Carl Westphal", 2 / 3),
    ],
)
def test_outcome_reward_is_token_f1(answer, gold, f1):
    path = T.ReasoningPath({"golden_answers": [gold]}, [], steps=[{}], answer=answer, format_ok=True)
    assert T.path_rewards(path, [], None) == pytest.approx((1.0, f1, 0.0))  # single-hop rule with k = 1


def test_cover_exact_match_and_consistency():
    assert T.cover_exact_match(["Alexander Carl Otto Westphal"], "Who was the father of Alexander Carl Otto Westphal?")
    assert not T.cover_exact_match(["Carl Friedrich Otto Westphal"], "Where did Carl Westphal die?")
    assert not T.cover_exact_match([], "anything")
    assert T.cover_exact_match(["A", "b c"], "about a and  B C") == 1.0
    assert T.cover_exact_match(["A", "Z"], "about a and b") == 0.0  # every key entity [Eq. 8], not any


SIM_Q, SIM_S = np.array([[0.9, 0.3], [0.2, 0.7]]), np.array([[0.8, 0.1], [0.2, 0.9]])
SIM_C = np.full((2, 10), 0.1)
SIM_C[0, 3], SIM_C[1, 7] = 0.95, 0.85


def test_process_reward_of_the_worked_path():
    assert T.process_reward([1, 0], SIM_Q, SIM_C, SIM_S) == pytest.approx(
        0.815
    )  # 0.1 * 0.5 + 0.3 * (0.8 + 0.9 + 0.85)
    extra = lambda m: np.concatenate([m, m[:, 1:]], 1)  # a third step with step 2's similarities, its CEM 1
    assert T.process_reward([1, 0, 1], extra(SIM_Q), SIM_C, extra(SIM_S)) == pytest.approx(0.576667, abs=1e-6)  # /k
    assert T.process_reward([1, 0, 0], extra(SIM_Q), SIM_C, extra(SIM_S)) == pytest.approx(0.543333, abs=1e-6)
    assert T.process_reward([1, 1], np.full((4, 2), 0.9), np.full((4, 5), 0.9), np.full((4, 2), 0.9)) == pytest.approx(
        1.72
    )


def fake_path(answer, k, fmt=True, gold="Kreuzlingen"):
    steps = [{"entities": ["A"], "subquery": f"q{i} about A", "summary": f"s{i}"} for i in range(k)]
    contexts = [[{"kind": "triplet", "head": "A", "relation": "r", "tail": f"t{i}"}] * 5 for i in range(k)]
    return T.ReasoningPath(
        {"golden_answers": [gold]}, [], contexts=contexts, steps=steps, answer=answer, format_ok=fmt
    )


def test_path_rewards_use_the_evidence_similarities_and_divide_by_the_step_count():
    calls = []

    def sim(golds, texts):
        calls.append(texts)
        return np.full((len(golds), len(texts)), 0.9)

    r = T.path_rewards(fake_path("Kreuzlingen", 2), ["g1", "g2"], sim)
    assert r == pytest.approx((1.0, 1.0, 0.1 + 0.3 * 3 * 1.8 / 2))  # CEM 1; each memory vector sums 1.8, / k = 2
    assert sorted(map(len, calls)) == [2, 2, 10]  # subqueries, summaries, every context item of the path
    r3 = T.path_rewards(fake_path("Kreuzlingen", 3), ["g1", "g2"], sim)
    assert r3[2] == pytest.approx(0.1 + 0.3 * 3 * 1.8 / 3)  # the same evidence over 3 steps earns less


@pytest.mark.parametrize(
    "k,f1,fmt,role",
    [
        (1, 1.0, 1, "chosen"),
        (2, 1.0, 1, None),
        (3, 1.0, 1, None),
        (4, 1.0, 1, "easy"),
        (1, 0.0, 1, "easy"),
        (2, 1.0, 0, "format"),
    ],
)
def test_single_hop_rule_scales_the_outcome_by_the_step_count(k, f1, fmt, role):
    r = T.path_rewards(fake_path("Kreuzlingen" if f1 else "Berlin", k, bool(fmt)), [], None)
    assert r[1] == pytest.approx(f1 / k) and r[2] == 0.0
    best = (1, 1.0, 0.0)
    assert T.is_chosen(r, single_hop=True) == (role == "chosen")
    assert T.rejection_type(r, best, single_hop=True) == (role if role != "chosen" else None)


# --------------------------------------------------------------------------- pairs [Eq. 14, §4.3.2]
def test_pairs_of_the_first_worked_example():
    rewards = [
        (1, 1.0, 0.90),
        (1, 1.0, 0.75),
        (1, 0.85, 0.82),
        (0, 0.0, 0.10),
        (1, 0.0, 0.30),
        (1, 0.4, 0.95),
        (1, 0.5, 0.50),
        (1, 1.0, 0.40),
    ]
    assert T.build_pairs(rewards, single_hop=False) == [(0, 3, "format"), (1, 4, "easy"), (2, 6, "hard")]


def test_pairs_of_the_second_worked_example_leave_a_valid_hard_rejection_unused():
    rewards = [(1, 1.0, 0.85), (1, 0.8, 0.9), (1, 1.0, 0.5), (0, 0.0, 0.2), (1, 0.0, 0.4), (1, 0.5, 0.6),
               (1, 0.6, 0.95), (0, 1.0, 0.6)]  # fmt: skip
    assert T.is_chosen(rewards[1], single_hop=False)  # the relaxed branch: 0.8 and 0.9 (floats compared with 1e-9)
    assert T.build_pairs(rewards, single_hop=False) == [(0, 3, "format"), (1, 4, "easy")]


def test_redundant_correct_path_is_neither_chosen_nor_rejected():
    redundant, good = (1, 1.0, 0.576667), (1, 1.0, 0.815)
    assert T.is_chosen(good, False) and not T.is_chosen(redundant, False)
    assert T.rejection_type(redundant, good, False) is None
    assert T.build_pairs([good, redundant], single_hop=False) == []


def test_hard_rejection_needs_a_lower_outcome_and_process_and_is_not_for_single_hop():
    chosen = (1, 1.0, 0.8)
    assert T.rejection_type((1, 0.6, 0.7), chosen, False) == "hard"
    assert T.rejection_type((1, 0.6, 0.7), chosen, True) is None
    assert T.rejection_type((1, 0.75, 0.7), chosen, False) is None  # 0.75 > 1.0 - 0.3
    assert T.rejection_type((1, 0.6, 0.85), chosen, False) is None  # process above the chosen's
    assert T.rejection_type((1, 0.7, 0.8), chosen, False) == "hard"  # both bounds inclusive (1e-9 tolerance)


# --------------------------------------------------------------------------- losses [Eq. 4, 15-17]
def test_dpo_loss_on_known_log_probs():
    pi = torch.tensor([-10.0], requires_grad=True)
    loss, margin = T.dpo_loss(pi, torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.5]), beta=0.5)
    assert margin.item() == pytest.approx(0.75) and loss.item() == pytest.approx(0.386871, abs=1e-6)
    loss.sum().backward()
    assert pi.grad.item() == pytest.approx(-0.5 * 0.320821, abs=1e-6)  # dL/dmargin = -sigmoid(-0.75), times beta
    same = T.dpo_loss(torch.tensor([-3.0, -7.0]), torch.tensor([-5.0, -1.0]), torch.tensor([-3.0, -7.0]),
                      torch.tensor([-5.0, -1.0]), 0.5)[0]  # fmt: skip
    assert torch.allclose(same, torch.full((2,), math.log(2)))
    sft = T.sft_nll(torch.tensor([-6.0, -4.0]), 5)
    assert sft.item() == pytest.approx(2.0)  # token mean: 10 / 5
    for eta, total in ((1, 2.386871), (0.5, 1.386871), (0.25, 0.886871)):  # L_ALL [Eq. 17]
        assert eta * sft.item() + loss.item() == pytest.approx(total, abs=1e-6)


class Unigram(torch.nn.Module):
    """A stand-in LM whose next-token distribution is softmax(bias) at every position, whatever it reads."""

    def __init__(self, probs):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(probs).log())

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, -1))


@pytest.mark.parametrize("micro_batch_size", [4, 2, 1])
def test_ip_dpo_objective_and_gradient_are_the_same_for_any_micro_batch_size(micro_batch_size):
    """L_ALL [Eq. 17] on four pairs whose chosen paths have (sum log p, tokens) = (-10, 10), (-10, 10), (-50, 100),
    (-50, 100): L_SFT = 120 / 220 over the batch's chosen tokens at every micro-batch size (a token mean per
    micro-batch gave 0.75 at 2), L_DPO = log 2 at the reference, and the gradient in closed form."""
    from accelerate import Accelerator

    probs = [math.exp(-1), math.exp(-0.5), 1 - math.exp(-1) - math.exp(-0.5)]  # token 0 costs 1 nat, token 1 0.5
    short, long, rejected = ([2] + [0] * 10, [0] + [1] * 10), ([2] + [1] * 100, [0] + [1] * 100), ([2, 2], [0, 1])
    pairs = [(short, rejected), (short, rejected), (long, rejected), (long, rejected)]
    model = Unigram(probs)
    with torch.no_grad():  # the reference: the model itself (margin 0)
        ref = torch.stack([T.sequence_logps(model, list(pair), 2, "cpu")[0] for pair in pairs])
    assert ref[:, 0].tolist() == pytest.approx([-10, -10, -50, -50])
    args = SimpleNamespace(beta=0.5, micro_batch_size=micro_batch_size)
    stats = T.dpo_backward(Accelerator(cpu=True), model, pairs, ref, [0, 1, 2, 3], 1.0, args, 2)
    assert stats["sft"] == pytest.approx(120 / 220) and stats["dpo"] == pytest.approx(math.log(2))
    assert stats["all"] == pytest.approx(120 / 220 + math.log(2)) and stats["margin"] == 0.0
    # d/d bias of sum log p = counts - n p; L_SFT: -(chosen counts - 220 p) / 220; L_DPO: -sigmoid(0) beta times the
    # mean over pairs of (chosen counts - n p) - (rejected counts - p) = ([5, 50, 0] - 55 p) - ([0, 0, 1] - p)
    p = torch.tensor(probs)
    expected = (p - torch.tensor([20.0, 200, 0]) / 220) - 0.25 * (torch.tensor([5.0, 50, -1]) - 54 * p)
    assert torch.allclose(model.bias.grad, expected, atol=1e-5)


@pytest.fixture(scope="module")
def toy():
    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64", world=WORLD)
    T.add_format_tokens(model, tokenizer)
    return model.eval(), tokenizer


def test_format_tokens_are_single_tokens_and_decode_back(toy):
    _, tokenizer = toy
    for tag in (T.REF_OPEN, T.REF_CLOSE):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    text = tokenizer.decode(
        tokenizer(T.step_header(1, ["voben"], "voben born"), add_special_tokens=False)["input_ids"]
    )
    assert T.parse_header(text) == (1, ["voben"], "voben born") and text.endswith(T.REF_OPEN)
    assert tokenizer.unk_token_id not in tokenizer(T.FORMAT_WORDS, add_special_tokens=False)["input_ids"]


def test_sequence_logps_sums_the_next_token_log_probs_on_the_mask(toy):
    model, tokenizer = toy
    ids = tokenizer("voben was born in 1967 . golul", add_special_tokens=False)["input_ids"]
    mask = [0, 0, 1, 1, 0, 1, 1]
    with torch.no_grad():
        total, count = T.sequence_logps(model, [(ids, mask), (ids[:4], mask[:4])], tokenizer.pad_token_id, "cpu")
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    manual = sum(logp[j - 1, ids[j]].item() for j in range(1, len(ids)) if mask[j])  # token j predicted at j - 1
    assert total[0].item() == pytest.approx(manual, abs=1e-4) and count.tolist() == [4.0, 2.0]
    assert total[1].item() == pytest.approx(
        logp[1, ids[2]].item() + logp[2, ids[3]].item(), abs=1e-4
    )  # padding ignored


def test_sft_mask_is_zero_exactly_on_the_prompt_and_the_reference_blocks(toy):
    _, tokenizer = toy
    args = SimpleNamespace(augment_p=0.0, templates="compact")
    ctx = [{"kind": "chunk", "title": "voben", "text": "voben was born in 1967 ."}]
    segments = [(T.step_header(1, ["voben"], "voben born"), True), (T.reference_block(ctx), False),
                ("Summary: voben birth year 1967\n", True), ("Final answer: 1967", True)]  # fmt: skip
    ids, mask = T.sft_sequence(("what is the birth year of voben ?", segments), tokenizer, args, None, None)
    n_prompt = len(T.encode_prompts(tokenizer, ["what is the birth year of voben ?"], "compact")[0])
    open_at, close_at = (
        ids.index(tokenizer.convert_tokens_to_ids(T.REF_OPEN)),
        ids.index(tokenizer.convert_tokens_to_ids(T.REF_CLOSE)),
    )
    expected = (
        [0] * n_prompt + [1] * (open_at + 1 - n_prompt) + [0] * (close_at - open_at) + [1] * (len(ids) - close_at - 1)
    )
    assert mask == expected and ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    ctx2 = [{"kind": "chunk", "title": "golul", "text": "golul was born in 1921 . more words here ."}]
    example = ("what is the birth year of voben ?", [segments[0], (T.reference_block(ctx2), False), *segments[2:]])
    _, mask2 = T.sft_sequence(example, tokenizer, args, None, None)
    assert sum(mask2) == sum(mask)  # other evidence: the same trained tokens


# --------------------------------------------------------------------------- parsing, the format check [§4.2, Eq. 6]
GOOD = (
    "Step 1:\nImportant entity: A\nSubquery: who is A ?\n<Reference>\nEvidence 1: Triplet: A r B\n</Reference>\n"
    "Summary: A r B.\nStep 2:\nImportant entity: B; C\nSubquery: B and C ?\n<Reference>\nEvidence 1: x\n</Reference>\n"
    "Summary: so D.\nFinal answer: D"
)


def test_parse_path_of_a_valid_path():
    parsed = T.parse_path(GOOD)
    assert parsed["format_ok"] and parsed["answer"] == "D"
    assert parsed["steps"] == [{"entities": ["A"], "subquery": "who is A ?", "summary": "A r B."},
                               {"entities": ["B", "C"], "subquery": "B and C ?", "summary": "so D."}]  # fmt: skip
    toy_text = GOOD.lower().replace(":", " : ").replace("\n", " ").replace("<reference>", "<Reference>")
    assert T.parse_path(toy_text.replace("</reference>", "</Reference>"))["format_ok"]  # word-level decoding


@pytest.mark.parametrize("broken", [
    GOOD.replace("Summary: A r B.\n", ""),  # a missing summary
    GOOD.replace("Step 2:", "Step 3:"),  # non-consecutive step numbers
    GOOD + "\nStep 3: more",  # text after the final answer
    GOOD + "\nFinal answer: E",  # two final answers
    GOOD.replace("Final answer: D", "Final answer: "),  # an empty final answer
    GOOD.replace("Important entity: A", "Important entity: "),  # no entity
    "Final answer: D",  # no step
    "Some words. " + GOOD,  # text before the first step
    GOOD.replace("Summary: so D.\n", "Summary: so D.\n</Reference>"),  # a stray tag
    GOOD.rsplit("Summary: so D.", 1)[0],  # no final answer
])  # fmt: skip
def test_format_check_rejects_malformed_paths(broken):
    assert not T.parse_path(broken)["format_ok"]


def test_parse_header_reads_the_last_header_and_refuses_garbage():
    assert T.parse_header("Summary: x. Step 2: Important entity: a ;b Subquery: a b? <Reference>") == (
        2,
        ["a", "b"],
        "a b?",
    )
    assert T.parse_header("Step 1: Subquery: a <Reference>") is None
    assert T.parse_header("no header at all") is None


# --------------------------------------------------------------------------- the agent loop with a scripted LLM
class ScriptedSystem:
    """Stands in for the retrieval system: k_f fixed items per call, every call recorded."""

    def __init__(self):
        self.calls = []

    def retrieve(self, subqueries, entity_lists):
        self.calls.append((subqueries, entity_lists))
        item = lambda n: {"kind": "triplet", "id": n, "doc_id": "0", "head": "a", "relation": "r", "tail": f"t{n}"}
        return [[item(n) for n in range(5)] for _ in subqueries]


def scripted_generate(tokenizer, script, calls):
    """A generate() that continues each path with the next text of its script (one script per question)."""

    def fake(model, tok, prompts, max_new_tokens, seed=None, **kw):
        calls.append(len(prompts))
        texts, ids = [], []
        for prompt in prompts:
            n_turns = tok.decode(prompt).count("Reference>") // 2 + ("final answer" in tok.decode(prompt).lower())
            text = script(tok.decode(prompt), n_turns)
            texts.append(text)
            ids.append(
                tok(text, add_special_tokens=False)["input_ids"]
                + ([] if text.endswith(T.REF_OPEN) else [tok.eos_token_id])
            )
        return Generation(texts, ids, prompts, [True] * len(prompts))

    return fake


def loop_args(**kw):
    return SimpleNamespace(templates="compact", max_steps=5, max_new_tokens=40, temperature=1.0, **kw)


def test_rollout_retrieves_once_per_step_masks_the_evidence_and_stops_at_the_answer(toy, monkeypatch):
    model, tokenizer = toy
    script = ["Step 1: Important entity: voben Subquery: voben born <Reference>",
              "Summary: voben birth year 1967 . Step 2: Important entity: golul Subquery: golul born <Reference>",
              "Summary: golul birth year 1965 . Final answer: no"]  # fmt: skip
    calls = []
    monkeypatch.setattr(T, "generate", scripted_generate(tokenizer, lambda prompt, n: script[n], calls))
    system = ScriptedSystem()
    rows = [{"question": "was voben born before golul ?", "golden_answers": ["no"]}]
    paths = T.rollout(model, tokenizer, system, rows, loop_args(), n_samples=3, greedy=False)
    assert calls == [3, 3, 3]  # one batched generate per step for the 3 paths
    assert [c[0] for c in system.calls] == [["voben born"] * 3, ["golul born"] * 3]  # one retrieval per <Reference>
    assert system.calls[0][1] == [["voben"]] * 3
    p = paths[0]
    assert p.format_ok and p.answer == "no" and len(p.contexts) == 2 and p.text.count("Evidence 5:") == 2
    blocks = [tokenizer(T.reference_block(c), add_special_tokens=False)["input_ids"] for c in p.contexts]
    assert p.retrieved == sum(map(len, blocks)) and len(p.mask) == len(p.ids)
    assert sum(p.mask) == len(p.ids) - p.retrieved  # loss_mask: 1 exactly on the generated tokens
    start = p.ids.index(tokenizer.convert_tokens_to_ids(T.REF_OPEN)) + 1
    assert p.mask[start : start + len(blocks[0])] == [0] * len(blocks[0]) and p.mask[start - 1] == 1
    assert p.ids[start : start + len(blocks[0])] == blocks[0] and p.ids[-1] == tokenizer.eos_token_id


def test_rollout_never_retrieves_a_sixth_time_and_forces_the_answer(toy, monkeypatch):
    model, tokenizer = toy

    def script(prompt, n):
        if n == 6:
            return "1967"
        summary = "Summary: the last step found voben . " if n else ""
        return summary + f"Step {n + 1}: Important entity: voben Subquery: voben born <Reference>"

    calls = []
    monkeypatch.setattr(T, "generate", scripted_generate(tokenizer, script, calls))
    system = ScriptedSystem()
    row = {"question": "what is the birth year of voben ?", "golden_answers": ["1967"]}
    p = T.rollout(model, tokenizer, system, [row], loop_args(), greedy=True)[0]
    assert len(system.calls) == 5 and len(p.contexts) == 5
    assert p.answer == "1967" and not p.format_ok and p.forced
    assert "step 6" not in p.text.lower() and p.text.rstrip().endswith("1967")
    assert p.steps[-1]["summary"] == "the last step found voben ."  # the 6th header cut, the 5th summary whole
    forced = tokenizer("\nFinal answer:", add_special_tokens=False)["input_ids"]
    assert p.mask[-len(forced) - 2 : -2] == [0] * len(forced)  # written by the environment


def test_cut_step_cuts_before_the_sixth_step_header_not_at_the_word_step(toy):
    _, tokenizer = toy
    turn = "Summary: voben was born in 1967 ; the last step found makux . Step 6: Important entity: makux "
    ids = tokenizer(turn + "Subquery: makux city <Reference>", add_special_tokens=False)["input_ids"]
    kept, text = T.cut_step(ids, tokenizer)
    assert text == "summary : voben was born in 1967 ; the last step found makux ." and ids[: len(kept)] == kept
    no_header = tokenizer("Summary: voben . Subquery: makux city <Reference>", add_special_tokens=False)["input_ids"]
    assert T.cut_step(no_header, tokenizer)[1] == "summary : voben . subquery : makux city"  # before its <Reference>


def test_a_forced_answer_is_not_counted_as_thinking_tokens(toy, monkeypatch):
    """At the cap the environment writes "Final answer:" (loss_mask 0): thinking tokens are the model's [§5.3.2]."""
    model, tokenizer = toy
    script = lambda prompt, n: (
        "1967" if n == 6 else f"Step {n + 1}: Important entity: voben Subquery: voben born <Reference>"
    )
    monkeypatch.setattr(T, "generate", scripted_generate(tokenizer, script, []))
    row = {"question": "what is the birth year of voben ?", "golden_answers": ["1967"]}
    p = T.rollout(model, tokenizer, ScriptedSystem(), [row], loop_args(), greedy=True)[0]
    forced = len(tokenizer("\nFinal answer:", add_special_tokens=False)["input_ids"])
    record = T.path_record(p)
    assert p.forced and record["thinking_tokens"] == record["generated_tokens"] == sum(p.mask)
    assert record["thinking_tokens"] == len(p.ids) - p.retrieved - forced and record["total_tokens"] == len(p.ids)


def test_rollout_ends_a_path_whose_header_does_not_parse(toy, monkeypatch):
    model, tokenizer = toy
    monkeypatch.setattr(T, "generate", scripted_generate(tokenizer, lambda prompt, n: "Subquery: x <Reference>", []))
    system = ScriptedSystem()
    p = T.rollout(model, tokenizer, system, [{"question": "q ?", "golden_answers": ["a"]}], loop_args())[0]
    assert system.calls == [] and not p.format_ok and p.done


# --------------------------------------------------------------------------- the retrieval system on the toy world
@pytest.fixture(scope="module")
def system():
    (args,) = runs.flag_parser(T.Args).parse_args_into_dataclasses(args=[])
    return T.RetrievalSystem(T.apply_preset(args))


def test_retrieval_invariants_on_the_toy_world(system, monkeypatch):
    queries = []
    search = system.entities.search
    monkeypatch.setattr(system.entities, "search", lambda qs, k: queries.extend(qs) or search(qs, k))
    (ctx,) = system.retrieve(["dites born"], [["dites"]])
    assert queries == ["Key entity: dites. Query: dites born."]  # [§4.2.3] verbatim
    assert len(ctx) == 5 and {it["kind"] for it in ctx} == {"chunk", "triplet"}
    assert ctx[0]["kind"] == "chunk" and ctx[0]["title"] == "dites"  # the gold passage, its triplets next
    assert any(it["kind"] == "triplet" and it["head"] == "dites" and it["tail"] == "makux" for it in ctx)
    for mode, n in (("semantic", 5), ("graph", 5), ("concat", 10)):
        monkeypatch.setattr(system.args, "retrieval", mode)
        (ctx,) = system.retrieve(["dites born"], [["dites"]])
        assert len(ctx) == n and (mode != "semantic" or {it["kind"] for it in ctx} == {"chunk"})


def test_lexical_reranker_logit_is_8_f1_minus_4_of_idf_weighted_content_words(system):
    pairs = [
        ("dites born", "dites was born in makux ."),
        ("dites born", "dites was born in makux . dites was born in 1952 ."),
        ("dites born", "sokor is a city in lolas ."),
        ("", "anything"),
        ("who is dites", "dites"),
    ]
    logits = system.rerank(pairs)
    idf = system.rerank.idf
    d, b, m = idf["dites"], idf["born"], idf["makux"]
    assert logits[0] == pytest.approx(8 * 2 * (d + b) / (2 * (d + b) + m) - 4)  # stopwords (was, in) ignored
    assert logits[1] < logits[0] and logits[2] == logits[3] == -4.0 and logits[4] == pytest.approx(4.0)
    assert T.sigmoid(logits).min() > 0.017 and T.sigmoid(logits).max() < 0.983


def test_golden_evidence_is_the_supporting_passages():
    docs = {"1": {"title": "dites", "text": "dites was born in makux . dites was born in 1952 ."},
            "2": {"title": "makux", "text": "makux is a city in rusu ."}}  # fmt: skip
    meta = {"hops": 2, "supporting_doc_ids": ["1", "2"], "sub_answers": ["makux", "vopa"]}
    row = {"question": "in which country was dites born ?", "metadata": meta}
    passages = ["dites dites was born in makux . dites was born in 1952 .", "makux makux is a city in rusu ."]
    assert T.golden_evidence(row, docs) == passages
    assert T.golden_evidence({**row, "metadata": {**meta, "hops": 1}}, docs) == []  # single-hop rule


def test_golden_evidence_skips_a_supporting_passage_missing_from_the_corpus():
    docs = {"1": {"title": "makux", "text": "voben was born in makux . makux is a city in rusu ."},
            "2": {"title": "rusu", "text": "rusu is a country . the capital of rusu is kovik ."}}  # fmt: skip
    meta = {"hops": 3, "supporting_doc_ids": ["0", "1", "2"], "sub_answers": ["makux", "rusu", "kovik"]}
    # hop 1's passage "0" is not in the corpus: hops 2 and 3 keep theirs
    assert T.golden_evidence({"metadata": meta}, docs) == [T.item_text(docs["1"]), T.item_text(docs["2"])]


def item_ends(item):
    return (item["head"], item["tail"])


def test_sft_paths_follow_the_decomposition(system):
    """(1)-(5) of §4.3.1; with the toy preset's 3 retrieved distractors per context (ours)."""
    rows = [json.loads(line) for line in (WORLD / "train.jsonl").open()][:40]
    row = next(r for r in rows if r["metadata"]["type"] == "two_hop" and r["metadata"]["answerable"])
    steps = T.sft_steps(row, system, __import__("random").Random(0))
    m = row["metadata"]
    assert [s["subquery"] for s in steps] == m["sub_queries"] and [s["answer"] for s in steps] == m["sub_answers"]
    assert steps[0]["entities"] == [m["entities"][0]] and steps[1]["entities"] == [m["entities"][1]]
    for s, doc, answer in zip(steps, m["supporting_doc_ids"], m["sub_answers"]):
        gold = [
            it for it in s["context"] if it["doc_id"] == doc and (it["kind"] == "chunk" or answer in item_ends(it))
        ]
        assert [it["kind"] for it in gold].count("chunk") == 1 and len(gold) >= 2  # the passage and its triplet(s)
        assert len(s["context"]) - len(gold) <= 3 and len({(it["kind"], it["id"]) for it in s["context"]}) == len(
            s["context"]
        )
        assert s["summary"].endswith(f"{answer}.") and all(
            f"{T.item_text(t)}" in s["summary"] for t in gold if t["kind"] == "triplet"
        )
    args = SimpleNamespace(sft_single_steps=True)
    examples = T.sft_examples([row], system, args, __import__("random").Random(0))
    assert [e[0] for e in examples] == [row["question"], *m["sub_queries"]]  # the path, then each step as 1-hop
    assert [text[:7] for text, _ in examples[0][1]].count("Step 3:") == 0 and len(examples[0][1]) == 7


def test_sft_summaries_use_every_template(system):
    """§4.3.1 (5): the SFT summaries are drawn from all of SUMMARIES (the paper's "diverse templates")."""
    rows = [json.loads(line) for line in (WORLD / "train.jsonl").open()][:60]
    opening = lambda summary: next(i for i, t in enumerate(T.SUMMARIES) if summary.startswith(t.split("{")[0]))
    steps = [s for row in rows for s in (T.sft_steps(row, system, __import__("random").Random(0)) or [])]
    assert len(steps) >= 30 and {opening(s["summary"]) for s in steps} == {0, 1, 2}


def test_a_whole_paths_last_summary_implies_the_questions_answer(system):
    """Tab. 11: the last summary implies the answer that the path then gives. A comparison's answer is no step's: its
    whole path's last summary keeps that step's facts and template and concludes with the question's answer; the first
    summary and each step as a 1-hop question conclude with their step's answer; a chain's summaries are its steps'."""
    from random import Random

    rows = [json.loads(line) for line in (WORLD / "train.jsonl").open()]
    for kind in ("yes_no", "comparison", "two_hop"):
        row = next(r for r in rows if r["metadata"]["type"] == kind and T.sft_steps(r, system, Random(0)))
        golden, subs = row["golden_answers"][0], row["metadata"]["sub_answers"]
        steps = T.sft_steps(row, system, Random(0))
        examples = T.sft_examples([row], system, SimpleNamespace(sft_single_steps=True), Random(0))
        summaries = [[text for text, _ in segments if text.startswith("Summary:")] for _, segments in examples]
        assert (golden == subs[-1]) == (kind == "two_hop") and len(summaries) == 3
        assert summaries[0][0] == f"Summary: {steps[0]['summary']}\n" and steps[0]["summary"].endswith(f": {subs[0]}.")
        assert summaries[0][1].endswith(f": {golden}.\n") and steps[1]["facts"] in summaries[0][1]
        assert summaries[0][1].startswith(f"Summary: {steps[1]['template'].split('{')[0]}")
        assert summaries[1:] == [[f"Summary: {s['summary']}\n"] for s in steps]  # the steps as 1-hop questions
        assert all(s["summary"].endswith(f": {a}.") for s, a in zip(steps, subs))


def test_the_toy_oracle_ends_a_comparisons_last_summary_with_its_answer():
    """The rehearsal's policy writes the same paths: the first summary ends with the first year, the last (Tab. 11)
    with the comparison's answer, which the final answer repeats; a chain's last summary ends with its tail."""
    from common.toy.tearag import oracle_tearag

    rows = [json.loads(line) for line in (WORLD / "train.jsonl").open()]
    passages = {d["id"]: d["contents"] for d in map(json.loads, (WORLD / "corpus.jsonl").open())}
    for kind in ("yes_no", "comparison", "two_hop"):
        row = next(r for r in rows if r["metadata"]["type"] == kind and r["metadata"]["answerable"])
        golden, subs, docs = (
            row["golden_answers"][0],
            row["metadata"]["sub_answers"],
            row["metadata"]["supporting_doc_ids"],
        )
        path = ""
        for doc in docs:
            path += oracle_tearag(row, path) + f"\nEvidence 1: {passages[str(doc)]}\n</Reference>\n"
        turn = oracle_tearag(row, path)
        summaries = re.findall(r"answer: (\S+)\.\n", path + turn)
        assert (golden == subs[-1]) == (kind == "two_hop") and summaries == [subs[0], golden]
        assert turn.endswith(f"Final answer: {golden}")


def test_the_toy_curriculum_takes_its_types_a_share_of_the_sft_steps_and_its_rate():
    """The toy SFT's first stage (header item 13): the paths of the curriculum's types alone, built with the run's
    seed; share x sft_steps rounded, its own learning rate; the toy preset's 2/3 of 900 steps on comparison and yes/no
    paths; no path, no step."""
    import random
    from dataclasses import replace

    from common.toy.tearag import curriculum

    rows = [{"metadata": {"type": t}, "id": i} for i, t in enumerate(["one_hop", "comparison", "yes_no", "two_hop"])]
    build = lambda rows, rng: [(r["id"], rng.random()) for r in rows]
    args = T.apply_preset(runs.parse_args(T.Args, ["--train", "--seed", "3"], method="tearag"))
    first, stage = curriculum(args, rows + [{"question": "no metadata"}], build)
    assert first == build(rows[1:3], random.Random(3)) and (stage.sft_steps, stage.sft_lr) == (600, 1e-3)
    assert (args.sft_steps, args.sft_lr) == (900, 2e-3)  # the whole mix's stage keeps its own
    first, stage = curriculum(replace(args, sft_curriculum="two_hop:1/2:0.5", sft_steps=5, sft_lr=1.0), rows, build)
    assert [i for i, _ in first] == [3] and (stage.sft_steps, stage.sft_lr) == (2, 0.5)  # round(2.5): even
    assert curriculum(replace(args, sft_curriculum="three_hop:1/2:0.5"), rows, build)[1].sft_steps == 0


# --------------------------------------------------------------------------- the knowledge graph's triplets [§4.1]
def test_parse_triplets_reads_what_a_chat_model_writes():
    """After the <think> block (its "x; y; z" is no triplet), numbered or bulleted lines with or without <>, two on
    a line; a repeat in other case and spacing kept once as first written; two parts, the echoed format: dropped."""
    reply = """<think>The passage says x; y; z about the film.</think>
Here are the triplets:
1. <Sutisek; directed by; Fukix>
- < sutisek ;  Directed   by ; FUKIX >
* Bipes; released in; 1973
2) <Pudus; born in>
<head entity; relation; tail entity>
<Pudus; born in; Sokor> <Pudus; born in; 1947>"""
    assert T.parse_triplets(reply) == [("Sutisek", "directed by", "Fukix"), ("Bipes", "released in", "1973"),
                                       ("Pudus", "born in", "Sokor"), ("Pudus", "born in", "1947")]  # fmt: skip
    assert T.parse_triplets("<think>cut short: <a; b; c>") == []  # a reply cut inside its thinking
    assert T.parse_triplets("a;b;c\n\n**x ; y ; z**") == [("a", "b", "c"), ("x", "y", "z")]


class Extractor:
    """A frozen LLM that names each chunk it is asked about, and breaks down (a kill) on call `fail_at`."""

    def __init__(self, fail_at=None):
        self.asked, self.calls, self.fail_at = [], 0, fail_at

    def chat(self, chats, temperature, max_tokens):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt
        titles = [re.search(r"^Title: (.*)$", c[-1]["content"], re.M)[1] for c in chats]
        self.asked += titles
        return [
            f"<think>one fact</think>\n1. <{t}; title of; chunk>\n2. <{t.upper()}; title  of; Chunk>" for t in titles
        ]


def test_extraction_keeps_each_chunk_id_and_resumes_after_a_kill(tmp_path, monkeypatch):
    """Batches of 2 over 5 chunks: killed in its second batch, the run leaves the first batch in the part file (and a
    torn line); the rerun asks only the 3 chunks left, writes one triplet a chunk in corpus order with the chunk's
    id, removes the parts, and the graph loads it."""
    corpus, out = tmp_path / "corpus.jsonl", tmp_path / "kg" / "triples.jsonl"
    out.parent.mkdir()
    docs = [{"id": str(10 + i), "contents": f'"chunk {i}"\nchunk {i} says something.'} for i in range(5)]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    flags = ["--extract_triples", "hf:any", "--corpus", str(corpus), "--triples", str(out), "--data_dir", str(WORLD)]
    first, second = Extractor(fail_at=2), Extractor()
    for llm in (first, second):
        monkeypatch.setattr(T, "make_llm", lambda spec, **kw: llm)
        try:
            T.extract_triples(runs.parse_flags(T.Args, flags, T.PRESETS), batch_size=2)
        except KeyboardInterrupt:
            assert not out.exists() and [p.name for p in out.parent.iterdir()] == ["triples.jsonl.part0"]
            with (out.parent / "triples.jsonl.part0").open("a") as f:
                f.write('\n{"doc_id": "12", "trip')  # a line the kill tore
    assert first.asked == ["chunk 0", "chunk 1"] and second.asked == ["chunk 2", "chunk 3", "chunk 4"]  # each once
    rows = T.read_jsonl(out)
    assert rows == [{"doc_id": str(10 + i), "head": f"chunk {i}", "relation": "title of", "tail": "chunk"}
                    for i in range(5)]  # fmt: skip
    assert [p.name for p in out.parent.iterdir()] == ["triples.jsonl"]
    kg = T.KnowledgeGraph(out)
    assert [t["id"] for t in kg.by_doc["12"]] == [2] and kg.by_entity["chunk"] == [0, 1, 2, 3, 4]


def test_extraction_through_an_endpoint_gives_the_graph_tearag_loads(tmp_path):
    """--extract_triples on the endpoint of tests/real_data.py (a <think> block, numbering, a repeat, a malformed line
    in each reply): every chunk asked once, each invented fact once, from the chunk that states it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import real_data

    real_data.write_folder(tmp_path)
    out = tmp_path / "graph.jsonl"
    with real_data.chat_stub() as stub:
        T.main(["--extract_triples", stub.url, "--model", "Qwen/Qwen2.5-14B-Instruct", "--preset", "paper",
                "--data_dir", str(tmp_path), "--triples", str(out)])  # fmt: skip
    chunks = T.read_jsonl(tmp_path / "corpus.jsonl")
    assert stub.calls == {"Extract the knowledge triplets": len(chunks)} and stub.models == {
        "Qwen/Qwen2.5-14B-Instruct"
    }
    key = lambda row: tuple(row.values())
    assert sorted(T.read_jsonl(out), key=key) == sorted(real_data.triples(chunks), key=key)  # as written by hand
    assert len(T.KnowledgeGraph(out).triplets) == 72


@pytest.mark.parametrize(
    "spec,needle", [("toy", "toy: data/toy ships its graph"), ("http://127.0.0.1:9/v1", "--model")]
)
def test_extraction_refuses_the_toy_reader_and_an_unnamed_endpoint_in_one_line(spec, needle):
    with pytest.raises(T.UserError, match=re.escape(needle)):
        T.main(["--extract_triples", spec])


def test_extraction_is_a_mode_of_its_own():
    with pytest.raises(SystemExit, match="--extract_triples is a mode of its own"):
        T.main(["--extract_triples", "hf:some/model", "--train"])


# --------------------------------------------------------------------------- departures from the paper, marked
def test_every_departure_is_listed_in_the_header_and_marked_where_it_lives():
    """Each numbered header item is cited by a `(header item N)` mark, and every mark names a listed item; the
    departures of both presets come first, the toy-world adaptations after them, numbered on; among them
    the token-mean SFT losses (Eq. 4, 15 sum), the rule-chosen supporting triplets and the entities the subquery names
    (§4.3.1: an LLM's choice, all their entities), passage evidence for HotpotQA, the toy's compact template."""
    source = (ROOT / "tearag.py").read_text()
    items = dict(re.findall(r"^(\d+)\. (.*)$", T.__doc__, re.M))
    marks = set(re.findall(r"\(header item (\d+)\)", source))
    assert marks == set(items), (sorted(marks), sorted(items))
    departures, toy = (re.findall(r"^(\d+)\. (.*)$", part, re.M) for part in T.__doc__.split("Toy-world adaptations"))
    assert [int(n) for n, _ in departures + toy] == list(range(1, len(items) + 1))  # two lists, numbered on
    assert toy and all(item.startswith("Toy") for _, item in toy), toy  # what only the toy world changes, apart
    assert not any(item.startswith("Toy") for _, item in departures), departures
    header = " ".join(items.values())
    for needle in ("token means", "Eq. 4/15's sums", "Qwen2.5-72B", "that the subquery names", "evidence sentences",
                   "compact template"):  # fmt: skip
        assert needle in header, needle
    assert not re.search(r"spec\s*§|spec \[R\]|the spec's", source)  # users have the paper, not the spec


# --------------------------------------------------------------------------- the CLI end to end (tier 1)
TINY = [
    "--n_dpo",
    "6",
    "--n_rollouts",
    "2",
    "--n_eval",
    "12",
    "--rounds",
    "1",
    "--rollout_batch",
    "6",
    "--max_new_tokens",
    "32",
]  # fmt: skip  (--eta, --dpo_epochs: the first of the default lists)


def run(*argv, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "tearag.py"), *argv], cwd=cwd, capture_output=True, text=True, check=False
    )


def test_train_on_a_fresh_world_then_eval_and_ask(tmp_path):
    """--train on a world written by python -m common.toy --seed 3: the SFT model writes well-formed paths, the raw
    start does not; the contract, the table, the checkpoint; then --eval (a Table 7 variant) and --ask on it."""
    world = tmp_path / "world3"
    subprocess.run(
        [sys.executable, "-m", "common.toy", "--seed", "3", "--out", str(world)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    out = tmp_path / "run"
    tiny_sft = ["--sft_steps", "150"]  # 150 steps teach the format (the toy preset: no redundant steps)
    result = run("--train", "--data_dir", str(world), "--output_dir", str(out), *tiny_sft, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    results = check_contract(out, result.stdout)
    assert results["method"] == "tearag" and results["train_steps"]["sft"] == 150 and results["dataset"] == str(world)
    assert results["before"]["format"] > results["before_sft"]["format"] and results["before"]["retrievals"] > 0
    end = result.stdout.strip().splitlines()[-13:]  # the table, the paths, RESULT: the last lines
    assert end[0].split() == ["start", "before", "after"] and [r.split()[0] for r in end[1:9]] == list(T.ROWS)
    assert end[9:12] == [f"results: {out / 'results.json'}", f"checkpoint: {out / 'dpo'}",
                         f"predictions: {out / 'predictions_dpo.jsonl'}"]  # fmt: skip
    assert results["args"]["eta"] == "1" and results["args"]["dpo_epochs"] == "1"  # the first of the default lists
    state = json.loads((out / "dpo" / "run_state.json").read_text())
    assert (state["method"], state["world"]) == ("tearag", str(world))  # the checkpoint names its method and world
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").open() if '"round"' in line]
    assert rounds and "rollout/steps" in rounds[0] and "pairs" in rounds[0]
    for n_eval in (4, 3):  # two evaluations of one checkpoint: two folders, the first kept
        ev = run("--eval", "--model", str(out / "dpo"), "--n_eval", str(n_eval), "--max_new_tokens", "24",
                 "--retrieval", "semantic")  # fmt: skip
        assert ev.returncode == 0, ev.stderr[-3000:]
        folder = Path(re.search(r"^evaluation folder: (.*)$", ev.stdout, re.M)[1])
        assert folder.parent == out / "dpo" / "eval" and folder.name.startswith(world.name + "-")
        assert check_contract(folder, ev.stdout)["n_eval"] == n_eval  # the checkpoint remembers its world
    assert sorted(json.loads((f / "results.json").read_text())["n_eval"] for f in folder.parent.iterdir()) == [3, 4]
    question = json.loads((world / "test.jsonl").open().readline())["question"]
    ask = run("--ask", question, "--model", str(out / "dpo"), "--max_new_tokens", "24")
    assert ask.returncode == 0 and "answer:" in ask.stdout and "warning" not in ask.stdout, ask.stderr[-3000:]


def test_eval_on_a_flashrag_folder_without_metadata(tmp_path):
    data = tmp_path / "flat"
    data.mkdir()
    for name in ("corpus.jsonl", "triples.jsonl"):
        (data / name).write_text((WORLD / name).read_text())
    rows = [json.loads(line) for line in (WORLD / "test.jsonl").open()][:3]
    (data / "test.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("id", "question", "golden_answers")}) + "\n" for r in rows)
    )
    out = tmp_path / "ev"
    result = run(
        "--eval", "--model", "toy-lm", "--data_dir", str(data), "--output_dir", str(out), "--max_new_tokens", "8"
    )
    # toy-lm takes its vocabulary from a toy world: a folder without one is a one-line user error
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "world" in result.stderr
    ckpt = tmp_path / "ckpt"
    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64", world=WORLD)
    T.add_format_tokens(model, tokenizer)
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    result = run(
        "--eval", "--model", str(ckpt), "--data_dir", str(data), "--output_dir", str(out), "--max_new_tokens", "8"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_contract(out, result.stdout)["n_eval"] == 3
    tiny = ["--model", "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64", "--world", str(WORLD)]
    result = run(
        "--eval", "--data_dir", str(data), "--output_dir", str(tmp_path / "w"), "--max_new_tokens", "8", *tiny
    )
    assert result.returncode == 0, result.stderr[-3000:]  # --world: the toy model's vocabulary for one's own questions
    assert check_contract(tmp_path / "w", result.stdout)["n_eval"] == 3
    (data / "train.jsonl").write_text((data / "test.jsonl").read_text())
    result = run("--train", "--data_dir", str(data), "--output_dir", str(tmp_path / "t"), *tiny)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert "sub_queries, sub_answers and supporting_doc_ids" in result.stderr  # SFT's fields, before any model loads
    assert "raw start" not in result.stdout


@pytest.mark.parametrize("argv,needle", [(["--train", "--eta", "1,2"], "--eta needs 3"),
                                         (["--eval", "--triples", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
                                         (["--train", "--preset", "nope"], "--preset"),
                                         (["--train", "--dry_run", "--n_rollouts", "-2"], "--n_rollouts -2: must be"),
                                         (["--train", "--dry_run", "--retrieval", "fancy"], "--retrieval"),
                                         (["--train", "--eval", "--dry_run"], "choose one mode: --train"),
                                         (["--train", "--dry_run", "--eta", "x", "--dpo_epochs", "1.5,2", "--beta",
                                           "0"], "--beta 0.0: must be > 0; --dpo_epochs needs 3 comma-separated "
                                          "numbers (one per round), got '1.5,2'; --eta 'x': comma-separated numbers"),
                                         (["--eval", "--data_dir", "BAD"], "test.jsonl:2: not valid")])  # fmt: skip
def test_user_errors_end_in_one_line(tmp_path, argv, needle):
    """A mistake is one line naming the flag (every problem of the per-round lists and numbers at once), exit 2."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "test.jsonl").write_text('{"id": "1", "question": "q ?", "golden_answers": ["a"]}\n{"id": "2", "quest\n')
    result = run(*[str(bad) if a == "BAD" else a for a in argv], "--output_dir", str(tmp_path / "x"))
    assert result.returncode == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr[-2000:]
    )


def test_per_round_lists_take_the_first_rounds_values():
    """--rounds 1 runs the first round of the default schedules (eta 1,0.5,0.25; the preset's epochs); a longer list is
    cut, a shorter one refused."""
    parse = lambda *argv: T.apply_preset(runs.parse_args(T.Args, ["--train", *argv], method="tearag"))
    assert (parse("--rounds", "1").eta, parse("--rounds", "1").dpo_epochs) == ("1", "1")
    args = parse("--preset", "paper", "--rounds", "2", "--data_dir", str(WORLD))
    assert (args.eta, args.dpo_epochs) == ("1,0.5", "2,2")  # §5.1.3's first two rounds
    assert (parse("--rounds", "0").eta, parse("--rounds", "4", "--eta", "1,1,1,1", "--dpo_epochs", "3,2,1,1").eta) == (
        "",
        "1,1,1,1",
    )
    with pytest.raises(T.UserError, match=r"^--dpo_epochs needs 4 comma-separated numbers \(one per round\)"):
        parse("--rounds", "4", "--eta", "1,1,1,1")


def test_a_checkpoint_of_another_method_is_refused_in_one_line(tmp_path):
    (tmp_path / runs.STATE).write_text(json.dumps({"method": "sparkle", "data_dir": str(WORLD), "args": {}}))
    with pytest.raises(SystemExit, match=f"^--model {tmp_path} is a sparkle checkpoint, not a tearag one$"):
        T.main(["--eval", "--model", str(tmp_path)])


def test_every_progress_bar_is_a_runs_progress_bar():
    """runs.progress writes a line every 30 s at most to a log; a bare tqdm would write one per step."""
    source = (ROOT / "tearag.py").read_text()
    assert "tqdm" not in source and source.count("runs.progress(") == 4
    assert "refresh=False" in source  # set_postfix would redraw the bar every step


def test_a_round_without_pairs_warns_and_the_sft_loss_is_logged(tmp_path):
    """Two SFT steps teach no format: the round builds 0 pairs, which a warning line and results.json say; the SFT
    loss of each step is in metrics.jsonl and tensorboard's events under the run folder."""
    out = tmp_path / "run"
    result = run("--train", "--output_dir", str(out), "--sft_steps", "2", "--n_dpo", "4", "--n_rollouts", "2",
                 "--n_eval", "4", "--rounds", "1", "--max_new_tokens", "8", "--report_to", "tensorboard")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = check_contract(out, result.stdout)
    assert results["rounds"][0]["pairs"] == 0 and results["train_steps"] == {"curriculum": 1, "sft": 2, "dpo": 0}
    assert results["warnings"] == ["IP-DPO round 1: 0 preference pairs"]
    assert "warning: IP-DPO round 1 trained on nothing (0 preference pairs)" in result.stdout.splitlines()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [m["sft/step"] for m in logged if "sft/loss" in m] == [1, 2]
    assert [m["curriculum/step"] for m in logged if "curriculum/loss" in m] == [1]  # the toy curriculum: 2/3 of 2
    first = int(re.search(r"^curriculum: (\d+) paths of comparison,yes_no first$", result.stdout, re.M)[1])
    every = int(re.search(r"^SFT: (\d+) paths from", result.stdout, re.M)[1])
    assert 0 < first < every / 2  # the curriculum trains on its types' paths alone, not the whole mix
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))


def test_the_smoke_command_of_the_docs_lowers_the_sft_loss(tmp_path):
    """The command of docs/tearag.md's "Smoke test", as written (its own run folder added): the SFT loss it prints
    falls to under half of its first value; the run ends with the result contract."""
    docs = (ROOT / "docs" / "tearag.md").read_text()
    command = re.search(r"## Smoke test.*?```bash\n(python tearag.py [^\n]*)\n```", docs, re.S)[1].split()
    result = run(*command[2:], "--output_dir", str(tmp_path / "smoke"))
    assert result.returncode == 0, result.stderr[-3000:]
    check_contract(tmp_path / "smoke", result.stdout)
    losses = [float(x) for x in re.findall(r"^sft/step=\d+ \| sft/loss=([\d.]+)$", result.stdout, re.M)]
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0], losses
