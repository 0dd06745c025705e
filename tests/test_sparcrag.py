"""SPARC-RAG: hand-worked numbers (parsers, SelectBest mapping, recall and Jaccard, preference pairs with the lambda
weighting, the weighted DPO loss and its gradient, the masked sequence log-prob), Algorithm 1 with a scripted backbone
on the paper's Anticimex case (App. C.5: branch isolation, the merge as the only write, STOP / depth cap / fixed depth,
calls and tokens per round), the naive baselines (bench/compare.py), the toy teacher, and end-to-end toy runs."""

import itertools
import json
import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import check_contract

import sparcrag
from common.toy import sparcrag as toy
from sparcrag import CONTINUE, STOP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import compare  # noqa: E402  (the naive baselines of App. A.5)


# ---------------------------------------------------------------- parsing (App. D's output formats)
def test_parse_rewrites_of_a_think_block_and_items_and_padding():
    text = (
        '<think>EQT is the parent.</think><queries><item rank="1"><strategy>bm25</strategy>\n'
        '<query>Anticimex parent company</query>\n</item><item rank="2"><strategy>Dense</strategy>\n'
        "<query>EQT headquarters</query>\n</item></queries>"
    )
    assert sparcrag.parse_rewrites(text, 2, "q0") == [
        ("bm25", "Anticimex parent company"),
        ("dense", "EQT headquarters"),
    ]
    assert sparcrag.parse_rewrites("no items at all", 2, "q0") == [("dense", "q0"), ("dense", "q0")]
    assert sparcrag.parse_rewrites("no items at all", 2) == []  # no fallback: an unparsed set retrieves nothing
    assert sparcrag.parse_rewrites(text, 1, "q0") == [("bm25", "Anticimex parent company")]  # the first W kept
    assert sparcrag.parse_rewrites(text, 3, "q0")[2] == ("dense", "q0")  # padded to exactly W


def test_parse_rewrites_placeholder_strategy_rank_order_duplicates_and_toy_spacing():
    items = [("bm25|dense", "a"), ("bm25", "b"), ("bm25", "b"), ("bm25", " "), ("dense", "b")]
    text = "<queries>" + "".join(
        f'<item rank="{5 - i}"><strategy>{s}</strategy><query>{q}</query></item>' for i, (s, q) in enumerate(items)
    )
    # sorted by rank (5 - i): dense b, (empty dropped), bm25 b, bm25 b (repeat dropped), the placeholder -> dense a
    assert sparcrag.parse_rewrites(text, 4) == [("dense", "b"), ("bm25", "b"), ("dense", "a")]
    decoded = '< queries > < item rank = " 1 " > < strategy > bm25 < / strategy > < query > velbo born < / query >'
    decoded += ' < / item > < / queries > [ end ] < item rank = " 2 " > < query > after end < / query > < / item >'
    assert sparcrag.parse_rewrites(decoded, 2, "q") == [("bm25", "velbo born"), ("dense", "q")]  # cut at [END]
    assert sparcrag.format_rewrites([("bm25", "x y"), ("dense", "z")]).endswith("</queries> [END]")
    assert sparcrag.parse_rewrites(sparcrag.format_rewrites([("bm25", "x y"), ("dense", "z")]), 2) == [
        ("bm25", "x y"),
        ("dense", "z"),
    ]


@pytest.mark.parametrize(
    "text, decision",
    [
        ("The answer is grounded. <decision>stop</decision>", STOP),
        ("I will not STOP yet. CONTINUE", CONTINUE),
        ("", CONTINUE),
        ("<decision>STOP</decision> on reflection <decision>CONTINUE</decision>", CONTINUE),
        ("< decision > stop < / decision > [ end ]", STOP),
        ("stopping is premature", CONTINUE),  # no bare word: never a stop by default
        ("CONTINUE [END] <decision>STOP</decision>", CONTINUE),  # what follows [END] is not the decision
        ("<think> the note states it , so STOP", CONTINUE),  # cut inside its <think> block by the token cap
        ("<think> STOP or not ? </think> the note lacks it . <decision>CONTINUE</decision> [END]", CONTINUE),
    ],
)
def test_parse_decision(text, decision):
    assert sparcrag.parse_decision(text) == decision


@pytest.mark.parametrize(
    "answers, decisions, text, k",
    [
        (["EQT", "Stockholm"], [CONTINUE, STOP], "So ... <answer> stockholm. </answer>", 1),
        (["EQT", "Stockholm"], [CONTINUE, CONTINUE], "<answer>Stockholm, Sweden</answer>", 1),  # F1 0 and 0.667
        (["EQT", "Oslo"], [CONTINUE, STOP], "<answer>Paris</answer>", 1),  # all F1 0: the first STOP branch
        (["EQT", "Oslo"], [CONTINUE, CONTINUE], "<answer>Paris</answer>", 0),
        (["EQT", "EQT"], [STOP, STOP], "<answer>EQT</answer>", 0),  # the lowest index
        (["EQT", "Stockholm"], [STOP, STOP], "<answer>EQT</answer> no: <answer>Stockholm</answer> [END]", 1),
        (["EQT", "Stockholm"], [STOP, STOP], "stockholm [END] <answer>EQT</answer>", 1),  # no tag before [END]
        (["", "Stockholm"], [CONTINUE, STOP], "", 1),  # an empty selection names no branch: the first STOP
        (["EQT", "Stockholm"], [CONTINUE, STOP], "<think> <answer>EQT</answer> ? the note", 1),  # cut in <think>
    ],
)
def test_select_branch(answers, decisions, text, k):
    assert sparcrag.select_branch(text, answers, decisions) == k


def test_strip_end_clean_answer_and_confidence():
    assert sparcrag.strip_end("<think>hmm [x]</think> note text [END] ignored") == "note text"
    assert sparcrag.strip_end("<think> never closed [END]") == ""
    assert sparcrag.clean_answer("\n  Stockholm \nSweden [END]") == "Stockholm"
    assert sparcrag.clean_answer("tuvia [ end ]") == "tuvia"
    assert [compare.parse_confidence(sparcrag, t) for t in ("0.85 [END]", "1.0", "7", "sure", ".5")] == [
        0.85,
        1.0,
        1.0,
        0.0,
        0.5,
    ]


# ---------------------------------------------------------------- metrics (§4.1, App. B.2)
def test_recall_jaccard_and_correctness():
    assert sparcrag.paragraph_recall(["p1", "p3", "p4"], ["p1", "p2"]) == 0.5
    assert sparcrag.paragraph_recall(["p1"], []) is None  # no gold: skipped, never divided by zero
    assert sparcrag.paragraph_recall([3, 7], ["3"]) == 1.0  # ids compared as strings
    assert sparcrag.jaccard_avg([{"p1", "p3"}, {"p1", "p4"}]) == pytest.approx(1 / 3)
    assert sparcrag.jaccard_avg([{"p1", "p3"}, {"p2", "p5"}]) == 0
    assert sparcrag.jaccard_avg([{"p1", "p3"}, {"p1", "p4"}, {"p2", "p5"}]) == pytest.approx(0.1111, abs=1e-4)
    assert sparcrag.jaccard_avg([{"p1"}]) is None
    assert sparcrag.is_correct("the Stockholm, Sweden", ["Stockholm"], "acc")
    assert not sparcrag.is_correct("the Stockholm, Sweden", ["Stockholm"], "em")
    assert sparcrag.is_correct("the Stockholm, Sweden", ["Stockholm"], "f1")  # F1 0.667 >= 0.5
    assert sparcrag.is_correct("unknown", ["no"], "acc") and not sparcrag.is_correct("unknown", ["no"], "em")


# ---------------------------------------------------------------- Algorithm 1 with a scripted backbone (App. C.5)
Q0 = "Where is Anticimex's parent company headquartered?"
DOCS = {
    "d1": "Anticimex is a Swedish pest control company owned by EQT.",
    "d2": "EQT AB is an investment firm headquartered in Stockholm.",
    "d3": "Rentokil is a pest control company.",
}


class SpyRetriever:
    """Returns the document whose text shares the query's first word (else d3); records every query."""

    def __init__(self):
        self.queries = []

    def search(self, queries, k):
        self.queries += list(queries)
        pick = lambda q: next((d for d, text in DOCS.items() if text.split()[0] == q.split()[0]), "d3")
        return [[{"id": pick(q), "title": pick(q), "text": DOCS[pick(q)]}][:k] for q in queries]


def scripted_roles(calls, evaluate=None, rewrite=None):
    """A scripted backbone, one function per role; every call recorded as (role, prompt)."""

    def role(name, reply):
        def chat(requests, seed=0):
            calls.extend((name, r["prompt"]) for r in requests)
            return [reply(r["prompt"]) for r in requests]

        return chat

    first = [("bm25", "Anticimex parent company owner"), ("dense", "EQT headquarters location")]
    default_evaluate = lambda p: "<decision>CONTINUE</decision>" if "Candidate answer: EQT" in p else "<decision>STOP"
    return {
        "rewrite": role("rewrite", rewrite or (lambda p: sparcrag.format_rewrites(first))),
        "update": role(
            "update",
            lambda p: (
                "Anticimex is owned by EQT."
                if DOCS["d1"] in p
                else "EQT AB is headquartered in Stockholm."
                if DOCS["d2"] in p
                else "nothing [END]"
            ),
        ),
        "answer": role("answer", lambda p: "EQT [END]" if "owned by EQT" in p.split("Question:")[0] else "Stockholm"),
        "evaluate": role("evaluate", evaluate or (lambda p: default_evaluate(p) + "</decision> [END]")),
        "select": role("select", lambda p: "Stockholm is supported. <answer>Stockholm</answer> [END]"),
        "merge": role("merge", lambda p: "Anticimex is owned by EQT. EQT AB is headquartered in Stockholm. [END]"),
    }


def scripted_ctx(calls, width=2, **kw):
    args = sparcrag.Args(top_k=1, **kw)
    retrievers = {"bm25": SpyRetriever(), "dense": SpyRetriever()}
    count = lambda prompts, outputs: ([len(p.split()) for p in prompts], [len(o.split()) for o in outputs])
    roles = scripted_roles(calls, kw.pop("evaluate", None)) if isinstance(calls, list) else calls
    return {"roles": roles, "count": count, "retrievers": retrievers, "args": args, "tpl": sparcrag.TEMPLATES["paper"]}


ROW = {"id": "q", "question": Q0, "golden_answers": ["Stockholm"], "metadata": {"supporting_doc_ids": ["d1", "d2"]}}


def test_one_round_of_branches_select_merge_and_stop():
    calls = []
    ctx = scripted_ctx(calls)
    (run,) = sparcrag.sparc_rag([ROW], ctx, width=2, depth=3, early_exit=True)
    assert run.answer == "Stockholm" and run.rounds == 1  # the winner said STOP: no second Rewriter call
    assert Counter(role for role, _ in calls) == {
        "rewrite": 1,
        "update": 2,
        "answer": 2,
        "evaluate": 2,
        "select": 1,
        "merge": 1,
    }  # 1 + 3W + 2 = 9 calls
    assert run.cost["llm_calls"] == 9 and run.cost["retrievals"] == 2
    updates = [p for role, p in calls if role == "update"]
    assert all("Old note: \nNew information:" in p for p in updates)  # both branches read the same empty m^(0)
    assert DOCS["d1"] in updates[0] and DOCS["d2"] not in updates[0]  # isolation: a branch sees only its passages
    assert DOCS["d2"] in updates[1] and DOCS["d1"] not in updates[1]
    assert ctx["retrievers"]["bm25"].queries == ["Anticimex parent company owner"]  # each item's own strategy
    assert ctx["retrievers"]["dense"].queries == ["EQT headquarters location"]
    answers = [p for role, p in calls if role == "answer"]
    assert all(f"Question: {Q0}" in p and "EQT headquarters location" not in p for p in answers)  # q0, not q_k
    evaluations = [p for role, p in calls if role == "evaluate"]
    assert "Current query: Anticimex parent company owner" in evaluations[0]
    assert "Note: Anticimex is owned by EQT." in evaluations[0] and "Candidate answer: EQT" in evaluations[0]
    assert "Current query: EQT headquarters location" in evaluations[1] and "answer: Stockholm" in evaluations[1]
    select = next(p for role, p in calls if role == "select")
    assert "Answer 1: EQT\nEvaluation 1: CONTINUE\nReasoning 1: Anticimex is owned by EQT." in select
    merge = next(p for role, p in calls if role == "merge")
    assert "Note 1: EQT AB is headquartered in Stockholm.\nNote 2: Anticimex is owned by EQT." in merge  # winner first
    assert run.note == "Anticimex is owned by EQT. EQT AB is headquartered in Stockholm."  # the merge output
    traced = [(e["role"], e["parsed"]) for e in run.trace]
    assert ("select", 1) in traced and ("evaluate", STOP) in traced and len(traced) == 9  # every call traced


def test_fixed_depth_runs_every_round_and_the_next_rewrite_reads_the_merged_note():
    calls = []
    (run,) = sparcrag.sparc_rag([ROW], scripted_ctx(calls), width=2, depth=3, early_exit=False)
    assert run.rounds == 3 and run.answer == "Stockholm"  # the winner's STOP is ignored
    rewrites = [p for role, p in calls if role == "rewrite"]
    assert len(rewrites) == 3 and "- Context: \n" in rewrites[0]
    assert "- Context: Anticimex is owned by EQT. EQT AB is headquartered in Stockholm.\n" in rewrites[1]
    assert "- Current Query: EQT headquarters location\n" in rewrites[1]  # q_t+1: the winner's sub-query
    assert [s["llm_calls"] for s in run.snapshots] == [9, 18, 27]
    updates = [p for role, p in calls if role == "update"]
    assert "Old note: Anticimex is owned by EQT. EQT AB" in updates[2]  # round 2 branches read m^(1)


def test_a_fixed_depth_run_holds_the_runs_of_every_smaller_depth():
    """The W x D grid reads depth t off a deeper fixed-depth run (bench/sparcrag_grid.py): its round-t snapshot."""
    deep = sparcrag.sparc_rag([ROW], scripted_ctx([]), width=2, depth=3, early_exit=False)[0]
    for depth in (1, 2):
        short = sparcrag.sparc_rag([ROW], scripted_ctx([]), width=2, depth=depth, early_exit=False)[0]
        args = sparcrag.Args(correct_by="em")
        assert sparcrag.run_record(deep, args, depth) == sparcrag.run_record(short, args)


def test_never_stop_runs_to_the_cap_with_growing_tokens():
    calls = []
    ctx = scripted_ctx(scripted_roles(calls, evaluate=lambda p: "<decision>CONTINUE</decision>"))
    (run,) = sparcrag.sparc_rag([ROW], ctx, width=2, depth=4, early_exit=True)
    tokens = [s["tokens"] for s in run.snapshots]
    assert run.rounds == 4 and run.answer == "Stockholm"  # the last round's winner answer
    assert all(a < b for a, b in itertools.pairwise(tokens))
    # tokens per question: the sum over the traced calls of whitespace tokens in and out
    assert run.cost["tokens"] == sum(len(e["prompt"].split()) + len(e["output"].split()) for e in run.trace)


def test_the_stop_of_a_losing_branch_does_not_end_the_loop():
    calls = []
    evaluate = lambda p: (
        "<decision>STOP</decision>" if "Candidate answer: EQT" in p else "<decision>CONTINUE</decision>"
    )
    (run,) = sparcrag.sparc_rag([ROW], scripted_ctx(scripted_roles(calls, evaluate)), 2, 3, early_exit=True)
    assert run.rounds == 3  # branch 1 (EQT) said STOP, but the selector chose branch 2 (CONTINUE)


def test_every_departure_the_code_marks_is_an_item_of_the_header():
    """`header item N` in the code names an item of the header's two lists (departures from the paper, then toy-world
    adaptations, numbered on); the shortcut of W = 1 past Select and Merge (Alg. 1 calls both every round), the one
    seed per batched generate call, and the reference the printed DPO loss lacks (§3.4) are departures, each marked
    where it lives and saying why in the header."""
    import inspect
    import re

    items = dict(re.findall(r"\n(\d+)\. (.*(?:\n {3,4}\S.*)*)", sparcrag.__doc__))
    cited = {n for n in re.findall(r"header items? (\d+)", Path(sparcrag.__file__).read_text())}
    assert cited and cited <= set(items) and list(items) == [str(i) for i in range(1, len(items) + 1)]
    marked = lambda fn, n: re.search(rf"simplification: .*header item {n}\)", inspect.getsource(fn))
    assert (
        marked(sparcrag.select_best, 5)
        and marked(sparcrag.merge_notes, 5)
        and "W = 1" in items["5"]
        and "Select" in items["5"]
    )
    assert marked(sparcrag.policy_role, 6) and "seed" in items["6"]
    assert marked(sparcrag.dpo_loss, 2) and "TRL 0.23.1" in items["2"] and "App. A.4" in items["2"]
    departures, toy = sparcrag.__doc__.split("Departures from the paper")[1].split("Toy-world adaptations")
    assert "\n5. W = 1" in departures and "\n6. One seed" in departures and "\n7. " in toy


@pytest.mark.parametrize("width, per_round", [(1, 4), (2, 9), (3, 12)])
def test_calls_per_round_are_1_plus_3w_plus_2_when_w_exceeds_1(width, per_round):
    calls = []
    items = [("bm25", "Anticimex a"), ("dense", "EQT b"), ("dense", "Rentokil c")]
    roles = scripted_roles(calls, rewrite=lambda p: sparcrag.format_rewrites(items))
    (run,) = sparcrag.sparc_rag([ROW], scripted_ctx(roles), width=width, depth=2, early_exit=False)
    assert run.cost["llm_calls"] == 2 * per_round and run.cost["retrievals"] == 2 * width
    if width == 1:  # one branch: its note is the new global note, no Select or Merge call
        assert "select" not in Counter(r for r, _ in calls) and run.note == "Anticimex is owned by EQT."


def test_dense_only():
    ctx = scripted_ctx([], dense_only=True)
    sparcrag.sparc_rag([ROW], ctx, width=2, depth=1)
    assert ctx["retrievers"]["bm25"].queries == [] and len(ctx["retrievers"]["dense"].queries) == 2


def test_bm25_queries_lose_their_wh_words():
    spy = SpyRetriever()
    sparcrag.retrieve({"bm25": spy, "dense": spy}, [("bm25", "Where is EQT based"), ("bm25", "what")], 1)
    assert spy.queries == ["is EQT based", "what"]  # a query of wh-words only is kept as it is


def test_questions_of_a_batch_share_one_call_per_role_per_round():
    seen = Counter()

    def counted(name, chat):
        def call(requests, seed=0):
            seen.update([name])
            return chat(requests, seed)

        return call

    counted = {name: counted(name, chat) for name, chat in scripted_roles([]).items()}
    runs = sparcrag.sparc_rag([ROW, dict(ROW, id="r")], scripted_ctx(counted), width=2, depth=2, early_exit=False)
    assert seen == {"rewrite": 2, "update": 2, "answer": 2, "evaluate": 2, "select": 2, "merge": 2}
    assert [r.rounds for r in runs] == [2, 2]


# ---------------------------------------------------------------- preference pairs (§3.4)
def test_rewriter_pair_is_max_over_min_recall():
    gold = ["p1", "p2"]
    samples = {"A": [{"p1", "p3"}, {"p1", "p4"}], "B": [{"p1", "p3"}, {"p2", "p5"}], "C": [{"p3", "p4"}, {"p3", "p5"}]}
    recalls = [sparcrag.paragraph_recall(set().union(*sets), gold) for sets in samples.values()]
    assert recalls == [0.5, 1.0, 0.0]
    assert sparcrag.rewrite_pair(recalls) == (1, 2)  # B over C
    assert sparcrag.jaccard_avg(samples["B"]) == 0 < sparcrag.jaccard_avg(samples["A"]) == pytest.approx(1 / 3)
    assert sparcrag.rewrite_pair([0.5, 0.5, 0.5]) is None
    assert sparcrag.rewrite_pair([0.5, 1.0, 1.0, 0.0, 0.0]) == (1, 3)  # first index on ties


@pytest.mark.parametrize(
    "decisions, correct, synthesize, pair",
    [
        ([STOP, STOP, CONTINUE], False, False, (2, 0, 2.0)),  # s1: continue over a wrong stop, weight lambda
        ([STOP, CONTINUE], True, False, (0, 1, 1.0)),  # s2: stop over a wrong continue
        ([STOP, STOP, STOP], False, False, None),  # s3: skipped by default
        ([STOP, STOP, STOP], False, True, (-1, 0, 2.0)),  # s3 with the canonical CONTINUE
        ([STOP, STOP], True, False, None),  # s4
        ([STOP, STOP], True, True, None),
    ],
)
def test_evaluator_pairs_and_the_lambda_weight(decisions, correct, synthesize, pair):
    assert sparcrag.evaluator_pair(decisions, correct, 2.0, synthesize) == pair
    if pair:  # w = lambda <=> chosen CONTINUE and rejected STOP <=> the answer was wrong
        assert (pair[2] == 2.0) == (not correct)


def test_build_pairs_reads_the_traces_of_a_hand_made_run():
    gold = ["d1", "d2"]
    run = sparcrag.Run({"question": Q0, "golden_answers": ["Stockholm"], "metadata": {"supporting_doc_ids": gold}})
    run.trace = [
        {"t": 1, "role": "rewrite", "prompt": "RW", "width": 2, "fallback": Q0},
        {"t": 1, "role": "rewrite", "prompt": "RW", "width": 2, "fallback": Q0},  # the same state twice: once
        {"t": 1, "role": "evaluate", "prompt": "EV-wrong", "answer": "EQT"},
        {"t": 1, "role": "evaluate", "prompt": "EV-right", "answer": "stockholm"},
        {"t": 1, "role": "answer", "prompt": "AN"},
    ]
    rw = lambda *items: sparcrag.format_rewrites(items)
    sampled = {
        "RW": [
            rw(("bm25", "Anticimex x"), ("dense", "Anticimex y")),
            rw(("bm25", "Anticimex x"), ("bm25", "EQT y")),
            "garbage",
            rw(("dense", "Rentokil")),
        ],
        "EV-wrong": ["<decision>STOP</decision>", "<decision>STOP</decision>", "<decision>CONTINUE</decision>", "x"],
        "EV-right": ["<decision>CONTINUE</decision>", "<decision>STOP</decision>", "stop", "continue"],
    }
    asked = []
    sample = lambda prompts, n: (asked.append((list(prompts), n)), [sampled[p] for p in prompts])[1]
    ctx = scripted_ctx([])
    args = sparcrag.Args(n_samples=4, lam=2.0, correct_by="em", top_k=1)
    pairs = sparcrag.build_pairs([run], ctx, sample, args)
    assert asked == [(["RW", "EV-wrong", "EV-right"], 4)]  # every logged state in one call
    rewrite, wrong, right = pairs
    # recalls 0.5, 1.0, 0 (unparsed: nothing retrieved), 0: the second set over the first zero one
    assert rewrite == {
        "role": "rewrite",
        "prompt": "RW",
        "weight": 1.0,
        "chosen": sampled["RW"][1],
        "rejected": "garbage",
    }
    assert wrong == {
        "role": "evaluate",
        "prompt": "EV-wrong",
        "weight": 2.0,
        "chosen": sampled["EV-wrong"][2],
        "rejected": sampled["EV-wrong"][0],
    }
    assert right == {
        "role": "evaluate",
        "prompt": "EV-right",
        "weight": 1.0,
        "chosen": sampled["EV-right"][1],
        "rejected": sampled["EV-right"][0],
    }


def test_the_sampler_makes_one_call_at_t_1_and_keeps_the_prompt_order(monkeypatch):
    calls = []

    def fake_role(model, tokenizer, args, temperature, max_tokens=None):
        def chat(requests, seed=0):
            calls.append((temperature, [r["prompt"] for r in requests]))
            return [f"{r['prompt']}@{temperature}#{i}" for i, r in enumerate(requests)]

        return chat

    monkeypatch.setattr(sparcrag, "policy_role", fake_role)
    sample = sparcrag.sampler(None, None, sparcrag.Args())
    assert sample(["a", "b", "c"], 2) == [["a@1.0#0", "a@1.0#1"], ["b@1.0#2", "b@1.0#3"], ["c@1.0#4", "c@1.0#5"]]
    assert calls == [(1.0, ["a", "a", "b", "b", "c", "c"])]


# ---------------------------------------------------------------- the weighted DPO loss (§3.4)
def loss_of(pi, ref, w=1.0, free=False):
    t = lambda x: torch.tensor([float(x)])
    loss, _ = sparcrag.dpo_loss(t(pi[0]), t(pi[1]), t(ref[0]), t(ref[1]), t(w), 0.1, reference_free=free)
    return loss.item()


def test_dpo_loss_values():
    assert loss_of((-10, -12), (-11, -11)) == pytest.approx(0.598139, abs=1e-6)
    assert loss_of((-10, -12), (-11, -11), w=2) == pytest.approx(1.196278, abs=1e-6)
    assert loss_of((-10, -12), (-9, -13)) == pytest.approx(0.798139, abs=1e-6)
    assert loss_of((-10, -12), (-9, -13), w=2) == pytest.approx(1.596278, abs=1e-6)
    assert loss_of((-10, -12), (-9, -13), free=True) == pytest.approx(0.598139, abs=1e-6)  # the paper's form
    assert loss_of((-10, -12), (-10, -12)) == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert loss_of((-12, -10), (-11, -11)) == pytest.approx(0.798139, abs=1e-6)  # swapped: the margin flips


def test_dpo_batch_mean_is_not_normalised_by_the_weights_and_the_gradient():
    pi = torch.tensor([-10.0, -10.0], requires_grad=True)
    pi_rejected = torch.tensor([-12.0, -12.0], requires_grad=True)
    ref, ref_rejected = torch.tensor([-11.0, -9.0]), torch.tensor([-11.0, -13.0])
    loss, margins = sparcrag.dpo_loss(pi, pi_rejected, ref, ref_rejected, torch.tensor([2.0, 1.0]), 0.1)
    assert loss.item() == pytest.approx(0.997208, abs=1e-6)  # (2 * 0.598139 + 0.798139) / 2
    assert margins.tolist() == pytest.approx([0.2, -0.2])
    loss.backward()
    assert pi.grad[0].item() == pytest.approx(2 * -0.0450166 / 2, abs=1e-6)  # w = 2, mean over 2 pairs
    assert pi_rejected.grad[0].item() == pytest.approx(2 * 0.0450166 / 2, abs=1e-6)
    single = torch.tensor([-10.0], requires_grad=True)
    sparcrag.dpo_loss(
        single, torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0]), torch.tensor([1.0]), 0.1
    )[0].backward()
    assert single.grad.item() == pytest.approx(-0.0450166, abs=1e-6)


# ---------------------------------------------------------------- sequence log-probs and masks
class FixedLogits(torch.nn.Module):
    """A model whose logits at every position are given (B, T, V) or a function of the input ids."""

    def __init__(self, logits_of):
        super().__init__()
        self.logits_of = logits_of

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": self.logits_of(input_ids)})()


def test_dpo_train_logs_the_weighted_loss_from_its_first_step(tmp_path):
    from common import runs
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32")
    pair = {"role": "evaluate", "prompt": "answer : unknown decision :", "weight": 8.0}
    pair |= {"chosen": "<decision>CONTINUE</decision>", "rejected": "<decision>STOP</decision>"}
    args = sparcrag.apply_preset(sparcrag.Args(lora_dropout=0.0, dpo_epochs=1))
    sparcrag.dpo_train(runs.make_accelerator(), model, tokenizer, [pair], args, None, tmp_path)
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["losses/dpo"]
    assert logged == pytest.approx(8.0 * math.log(2), rel=1e-5)  # the LoRA starts at the reference: w * ln 2


def test_sequence_logps_uniform_and_padding():
    model = FixedLogits(lambda ids: torch.zeros(*ids.shape, 3))
    for prompt_len in (1, 4):
        ids = torch.tensor([[0] * prompt_len + [1, 2]])
        mask = torch.tensor([[0] * prompt_len + [1, 1]])
        value = sparcrag.sequence_logps(model, ids, mask, torch.ones_like(ids))
        assert value.item() == pytest.approx(-2.197225, abs=1e-6)  # 2 * -ln 3, whatever the prompt length
    padded = sparcrag.sequence_logps(
        model, torch.tensor([[0, 1, 2, 0, 0]]), torch.tensor([[0, 1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 0, 0]])
    )
    assert padded.item() == pytest.approx(-2.197225, abs=1e-6)


def test_sequence_logps_scores_token_i_plus_1_with_the_logits_at_i():
    def logits_of(ids):
        out = torch.zeros(*ids.shape, 3)
        out[0, 1] = torch.tensor([2.0, 0.0, -1.0])  # position 1 scores the token at position 2
        return out

    ids, mask = torch.tensor([[1, 1, 0, 2]]), torch.tensor([[0, 0, 1, 0]])  # only token 2 (id 0) is a response token
    value = sparcrag.sequence_logps(FixedLogits(logits_of), ids, mask, torch.ones_like(ids))
    assert value.item() == pytest.approx(-0.169846, abs=1e-6)  # log-softmax([2, 0, -1])[0]


def test_encode_masks_exactly_the_response_end_tag_and_eos():
    from common.toy.lm import load_toy_lm

    _, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32")
    ids, mask = sparcrag.encode(tokenizer, "decide stop or continue . answer : velbo", "< decision > stop [END] junk")
    prompt = tokenizer(
        sparcrag.chat_prompts(tokenizer, [[{"role": "user", "content": "decide stop or continue . answer : velbo"}]])[
            0
        ],
        add_special_tokens=False,
    )
    n = len(prompt["input_ids"])
    assert ids[:n] == prompt["input_ids"] and mask == [0] * n + [1] * (len(ids) - n)
    assert tokenizer.decode(ids[n:]) == "< decision > stop [ end ] <eos>"  # cut at [END], then [END] and EOS


def test_dpo_and_sft_train_on_the_response_as_stored_with_its_think_block():
    """The Rewrite prompt asks for a <think> block before the queries (App. D): the trained response is the stored
    completion through its [END], the block included, then EOS; one the token cap cut before [END] (inside its
    <think> block) trains as written, without an [END] or EOS it never wrote."""
    from common.toy.lm import load_toy_lm

    _, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32")
    prompt, tokens = "write 1 queries , output :", lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(tokens(sparcrag.chat_prompts(tokenizer, [[{"role": "user", "content": prompt}]])[0]))  # the prompt
    written = "<think> i need to know the director . </think>\n" + sparcrag.format_rewrites([("bm25", "director")])
    ids, mask = sparcrag.encode(tokenizer, prompt, written)
    assert ids[n:] == tokens(written) + [tokenizer.eos_token_id] and mask == [0] * n + [1] * (len(ids) - n)
    assert tokenizer.decode(ids[n:]).startswith("< think > i need to know the director . < / think > < queries >")
    cut = "<think> i need to know the"
    ids, mask = sparcrag.encode(tokenizer, prompt, cut)
    assert ids[n:] == tokens(cut) and mask == [0] * n + [1] * len(tokens(cut))  # no [END], no EOS
    pair = {"prompt": prompt, "chosen": written, "rejected": cut, "weight": 2.0}
    ids, mask, attention, weights = sparcrag.pair_tensors([pair], tokenizer, "cpu")  # chosen, then rejected
    for row, response in enumerate((written, cut)):
        expected, expected_mask = sparcrag.encode(tokenizer, prompt, response)
        width = int(attention[row].sum())
        assert ids[row, :width].tolist() == expected and mask[row].tolist() == expected_mask + [0] * (
            ids.shape[1] - width
        )
    assert weights.tolist() == [2.0]


def test_the_adapter_disabled_reference_equals_a_fresh_lora_model_so_the_first_loss_is_ln2():
    from common.llm import add_lora
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32")
    ids, mask = (torch.tensor([x]) for x in sparcrag.encode(tokenizer, "answer : velbo", "< decision > stop"))
    base = sparcrag.sequence_logps(model, ids, mask, torch.ones_like(ids))
    model = add_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    with torch.no_grad(), model.disable_adapter():
        ref = sequence_logps = sparcrag.sequence_logps(model, ids, mask, torch.ones_like(ids))
    pi = sparcrag.sequence_logps(model, ids, mask, torch.ones_like(ids))
    assert torch.allclose(ref, base) and torch.allclose(pi, base)  # LoRA B starts at zero
    loss, _ = sparcrag.dpo_loss(pi, pi - 1, sequence_logps, sequence_logps - 1, torch.ones(1), 0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_role_adapters_train_each_on_its_own_pairs_serve_their_role_and_reload(tmp_path):
    from common import runs

    flags = {"model": "toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32", "dpo_lr": 0.05}
    flags |= {"dpo_epochs": 1, "dpo_batch_size": 2, "micro_batch_size": 2, "lora_dropout": 0.0}
    accelerator = runs.make_accelerator()
    pair = {"role": "evaluate", "prompt": "answer : unknown decision :", "weight": 1.0}
    pair |= {"chosen": "<decision>CONTINUE</decision>", "rejected": "<decision>STOP</decision>"}
    rewrite = ("write 1 queries , original query : poli output :", "<queries> <query> poli </query> </queries>")

    def logps(model, adapter, prompt, response):
        if adapter:
            model.set_adapter(adapter)
        ids, mask = (
            torch.tensor([x], device=accelerator.device) for x in sparcrag.encode(tokenizer, prompt, response)
        )
        with torch.no_grad():
            return sparcrag.sequence_logps(model.eval(), ids, mask, torch.ones_like(ids)).item()

    tuned = {}
    for per_role in (True, False):
        args = sparcrag.apply_preset(sparcrag.Args(role_adapters=per_role, evaluator_epochs=2, **flags))
        torch.manual_seed(0)
        policy, tokenizer = sparcrag.load_policy(args, accelerator.device)
        runs.save_checkpoint(tmp_path / "sft", policy, tokenizer, {})
        policy.name_or_path = str(tmp_path / "sft")  # the adapters' base, as in train()
        start = logps(policy, None, *rewrite)
        tuned[per_role], steps = sparcrag.tune(accelerator, policy, tokenizer, [pair] * 4, args, None, tmp_path)
        assert steps == (4 if per_role else 2)  # --evaluator_epochs: the evaluator adapter's alone
    model = tuned[True]
    assert set(model.peft_config) == {"default", "evaluate"} and set(tuned[False].peft_config) == {"default"}
    # the rewriter's adapter saw no pair: the rewriter is the warm-up's; the evaluator's adapter learned its pairs
    lora = lambda m, adapter, ab: [p for n, p in m.named_parameters() if f"lora_{ab}.{adapter}." in n]
    assert lora(model, "default", "B") and not any(p.any() for p in lora(model, "default", "B"))  # B starts at 0
    assert logps(model, "default", *rewrite) == pytest.approx(start, rel=1e-4)  # (bf16 autocast on a GPU)
    assert any(p.any() for p in lora(tuned[False], "default", "B"))  # one shared adapter: trained
    margin = lambda m, a: logps(m, a, pair["prompt"], pair["chosen"]) - logps(m, a, pair["prompt"], pair["rejected"])
    assert margin(model, "evaluate") > margin(model, "default") + 0.1
    chosen = logps(model, "evaluate", pair["prompt"], pair["chosen"])
    ctx = sparcrag.make_ctx(model, tokenizer, {}, object(), args)
    for role, adapter in (("evaluate", "evaluate"), ("rewrite", "default"), ("evaluate", "evaluate")):
        ctx["roles"][role]([{"prompt": pair["prompt"]}])
        assert model.active_adapter == adapter
    runs.save_checkpoint(tmp_path / "dpo", model, tokenizer, {})
    loaded, _ = sparcrag.load_policy(args, accelerator.device, str(tmp_path / "dpo"))
    assert set(loaded.peft_config) == {"default", "evaluate"}
    assert logps(loaded, "evaluate", pair["prompt"], pair["chosen"]) == pytest.approx(chosen, rel=1e-4)  # bf16 on GPU
    pairs = [(p, q) for ab in "AB" for p, q in zip(lora(loaded, "evaluate", ab), lora(model, "evaluate", ab))]
    assert pairs and all(torch.equal(p, q) for p, q in pairs)


def test_the_toy_preset_tunes_one_adapter_per_role_the_rewriters_for_one_epoch(tmp_path):
    from common import runs

    tiny = {"model": "toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32", "dpo_batch_size": 2}
    rewrite = {"role": "rewrite", "prompt": "write 1 queries , original query : poli output :", "weight": 1.0}
    rewrite |= {"chosen": "<queries> <query> poli </query> </queries>", "rejected": "<queries> </queries>"}
    evaluate = {"role": "evaluate", "prompt": "answer : unknown decision :", "weight": 1.0}
    evaluate |= {"chosen": "<decision>CONTINUE</decision>", "rejected": "<decision>STOP</decision>"}
    pairs = [rewrite] * 2 + [evaluate] * 4
    toy, paper = sparcrag.apply_preset(sparcrag.Args(**tiny)), sparcrag.Args(preset="paper")
    assert (toy.role_adapters, toy.dpo_epochs, toy.evaluator_epochs) == (True, 1, 5)
    assert (sparcrag.apply_preset(paper).role_adapters, paper.dpo_epochs) == (False, 3)  # the paper's one adapter
    for args, adapters, steps in (
        (toy, {"default", "evaluate"}, 1 + 10),
        (replace(toy, role_adapters=False), {"default"}, 3),
    ):
        policy, tokenizer = sparcrag.load_policy(args, torch.device("cpu"))
        model, done = sparcrag.tune(runs.make_accelerator(), policy, tokenizer, pairs, args, None, tmp_path)
        assert set(model.peft_config) == adapters and done == steps  # toy: 2 pairs x 1 epoch + 4 pairs x 5 epochs, / 2


# ------------------------------------------------ the naive baselines (App. A.5: bench/compare.py) and the teacher
def naive_ctx(answers, confidences=None):
    calls = []

    def role(name, replies):
        it = iter(replies)
        return lambda requests, seed=0: (calls.extend(name for _ in requests), [next(it) for _ in requests])[1]

    ctx = scripted_ctx([], templates="paper")
    ctx["roles"] = {name: role(name, answers) for name in ("answer", "parallel")}
    ctx["roles"]["confidence"] = role("confidence", confidences or [])
    return ctx, calls


def test_naive_parallel_majority_vote_and_vanilla():
    ctx, calls = naive_ctx(["EQT", "stockholm", "Stockholm.", "x", "y", "x"])
    runs = compare.naive(sparcrag, ctx, [ROW, dict(ROW, id="r")], "parallel", 3)
    assert [r.answer for r in runs] == ["stockholm", "x"] and calls == ["parallel"] * 6
    assert ctx["retrievers"]["dense"].queries == [Q0, Q0]  # one dense retrieval on q0 per question
    ctx, calls = naive_ctx(["a", "b"])
    assert [r.answer for r in compare.naive(sparcrag, ctx, [ROW, ROW], "vanilla", 3)] == ["a", "b"]


def test_the_naive_baselines_sample_at_the_papers_temperatures():
    """Parallel (Naive) samples its answers at T 0.7 (App. A.5); Vanilla RAG and Sequential (Naive) answer at the
    generation modules' T (App. A.4: 0.5 in the paper preset); the self-evaluated confidence is greedy (ours)."""
    asked = []

    class Recording:
        def chat(self, messages, temperature, **_):
            asked.append((len(messages), temperature))
            return ["0.9 [END]" if "Confidence" in m[0]["content"] else "Stockholm [END]" for m in messages]

    args, llm = sparcrag.apply_preset(sparcrag.Args(preset="paper", top_k=1)), Recording()
    ctx = sparcrag.make_ctx(None, None, scripted_ctx([])["retrievers"], llm, args)
    ctx = compare.with_naive_roles(sparcrag, ctx | {"count": scripted_ctx([])["count"]}, None, None, llm)
    for system, calls in (("vanilla", [(1, 0.5)]), ("parallel", [(3, 0.7)]), ("sequential", [(1, 0.5), (1, 0.0)])):
        asked.clear()
        compare.naive(sparcrag, ctx, [ROW], system, 3)
        assert asked == calls, system  # (answers asked, temperature) per call


def test_naive_sequential_retries_below_0_7_and_keeps_the_most_confident():
    ctx, calls = naive_ctx(["a1", "b1", "a2", "a3"], ["0.2", "0.9", "0.6", "0.3"])
    runs = compare.naive(sparcrag, ctx, [ROW, dict(ROW, id="r")], "sequential", 3)
    assert [(r.answer, r.rounds) for r in runs] == [("a2", 3), ("b1", 1)]
    assert calls == ["answer", "answer", "confidence", "confidence", "answer", "confidence", "answer", "confidence"]


def test_the_teacher_asks_the_open_facts_and_can_repeat_one():
    meta = {
        "type": "two_hop",
        "entities": ["zorvak", "velbo", "tuvia"],
        "sub_answers": ["velbo", "tuvia"],
        "sub_queries": ["zorvak directed", "velbo born"],
    }
    run = sparcrag.Run({"question": "what is the birthplace of the director of zorvak ?", "metadata": meta})
    request = {"run": run, "info": {"width": 2}}
    write = lambda args: toy.teacher_role("rewrite", args, 0, sparcrag.format_rewrites)([request])[0]
    parse = lambda args: sparcrag.parse_rewrites(write(args), request["info"]["width"])
    clean, noisy = sparcrag.Args(teacher_duplicate=0.0, templates="compact"), sparcrag.Args(teacher_duplicate=1.0)
    assert parse(clean) == [("bm25", "zorvak directed"), ("dense", "zorvak")]  # the fact, the subject alone
    assert write(clean).startswith("<queries>")  # the compact templates ask for no <think> block
    paper = replace(clean, templates="paper")  # the paper's Rewrite prompt: a <think> block, then the items
    assert write(paper) == (
        "<think> i need to know : zorvak directed ; zorvak . strategy : 1 bm25 , 2 dense . </think>\n" + write(clean)
    )
    assert parse(noisy) == [("bm25", "zorvak directed"), ("dense", "zorvak directed")]  # a near-duplicate
    run.note = "zorvak is a film directed by velbo ."
    assert parse(clean) == [("bm25", "velbo born"), ("dense", "zorvak")]  # the bridge is named now
    request["info"]["width"] = 4
    assert parse(clean)[2:] == [("dense", "velbo"), ("dense", run.row["question"])]
    request["info"]["width"] = 2
    meta |= {
        "type": "comparison",
        "entities": ["a", "b", "a"],
        "sub_answers": ["1931", "1940"],
        "sub_queries": ["a born", "b born"],
    }
    run.note, run.row = "", {"question": "who was born first , a or b ?", "metadata": meta}
    assert parse(clean) == [("bm25", "a born"), ("bm25", "b born")]  # complementary


def test_the_teacher_over_accepts_wrong_answers_at_its_rates():
    args = sparcrag.Args(teacher_accept_correct=0.9, teacher_accept_wrong=0.6, correct_by="em")
    decide = toy.teacher_role("evaluate", args, 0, sparcrag.format_rewrites)
    run = sparcrag.Run({"question": "", "golden_answers": ["tuvia"]})
    wrong = decide([{"run": run, "info": {"answer": "unknown"}}] * 2000)
    right = decide([{"run": run, "info": {"answer": "tuvia"}}] * 2000)
    rate = lambda replies: sum(sparcrag.parse_decision(r) == STOP for r in replies) / len(replies)
    assert rate(wrong) == pytest.approx(0.6, abs=0.04) and rate(right) == pytest.approx(0.9, abs=0.03)
    assert set(right) == {"<decision>STOP</decision> [END]", "<decision>CONTINUE</decision> [END]"}
    paper = toy.teacher_role("evaluate", replace(args, templates="paper", teacher_accept_correct=1.0), 0, None)
    assert paper([{"run": run, "info": {"answer": "tuvia"}}]) == [
        "the note states the answer . <decision>STOP</decision> [END]"  # a reason, then the decision
    ]


# ---------------------------------------------------------------- CLI and end to end on the toy world
def run(args, capsys):
    """sparcrag.main in this process; returns the captured stdout."""
    capsys.readouterr()
    sparcrag.main(args)
    return capsys.readouterr().out


TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"
TINY = [
    "--model",
    TINY_LM,
    "--n_train",
    "12",
    "--n_eval",
    "6",
    "--sft_steps",
    "6",
    "--dpo_epochs",
    "1",
    "--untuned_depth",
    "2",
    "--depth",
    "2",
    "--max_new_tokens",
    "96",
    "--seed",
    "0",
]


def own_questions(folder, n, splits=("test",), keep=("id", "question", "golden_answers")):
    """A FlashRAG folder of one's own: the first n toy questions of each split without metadata, no world.json."""
    folder.mkdir()
    for split in splits:
        rows = [json.loads(line) for line in (ROOT / f"data/toy/{split}.jsonl").read_text().splitlines()[:n]]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows))
    return folder


def test_toy_train_then_resume_then_eval_and_ask(tmp_path, capsys):
    out = tmp_path / "run"
    stdout = run(["--train", "--output_dir", str(out), "--report_to", "tensorboard", *TINY], capsys)
    results = check_contract(out, stdout)
    assert results["train_steps"]["sft"] == 6 and results["train_steps"]["dpo"] >= 1 and results["n_eval"] == 6
    assert {"before_sft", "before", "before_adaptive", "after"} <= set(results)
    assert results["before"]["setting"] == {"width": 2, "depth": 2, "early_exit": False}
    assert results["after"]["setting"]["early_exit"] and results["pairs"]
    assert results["tokens_per_question"] == results["after"]["tokens"] > results["after"]["generated_tokens"] > 0
    # a role without pairs trains its adapter on nothing: one warning line, kept in results.json
    empty = [role for role in ("rewrite", "evaluate") if role not in results["pairs"]]
    assert results["warnings"] == [f"dpo: 0 {role} preference pairs" for role in empty]
    assert all(f"warning: dpo trained on nothing (0 {role} preference pairs)" in stdout for role in empty)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "step" in m] == list(range(1, results["train_steps"]["dpo"] + 1))
    assert [m["sft/step"] for m in metrics if "sft/loss" in m] == [1, 2, 3, 4, 5, 6]  # the SFT loss, each step
    assert list((out / "tensorboard").rglob("events.out.tfevents*"))  # the curves under the run folder
    assert (out / "dpo" / "adapter_config.json").is_file() and (out / "sft" / "model.safetensors").is_file()
    for stage in ("sft", "dpo"):  # a checkpoint records its method and the toy world its toy-lm was built on
        state = json.loads((out / stage / "run_state.json").read_text())
        assert (state["method"], state["world"], state["data_dir"]) == ("sparcrag", "data/toy", "data/toy")
    base = json.loads((out / "dpo" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == (out / "sft").resolve()  # the adapter's base is the warmed-up model, not the raw toy-lm
    for stage, key in (("raw", "before_sft"), ("untuned", "before"), ("dpo", "after")):
        lines = [json.loads(line) for line in (out / f"predictions_{stage}.jsonl").read_text().splitlines()]
        assert len(lines) == 6 and sum(r["f1"] for r in lines) / 6 == pytest.approx(results[key]["f1"])
        assert {"id", "question", "golden_answers", "prediction", "trajectory", "rounds", "tokens"} <= set(lines[0])
    # the run ends with the table of the paper's headline rows, then the paths, then RESULT
    end = stdout.strip().splitlines()[-15:]
    assert [line.split()[0] for line in end[:11]] == ["start", *sparcrag.TABLE], end
    assert end[11:14] == [f"results: {out / 'results.json'}", f"checkpoint: {out / 'dpo'}",
                          f"predictions: {out / 'predictions_dpo.jsonl'}"]  # fmt: skip
    with pytest.raises(SystemExit, match="pass --resume or another --run_name"):
        run(["--train", "--output_dir", str(out), *TINY], capsys)
    again = run(["--train", "--output_dir", str(out), "--resume", *TINY], capsys)  # neither SFT nor DPO redone
    assert "sft/loss" not in again and "losses/dpo" not in again
    assert check_contract(out, again)["after"]["f1"] == results["after"]["f1"]
    assert check_contract(out, again)["warnings"] == results["warnings"]
    flags = ["--eval", "--model", str(out / "dpo"), "--n_eval", "6", "--depth", "2", "--max_new_tokens", "96"]
    folders = []
    for _ in range(2):  # each evaluation its own folder, printed; never the earlier one's
        stdout = run([*flags, "--seed", "0"], capsys)
        folders.append(Path(stdout.split("evaluation folder: ")[1].split()[0]))
        after = check_contract(folders[-1], stdout)["after"]
        assert (after["f1"], after["tokens"]) == (results["after"]["f1"], results["after"]["tokens"])
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent == out / "dpo" / "eval"
    assert (folders[0] / "predictions_eval.jsonl").is_file() and stdout.count("evaluation folder") == 1
    with pytest.raises(SystemExit, match="training"):
        run(["--eval", "--model", str(out / "dpo"), "--output_dir", str(out)], capsys)
    # one's own questions (no world.json, no metadata): the checkpoint's world serves its toy-lm and the toy reader
    mine = own_questions(tmp_path / "mine", 3)
    stdout = run([*flags[:3], "--data_dir", str(mine), "--corpus", str(ROOT / "data/toy/corpus.jsonl")], capsys)
    assert check_contract(Path(stdout.split("evaluation folder: ")[1].split()[0]), stdout)["n_eval"] == 3
    stdout = run(["--ask", "what is the birthplace of qqzzyx ?", "--model", str(out / "dpo"), "--depth", "1"], capsys)
    assert "warning: words the model's tokenizer does not know (read as <unk>): qqzzyx" in stdout
    assert (
        "round 1 rewrite:" in stdout
        and "round 1 merge:" in stdout
        and stdout.strip().splitlines()[-1].startswith("answer:")
    )


def test_eval_of_a_flashrag_folder_without_metadata(tmp_path, capsys):
    folder = own_questions(tmp_path / "flashrag", 4)
    flags = ["--model", TINY_LM, "--corpus", str(ROOT / "data/toy/corpus.jsonl"), "--data_dir", str(folder)]
    with pytest.raises(SystemExit, match="^--llm toy reads a toy world: pass --world DIR$"):
        sparcrag.main(["--eval", *flags])  # the toy reader and the toy-lm need the world of their vocabulary
    out = tmp_path / "sparc"
    stdout = run(["--eval", "--output_dir", str(out), "--depth", "1", "--world", "data/toy", *flags], capsys)
    results = check_contract(out, stdout)
    assert results["n_eval"] == 4 and results["after"]["recall"] is None  # no gold paragraphs: no recall
    assert results["llm_calls_per_question"] == 9


def test_own_questions_train_without_a_warm_up_and_the_teacher_names_the_metadata_it_reads(tmp_path, capsys):
    from common.data import DataError

    mine = own_questions(tmp_path / "mine", 4, ("train", "test"))
    flags = ["--data_dir", str(mine), "--world", "data/toy", "--corpus", str(ROOT / "data/toy/corpus.jsonl")]
    flags += ["--model", TINY_LM, "--n_eval", "2", "--depth", "1", "--untuned_depth", "1", "--max_new_tokens", "24"]
    reads = "'type', 'entities', 'sub_queries', 'sub_answers', which the toy teacher \\(--sft_steps >= 1\\) needs"
    with pytest.raises(DataError, match=f"train.jsonl: row .* has no metadata {reads}"):
        sparcrag.main(["--train", "--output_dir", str(tmp_path / "teacher"), *flags])
    out = tmp_path / "run"
    stdout = run(["--train", "--sft_steps", "0", "--output_dir", str(out), *flags], capsys)
    results = check_contract(out, stdout)  # no gold paragraphs: no rewrite pair, and a warning that says so
    assert results["train_steps"]["sft"] == 0 and "dpo: 0 rewrite preference pairs" in results["warnings"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train", "--preset", "nope"], "argument --preset: invalid choice: 'nope' (choose from 'toy', 'paper')"),
        (["--train", "--correct_by", "em"], "unknown flags"),  # a preset-only field (PRESETS) is no flag
        (["--eval", "--width", "0"], "--width 0: must be >= 1"),
        (["--train", "--lam", "0.5"], "--lam 0.5: must be >= 1.0"),
        (["--train", "--n_train", "-5"], "--n_train -5: must be >= 1"),
        (["--train", "--teacher_accept_wrong", "0.5"], "unknown flags"),  # toy tuning: a field, not a flag
        (["--train", "--sft_steps", "-1"], "--sft_steps -1: must be >= 0"),
        (["--train", "--dpo_lr", "0"], "--dpo_lr 0.0: must be >= 1e-09"),
        (["--train", "--depth", "two"], "argument --depth: invalid int value: 'two'"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_it_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sparcrag.main(flags)
    (line,) = capsys.readouterr().err.splitlines()  # one line, never the whole usage
    assert exit_info.value.code == 2 and line.startswith(f"error: {message}")


def test_every_problem_of_a_flag_combination_in_one_line(tmp_path, monkeypatch):
    flags = ["--sft_steps", "0", "--n_train", "1", "--n_eval", "1"]
    with pytest.raises(SystemExit, match="^choose one mode: --train, --eval or --ask"):  # refused as the flags parse
        sparcrag.main(["--train", "--eval", *flags])
    with pytest.raises(SystemExit, match="^--resume continues a training run: use it with --train$"):
        sparcrag.main(["--eval", "--resume", "--n_eval", "1"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:  # a folder that is not there: never Hugging Face's "Repo id" text
        sparcrag.main(["--eval", "--model", "runs/nope/dpo", "--data_dir", "nope"])
    assert str(exit_info.value) == (
        "--llm toy reads a toy world: pass --world DIR; --data_dir nope: no such folder; --model runs/nope/dpo: "
        "not found"
    )
    assert not (tmp_path / "runs").exists()  # and no evaluation folder left behind


@pytest.mark.parametrize("flags, message", [([], "choose a mode"), (["--ask", "who ?"], "--ask needs --model")])
def test_a_missing_mode_or_model_is_one_line(flags, message):
    with pytest.raises(SystemExit, match=message):
        sparcrag.main(flags)


def test_another_methods_checkpoint_is_refused_naming_both(tmp_path):
    (tmp_path / "run_state.json").write_text(json.dumps({"method": "tearag", "data_dir": "data/toy"}))
    with pytest.raises(SystemExit, match=f"^--model {tmp_path} is a tearag checkpoint, not a sparcrag one$"):
        sparcrag.main(["--eval", "--model", str(tmp_path)])
    (tmp_path / "run_state.json").write_text(json.dumps({"args": {"model": "x", "ppo_iterations": 3}}))  # unmarked
    with pytest.raises(SystemExit, match="is another method's checkpoint, not a sparcrag one"):
        sparcrag.main(["--ask", "who ?", "--model", str(tmp_path)])


def test_progress_bars_are_the_projects_which_write_to_a_log_rarely(monkeypatch):
    bars = []
    monkeypatch.setattr(sparcrag.runs, "progress", lambda it, desc, **kw: bars.append(desc) or it)
    sparcrag.sparc_rag([ROW], scripted_ctx([]), 2, 1)
    assert bars == ["rounds"] and "tqdm" not in (ROOT / "sparcrag.py").read_text()


def test_a_malformed_data_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    from common.runs import run_main

    (tmp_path / "test.jsonl").write_text('{"id": 1, "question": "q", "golden_answers": ["a"]}\n{"id": 2,\n')
    with pytest.raises(SystemExit) as exit_info:
        flags = ["--eval", "--data_dir", str(tmp_path), "--world", "data/toy", "--output_dir", str(tmp_path / "o")]
        run_main(sparcrag.main, flags)
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip() == f"error: {tmp_path / 'test.jsonl'}:2: not valid JSON (Expecting property "
        "name enclosed in double quotes)"
    )


def test_paper_templates_run_a_few_steps(tmp_path, capsys, monkeypatch):
    # TINY's 12 training questions: with 4, a GPU's sampling once left no preference pair (a one-line SystemExit)
    monkeypatch.setitem(sparcrag.PRESETS, "templates", ("paper", "paper"))  # a preset-only field: the toy's value
    flags = [*TINY, "--n_eval", "2", "--max_new_tokens", "40"]
    stdout = run(["--train", "--output_dir", str(tmp_path / "paper"), *flags], capsys)
    assert check_contract(tmp_path / "paper", stdout)["args"]["templates"] == "paper"


def test_trains_on_a_freshly_generated_world_above_its_untrained_start(tmp_path, capsys):
    """The tokenizer, the toy reader and the renaming come from the world in --data_dir: one of another seed trains."""
    from common.toy import write_world

    world = write_world(tmp_path / "world", seed=3, size=0.5)
    out = tmp_path / "run"
    flags = ["--n_train", "60", "--n_eval", "40", "--sft_steps", "150", "--untuned_depth", "2", "--depth", "2"]
    stdout = run(["--train", "--data_dir", str(world), "--output_dir", str(out), "--seed", "0", *flags], capsys)
    results = check_contract(out, stdout)
    assert results["dataset"] == str(world) and results["args"]["world"] == str(world)
    assert json.loads((out / "sft" / "run_state.json").read_text())["world"] == str(world)

    # the raw model writes no valid rewrite: every query falls back to the question (dense), and it never stops; the
    # warmed-up one writes its own sub-queries and decisions (150 steps teach the formats, not yet the copying of
    # names: docs/sparcrag.md); "score": the share of first-round rewrite items that are not the fallback
    def fallback_share(stage):
        lines = [json.loads(line) for line in (out / f"predictions_{stage}.jsonl").read_text().splitlines()]
        first = [(r["question"], item) for r in lines for item in r["trajectory"].split(" ; ")[0][12:].split(" | ")]
        return sum(item == f"dense {q}" for q, item in first) / len(first)

    assert fallback_share("raw") == 1.0 and fallback_share("untuned") < 0.5 and fallback_share("dpo") < 0.5
    assert results["before_sft"]["rounds"] == 2 and results["before"]["incorrect_acceptance"] > 0.5


def test_the_smoke_command_of_the_docs_shows_the_training_signal_move(tmp_path, capsys):
    """docs/sparcrag.md's smoke test as written (its folder under tmp_path): the warm-up's SFT loss falls by more than
    half, both trained roles get preference pairs, and DPO steps on them."""
    import re

    docs = (ROOT / "docs" / "sparcrag.md").read_text(encoding="utf-8")
    command = re.search(r"^python sparcrag\.py (--train .*)$", docs[docs.index("## Smoke test") :], re.M).group(1)
    stdout = run([*command.split(), "--output_dir", str(tmp_path / "smoke")], capsys)
    results = check_contract(tmp_path / "smoke", stdout)
    losses = [float(loss) for loss in re.findall(r"^sft/loss=([0-9.]+) \| sft/step=", stdout, re.M)]
    assert len(losses) == 11 and losses[-1] < losses[0] / 2, losses
    assert results["pairs"].get("rewrite", 0) > 0 and results["pairs"].get("evaluate", 0) > 0, results["pairs"]
    assert results["train_steps"]["dpo"] > 0 and results["warnings"] == []
