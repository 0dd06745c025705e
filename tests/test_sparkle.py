"""SPARKLE: hand-worked numbers (the leaf reward in both weightings, Eq. 2 credit on a hand-built tree, GAE, the KL
reward, whitening, PPO and value clipping), the parsers (the paper's output formats, malformed triples and chains),
masks, the binary tree rollout's shape with and without pruning and its batching, the inference loop with scripted
agents (a reasoning LLM's too), the context cap, the prompt length cap, the warm-up (the teacher's own decisions), the
toy reader's think mode and the toy oracle teacher, every ablation, and end-to-end toy runs with --eval and --ask."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import check_contract

import sparkle
from common.retrieval import TfidfEncoder

ROOT = Path(__file__).resolve().parents[1]
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


def args_for(**overrides):
    """The toy preset's arguments with overrides."""
    return sparkle.apply_preset(sparkle.Args(train=True, **overrides))


# ---------------------------------------------------------------- reward and credit [§3.2, Eq. 2]
def test_leaf_reward_in_both_weightings():
    assert sparkle.leaf_reward(0.5, 0.6667, 0.3) == pytest.approx(0.61669)  # the paper: alpha weights Recall
    assert sparkle.leaf_reward(0.5, 0.6667, 0.7) == pytest.approx(0.55001)  # the code: 0.3 F1 + 0.7 Recall
    assert sparkle.leaf_reward(0.5, 0.6667, 0.0) == pytest.approx(0.6667) and sparkle.leaf_reward(0.5, 0.2, 1) == 0.5
    assert sparkle.context_recall(["d2", "d5", "d7"], {"metadata": {"supporting_doc_ids": ["d1", "d2"]}}) == 0.5
    assert sparkle.context_recall(["d2"], {"metadata": {}}) == 0.0 and sparkle.context_recall(["d2"], {}) == 0.0


def build(spec):
    """Nodes of a hand-built tree: spec is a list of (name, kind, parent name, reward or None)."""
    index, nodes = {}, []
    for name, kind, parent, reward in spec:
        index[name] = len(nodes)
        nodes.append(dict(kind=kind, parent=index.get(parent), reward=reward, name=name))
    return nodes


def chain(parent, tag):
    """The retrieval chain yes -> query -> triple of one decision (impl: the tree's node kinds)."""
    return [(f"Y{tag}", "rd", parent, None), (f"Q{tag}", "qf", f"Y{tag}", None), (f"T{tag}", "ki", f"Q{tag}", None)]


def hand_tree(with_c=True):
    """A hand-built tree, L = 2: leaves A (1.0), B (0.5), C (0.15), D (0.0); without C when Y2b's branch was pruned."""
    r = lambda recall, f1: sparkle.leaf_reward(recall, f1, 0.3)
    spec = [("root", "root", None, None), ("r1", "llm", "root", None), *chain("r1", "1"), ("N1", "rd", "r1", None)]
    spec += [("r2a", "llm", "T1", None), *chain("r2a", "2a"), ("N2a", "rd", "r2a", None)]
    spec += [("r3a", "llm", "T2a", None), ("A", "leaf", "r3a", r(1, 1)), ("r3b", "llm", "N2a", None)]
    spec += [("B", "leaf", "r3b", r(0.5, 0.5)), ("r2b", "llm", "N1", None), *chain("r2b", "2b")]
    spec += [("N2b", "rd", "r2b", None), ("r3d", "llm", "N2b", None), ("D", "leaf", "r3d", r(0, 0))]
    if with_c:
        spec += [("r3c", "llm", "T2b", None), ("C", "leaf", "r3c", r(0.5, 0))]
    return build(spec)


def test_monte_carlo_credit_on_the_hand_built_tree():
    nodes = hand_tree()
    credit = {n["name"]: c for n, c in zip(nodes, sparkle.leaf_credits(nodes))}
    assert [credit[k] for k in ("A", "B", "C", "D")] == pytest.approx([1.0, 0.5, 0.15, 0.0])
    expected = dict(Y1=0.75, Q1=0.75, T1=0.75, N1=0.075, Y2a=1.0, Q2a=1.0, T2a=1.0, N2a=0.5, Y2b=0.15, Q2b=0.15,
                    T2b=0.15, N2b=0.0)  # fmt: skip
    assert {k: credit[k] for k in expected} == pytest.approx(expected)


def test_a_pruned_branch_gives_no_credit_and_no_sample():
    nodes = hand_tree(with_c=False)  # Y2b's retrieval left the context unchanged: pruned, no leaf below it
    credit = {n["name"]: c for n, c in zip(nodes, sparkle.leaf_credits(nodes))}
    assert credit["N1"] == 0.0 and credit["Y2b"] is credit["Q2b"] is credit["T2b"] is None
    for n in nodes:
        n.update(prompt_ids=[1, 2], action_ids=[3] if n["kind"] in sparkle.AGENTS else None, fixed=None)
    samples = sparkle.op_samples([dict(nodes=nodes)])
    assert len(samples) == 12 - 3 and Counter_of(samples) == {"rd": 5, "qf": 2, "ki": 2}


def test_the_authors_code_shaping_on_the_hand_built_tree():
    # the authors' code's shaping (impl): Y2b pruned -> Y2b = value(N2b) - 0.1, N2b = 0.0 + 0.1; then each leaf's
    # last RD op -+0.05
    nodes = hand_tree(with_c=False)
    for n in nodes:
        n["text"] = "no" if n["name"].startswith("N") else "yes"
    nodes[[n["name"] for n in nodes].index("Y2b")]["pruned"] = True
    plain = sparkle.leaf_credits(nodes)
    credit = {n["name"]: c for n, c in zip(nodes, sparkle.toy.code_shaping(nodes, plain, sparkle.parse_rd))}
    assert credit["Y2b"] == pytest.approx(-0.1) and credit["N2b"] == pytest.approx(0.15)  # D's last RD: N2b, +0.05
    assert credit["Y2a"] == pytest.approx(0.95) and credit["N2a"] == pytest.approx(0.55)  # A's and B's last RD ops
    assert credit["Y1"] == pytest.approx(0.75) and credit["N1"] == pytest.approx(0.0)  # not a leaf's last: unchanged
    assert credit["Q2b"] is None and credit["Q2a"] == pytest.approx(1.0)  # QF and KI keep Eq. 2; the pruned: none
    for n in nodes:
        n.update(prompt_ids=[1, 2], action_ids=[3] if n["kind"] in sparkle.AGENTS else None, fixed=None)
    shaped = {s["credit"] for s in sparkle.op_samples([dict(nodes=nodes)], shaping=True)}
    assert len(sparkle.op_samples([dict(nodes=nodes)], shaping=True)) == 10 and -0.1 in {round(c, 6) for c in shaped}


def Counter_of(samples):
    return {a: sum(s["agent"] == a for s in samples) for a in sparkle.AGENTS}


def test_credit_is_a_mean_over_leaves_not_over_child_means():
    # Eq. 2 with L = 3: under T1 two leaves (1.0, 0.8) below its Yes chain, one (0.5) below its No child
    spec = [("root", "root", None, None), ("r1", "llm", "root", None), *chain("r1", "1"), ("r2", "llm", "T1", None)]
    spec += [*chain("r2", "2"), ("N2", "rd", "r2", None), ("r3", "llm", "T2", None), ("a", "leaf", "r3", 1.0)]
    spec += [("b", "leaf", "r3", 0.8), ("r4", "llm", "N2", None), ("c", "leaf", "r4", 0.5)]
    nodes = build(spec)
    credit = {n["name"]: c for n, c in zip(nodes, sparkle.leaf_credits(nodes))}
    assert credit["Y1"] == pytest.approx(2.3 / 3) and credit["Y1"] != pytest.approx(0.7)


# ---------------------------------------------------------------- parsers [§2.2; impl]
TABLE_8_QF = """Step 1: Reasoning Chain: <"The Promise (1995 Film)"; directed by; [unknown director]>
Step 2: Knowledge Gaps: To continue answering the question, we need to know: Who directed the film "The Promise" \
(1995)? Identifying the director will allow us to find out who their spouse is.
Step 3: Retrieval Query: **Who directed the film "The Promise" (1995)?**"""


def test_parse_query_formulation():
    chain_text, query = sparkle.parse_qf(TABLE_8_QF, "q")
    assert chain_text == '<"The Promise (1995 Film)"; directed by; [unknown director]>'
    assert query == 'Who directed the film "The Promise" (1995)?'
    compact = "step 1 : chain : < zorvak ; directed by ; [ unknown ] > step 2 : gap : x step 3 : query : zorvak born"
    assert sparkle.parse_qf(compact, "q") == ("< zorvak ; directed by ; [ unknown ] >", "zorvak born")
    assert sparkle.parse_qf("Step 1: Reasoning Chain: <a; b; c>\nStep 3: Retrieval Query: None.", "q")[1] is None
    assert sparkle.parse_qf("step 3 : query : nonesuch company founded", "q")[1] == "nonesuch company founded"
    assert sparkle.parse_qf("no steps at all", "who ?") == ("", "Question: who ?\nno steps at all")  # impl fallback
    assert sparkle.parse_qf("step 1 : chain : <a ; b", "q") == ("<a ; b", "Question: q\nstep 1 : chain : <a ; b")
    assert sparkle.parse_qf("zorvak directed", "q", direct=True) == ("", "zorvak directed")
    assert sparkle.parse_qf(" None ", "q", direct=True) == ("", None)
    rendered = sparkle.TEMPLATES["compact"]["qf_output"].format(chain="<zorvak; directed by; [unknown]>", gap="g",
                                                                 query="None")  # fmt: skip
    assert sparkle.parse_qf(rendered, "q") == ("<zorvak; directed by; [unknown]>", None)


FIG_5_QF = """[Step 1: Generate Reasoning Chain]
<Ignite!Learning; co-founded by; Neil Bush>, <Neil Bush; child of; [unknown]>

[Step 2: Identify Knowledge Gaps]
To continue answering the question, we need to know: who the mother of Neil Bush is

[Step 3: Formulate Retrieval Query]
Who is the mother of Neil Bush?"""
MARKDOWN_QF = """<think>Step 1 first: Neil Bush is the son of George H. W. Bush, yes. Step 3: a query.</think>
**Step 1: Reasoning Chain:** <Ignite!Learning; co-founded by; Neil Bush>, <Neil Bush; child of; [unknown]>

### Step 2: Knowledge Gaps
To continue answering the question, we need to know: his mother

### Step 3: Retrieval Query
**Who is the mother of Neil Bush?**

This query targets the missing parent."""


@pytest.mark.parametrize("text", [FIG_5_QF, MARKDOWN_QF, FIG_5_QF.replace("\n\n", "\n")])
def test_parse_query_formulation_as_the_paper_shows_a_model_writing_it(text):
    # Fig. 5's bracketed step headers (the paper set's QF prompt has no `Step 1: Reasoning Chain:` scaffold to copy),
    # markdown headers, bold, a <think> block that mentions the steps, text after the query
    chain = "<Ignite!Learning; co-founded by; Neil Bush>, <Neil Bush; child of; [unknown]>"
    assert sparkle.parse_qf(text, "q") == (chain, "Who is the mother of Neil Bush?")
    none = text.replace("Who is the mother of Neil Bush?", "None")
    assert sparkle.parse_qf(none, "q") == (chain, None)
    tpl = sparkle.TEMPLATES["paper"]  # the paper set's QF output as Tab. 8 prints one (the toy oracle writes it)
    rendered = tpl["qf_output"].format(
        chain="<Neil Bush; child of; [unknown]>", gap="his mother", query="Who is his mother?"
    )
    assert rendered.startswith("Step 1: Reasoning Chain: <Neil Bush; child of; [unknown]>\nStep 2: Knowledge Gaps:")
    assert sparkle.parse_qf(rendered, "q") == ("<Neil Bush; child of; [unknown]>", "Who is his mother?")


def test_the_agents_parsers_read_past_a_think_block():
    assert not sparkle.parse_rd("<think>Is a retrieval needed? Yes, maybe.</think>\nNo (retrieval is not required)")
    assert sparkle.parse_rd("**Yes (retrieval is required)**") and not sparkle.parse_rd("<think>yes, yes")
    hit = dict(title="t")
    cands = [(hit, "<Neil Bush; child of; George H. W. Bush>"), (hit, "<Neil Bush; mother; Barbara Bush>")]
    assert sparkle.parse_ki("<think>not <Neil Bush; child of; George H. W. Bush></think>\n<Neil Bush; mother; "
                            "Barbara Bush>", cands) == 1  # fmt: skip
    assert sparkle.parse_ki("<think>the second</think> 2", cands, direct=True) == 1


def test_parse_knowledge_integration_and_retrieval_decision():
    hit = dict(title="t")
    cands = [(hit, "<Radclyffe Hall; occupation; poet and author>"), (hit, "<Radclyffe Hall; born in; Bournemouth>")]
    assert sparkle.parse_ki("<Radclyffe Hall; occupation; poet and author>", cands) == 0
    assert sparkle.parse_ki("I pick Radclyffe Hall born in Bournemouth", cands) == 1  # no <...>: the whole output
    assert sparkle.parse_ki("< radclyffe hall ; born in", cands) == 1  # unclosed triple: the whole output
    assert sparkle.parse_ki("<zorvak; directed by; velbo>", cands) is None  # no overlap with any candidate
    assert (
        sparkle.parse_ki("2", cands, direct=True) == 1 and sparkle.parse_ki("Document 3", cands, direct=True) is None
    )
    assert sparkle.parse_ki("none", cands, direct=True) is None and sparkle.parse_ki("x", [], direct=False) is None
    assert sparkle.parse_rd("Yes (retrieval is required)") and not sparkle.parse_rd("No (retrieval is not required)")
    assert sparkle.parse_rd("yes") and not sparkle.parse_rd("")


def test_answer_extraction_and_thought_conversion():
    assert sparkle.extract_answer("<think> a </think>\n<answer> Volker Schlöndorff </answer>") == "Volker Schlöndorff"
    assert sparkle.extract_answer("<answer></answer> <answer> y </answer>") == "y"
    assert sparkle.extract_answer("<think> a </think> <answer> paris") == "paris"
    assert sparkle.extract_answer("<think> zorvak is a film directed by velbo . </think>") == (
        "zorvak is a film directed by velbo ."
    )
    assert sparkle.extract_answer("so the answer is Paris.\n\n\\boxed{Paris}") == "Paris"  # a reasoning LLM [Fig. 7]
    assert (
        sparkle.extract_answer("\\boxed{1931} then \\boxed{\\text{Volker Schl\u00f6ndorff}}")
        == "Volker Schl\u00f6ndorff"
    )
    assert sparkle.extract_answer("\\boxed{f(x^{2})}") == "f(x^{2})"
    assert sparkle.thought_text("<think> A </think>\n<think> B </think>") == "A\n\nB\n\n"
    assert sparkle.thought_text("") == "" and sparkle.thought_text("<think>  </think>") == ""


def test_templates_render_every_agent_in_both_sets():
    docs = [dict(id="1", title="zorvak", text="zorvak is a film directed by velbo .")]
    for name, tpl in sparkle.TEMPLATES.items():
        thoughts = "<think> i need to know the director of zorvak . </think>\n"
        messages = sparkle.llm_messages(tpl, args_for(), "who is the director of zorvak ?", docs, thoughts)
        assert [m["role"] for m in messages] == ["user", "assistant"] and "<think>" in messages[0]["content"]
        assert "zorvak is a film directed by velbo ." in messages[0]["content"]
        assert "<search>" in sparkle.llm_messages(tpl, args_for(ablation="no_rd"), "q", docs, thoughts)[0]["content"]
        fields_of = dict(rd="context question history current", qf="question thoughts", qf_direct="question thoughts",
                         ki="candidates question chain query", ki_direct="candidates question query",
                         rd_qf="context question history current")  # fmt: skip
        for key, fields in fields_of.items():
            text = tpl[key].format(**{f: f"<{f}>" for f in fields.split()})
            assert all(f"<{f}>" in text for f in fields.split()), (name, key)
        assert sparkle.parse_rd(tpl["rd_yes"]) and not sparkle.parse_rd(tpl["rd_no"])
    assert "Candidate Triples" in sparkle.PAPER_TEMPLATES["ki"] and "Step 3" in sparkle.PAPER_TEMPLATES["qf_system"]
    assert "retrieval is required" in sparkle.PAPER_TEMPLATES["rd_qf_system"]


# ---------------------------------------------------------------- PPO numbers [Tab. 6; impl: OpenRLHF]
def test_gae_kl_reward_and_reward_clip():
    adv, ret = sparkle.gae([0.0, 0.0, 1.0], [0.2, 0.4, 0.6], 1.0, 0.95)
    assert adv == pytest.approx([0.751, 0.58, 0.4]) and ret == pytest.approx([0.951, 0.98, 1.0])
    adv, _ = sparkle.gae([0, 0, 0, 0, 0.75], [0.0] * 5, 1.0, 0.95)
    assert adv == pytest.approx([0.61088, 0.64303, 0.676875, 0.7125, 0.75], abs=1e-5)
    rewards = sparkle.token_rewards(0.75, [0.5, -0.2, 0.1], [0.0, 0.0, 0.0], 0.002)
    assert rewards == pytest.approx([-0.001, 0.0004, 0.7498])
    assert sparkle.token_rewards(12.0, [0.0], [0.0], 0.002) == [10.0] and sparkle.token_rewards(-12, [0], [0], 0) == [
        -10
    ]


@pytest.mark.parametrize("ratio, advantage, loss", [(1.3, 1.0, -1.2), (0.7, -1.0, 0.8), (1.1, 1.0, -1.1)])
def test_clipped_surrogate(ratio, advantage, loss):
    new = torch.tensor([[math_log(ratio), 5.0]])
    got, _ = sparkle.clipped_surrogate(
        new, torch.zeros(1, 2), torch.tensor([[advantage, 9.0]]), torch.tensor([[1.0, 0.0]]), 0.2
    )
    assert got.tolist() == pytest.approx([loss])  # the masked token changes nothing


def math_log(x):
    return float(torch.log(torch.tensor(x, dtype=torch.float64)))


def test_value_loss_clips_and_averages_per_operation():
    v, old, g, mask = (
        torch.tensor([[0.9, 0.0]]),
        torch.tensor([[0.5, 0.0]]),
        torch.tensor([[1.0, 0.0]]),
        torch.ones(1, 2),
    )
    assert 0.5 * sparkle.value_loss(v, old, g, mask[:, :1].expand(1, 2) * torch.tensor([[1.0, 0.0]]), 0.2).item() == (
        pytest.approx(0.045)
    )
    assert sparkle.value_loss(v, old, g, torch.tensor([[1.0, 0.0]]), 0.0).item() == pytest.approx(0.01)
    two = sparkle.value_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [2.0, 0.0]]),
                             torch.tensor([[1.0, 1.0], [1.0, 0.0]]), 0.0)  # fmt: skip
    assert two.tolist() == pytest.approx([1.0, 4.0])  # a mean over each operation's tokens, not over the batch's


class FakeLM(torch.nn.Module):
    """A 'model' whose logits are a parameter: the per-token gather and the masks can be checked by hand."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.logits)


def test_loss_mask_is_exactly_the_action_and_prompt_logits_get_no_gradient():
    op = dict(kind="rd", parent=1, prompt_ids=[5, 6, 7], action_ids=[8, 9], fixed=None)
    nodes = [dict(kind="root", parent=None), dict(kind="llm", parent=0), op, dict(kind="leaf", parent=2, reward=0.5)]
    (sample,) = sparkle.op_samples([dict(nodes=nodes)])
    assert sample["ids"] == [5, 6, 7, 8, 9] and sample["loss_mask"] == [0, 0, 0, 1, 1] and sample["credit"] == 0.5
    ids, attention, mask = sparkle.batch_tensors([sample], 0, "cpu")
    assert mask.tolist() == [[0, 0, 1, 1]]  # shifted with the labels: positions 2 and 3 predict tokens 8 and 9
    model = FakeLM(torch.randn(1, 5, 12))
    logp = sparkle.token_logp(model, ids, attention)
    assert logp[0, 2].item() == pytest.approx(torch.log_softmax(model.logits[0, 2], -1)[8].item())
    loss, _ = sparkle.clipped_surrogate(logp, logp.detach(), torch.ones_like(logp), mask, 0.2)
    loss.sum().backward()
    grad = model.logits.grad.abs().sum(-1)[0]
    assert grad[2] > 0 and grad[3] > 0 and grad[0] == grad[1] == grad[4] == 0


def test_a_sampled_rd_output_is_trained_as_the_exact_yes_or_no_it_parses_to():
    nodes = [dict(kind="root", parent=None), dict(kind="llm", parent=0)]
    texts = ["step 1 : chain : < a ; b ; c > yes", "step 1 : chain : < a ; b ; c >", "no"]
    nodes += [dict(kind="rd", parent=1, prompt_ids=[5], action_ids=[30, 31, 32], fixed=None, text=t) for t in texts]
    nodes += [dict(kind="qf", parent=2, prompt_ids=[6], action_ids=[40, 41], fixed=None, text="step 1 : x")]
    nodes += [dict(kind="leaf", parent=5, reward=1.0), dict(kind="leaf", parent=3, reward=0.0)]
    nodes += [dict(kind="leaf", parent=4, reward=0.0)]
    canonical = {True: [8, 2], False: [9, 2]}
    yes, no, no_again, qf = sparkle.op_samples([dict(nodes=nodes)], canonical)
    assert [yes["ids"], no["ids"], no_again["ids"]] == [
        [5, 8, 2],
        [5, 9, 2],
        [5, 9, 2],
    ]  # impl: the RD agent's canonical answers
    assert yes["loss_mask"] == [0, 1, 1] and qf["ids"] == [6, 40, 41]  # QF and KI keep their sampled tokens
    assert [s["ids"] for s in sparkle.op_samples([dict(nodes=nodes)])][:2] == [[5, 30, 31, 32]] * 2  # none: raw


def test_forced_rd_answers_are_flagged_and_their_policy_loss_scaled_by_the_forced_weight():
    nodes = [dict(kind="root", parent=None), dict(kind="llm", parent=0)]
    nodes += [dict(kind="rd", parent=1, prompt_ids=[5], action_ids=[8, 2], fixed=f) for f in ("yes", None)]
    nodes += [dict(kind="leaf", parent=2, reward=1.0), dict(kind="leaf", parent=3, reward=0.0)]
    forced, sampled = sparkle.op_samples([dict(nodes=nodes)])
    assert forced["forced"] is True and sampled["forced"] is False  # Eq. 1's forced Yes, a sampled RD output
    logp, mask, adv = torch.zeros(2, 2, requires_grad=True), torch.ones(2, 2), torch.ones(2, 2)
    loss, _ = sparkle.clipped_surrogate(logp, logp.detach(), adv, mask, 0.2, torch.tensor([[0.1], [1.0]]))
    assert loss.tolist() == pytest.approx([-0.1, -1.0])  # the forced operation's term times 0.1, the other's whole
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.05, -0.05]) and logp.grad[1].tolist() == pytest.approx(
        [-0.5, -0.5]
    )
    assert sparkle.Args().forced_weight is None and sparkle.PRESETS["forced_weight"] == (0.1, 1.0)


class TableLM(torch.nn.Module):
    """A model whose output at a position depends on that position's token alone (a table): logits, or a value."""

    def __init__(self, width, seed, value=False):
        super().__init__()
        self.table, self.value = (
            torch.nn.Parameter(torch.randn(12, width, generator=torch.Generator().manual_seed(seed))),
            value,
        )

    def forward(self, input_ids, attention_mask):
        out = self.table[input_ids]  # (B, T, width)
        return out[..., 0] if self.value else SimpleNamespace(logits=out)


def test_ppo_update_steps_along_the_hand_computed_gradient():
    # one minibatch of three operations (one a forced RD answer at weight 0.5), plain SGD at lr 1: the step is minus
    # the gradient of (1/N) sum_i [-(1/n_i) sum_t w_i A_it r_it + vf (1/n_i) sum_t (V_it - G_it)^2], r = 1, A whitened
    # GAE of the KL-shaped rewards (KL 0: the reference is the policy), G = A + V: a sign, a term or a normaliser off
    # moves it
    from accelerate import Accelerator

    policy, value = TableLM(12, 0), TableLM(1, 1, value=True)
    samples = [dict(ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], credit=0.9, agent="rd", forced=True),
               dict(ids=[1, 5, 6, 7, 8], loss_mask=[0, 0, 1, 1, 1], credit=0.2, agent="qf", forced=False),
               dict(ids=[2, 9, 10], loss_mask=[0, 1, 1], credit=-0.4, agent="ki", forced=False)]  # fmt: skip
    args = args_for(micro_batch_size=2, ppo_batch_size=64, forced_weight=0.5, max_grad_norm=1e9, kl_coef=0.002)
    tables = [m.table.detach().clone().requires_grad_() for m in (policy, value)]
    pieces = []
    for s in samples:
        ids, mask = torch.tensor(s["ids"]), torch.tensor(s["loss_mask"][1:]).bool()
        logp = torch.log_softmax(tables[0][ids[:-1]], -1).gather(-1, ids[1:, None]).squeeze(-1)[mask]
        v = tables[1][ids[:-1], 0][mask]
        rewards = sparkle.token_rewards(s["credit"], logp.tolist(), logp.tolist(), args.kl_coef)  # KL 0
        adv, ret = sparkle.gae(rewards, v.tolist(), args.gamma, args.lam)
        pieces.append((logp, v, torch.tensor(adv), torch.tensor(ret), 0.5 if s["forced"] else 1.0))
    flat = torch.cat([a for _, _, a, _, _ in pieces])
    mean, std = flat.mean(), flat.std(correction=0)
    loss = sum(-(w * (a - mean) / (std + 1e-8) * torch.exp(lp - lp.detach())).mean() for lp, _, a, _, w in pieces)
    loss = (loss + args.vf_coef * sum(((v - g) ** 2).mean() for _, v, _, g, _ in pieces)) / len(samples)
    loss.backward()
    ref = copy.deepcopy(policy).requires_grad_(False)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (policy, value)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
    out = sparkle.ppo_update(Accelerator(cpu=True), policy, value, ref, optimizers, schedulers, samples, 0, args)
    for model, table in zip((policy, value), tables):
        assert torch.allclose(table - model.table.detach(), table.grad, atol=1e-6), model.value
    assert out["losses/clipfrac"] == 0.0 and abs(out["losses/approx_kl"]) < 1e-12


def test_ppo_update_whitens_over_the_rollout_with_the_population_variance(monkeypatch):
    from accelerate import Accelerator

    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    samples = [dict(ids=[4, 7, 8], loss_mask=[0, 1, 1], credit=0.75, agent="rd", forced=True),
               dict(ids=[4, 9, 10, 11], loss_mask=[0, 1, 1, 1], credit=0.5, agent="qf", forced=False)]  # fmt: skip
    hand = [
        dict(adv=[0.75, 0.75], ret=[0.0, 0.0], val=[0.0, 0.0]),
        dict(adv=[0.075, 1.0, 0.5], ret=[0.0] * 3, val=[0.0] * 3),
    ]
    score, surrogate, seen = sparkle.score_samples, sparkle.clipped_surrogate, []

    def fake_score(*a):
        score(*a)
        for sample, h in zip(samples, hand):
            sample.update(h)

    def spy(new, old, adv, mask, clip, weights):
        seen.append(adv[mask.bool()].tolist())
        seen.append(sorted(weights.flatten().tolist()))
        return surrogate(new, old, adv, mask, clip, weights)

    monkeypatch.setattr(sparkle, "score_samples", fake_score)
    monkeypatch.setattr(sparkle, "clipped_surrogate", spy)
    args = args_for(micro_batch_size=4, ppo_batch_size=8, forced_weight=0.1)
    ref, value = copy.deepcopy(model), sparkle.ValueModel(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, value)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
    sparkle.ppo_update(Accelerator(cpu=True), model, value, ref, optimizers, schedulers, samples, 0, args)
    assert sorted(seen[0]) == pytest.approx(sorted([0.4315, 0.4315, -1.7258, 1.2305, -0.3675]), abs=1e-4)
    assert seen[1] == pytest.approx([0.1, 1.0])  # the forced operation's weight: --forced_weight


# ---------------------------------------------------------------- the rollout with scripted agents [§3.1, Alg. 1]
class FakeEnv:
    """A scripted LLM (a thought per call, the answer at step `answer_at`) and retriever (a new document per query, or
    always the same one); every document has one triple. Calls are counted."""

    def __init__(self, answer_at=3, same_document=False):
        self.answer_at, self.same, self.calls, self.searches = answer_at, same_document, [], 0
        self.retriever = SimpleNamespace(encoder=TfidfEncoder().fit(["a relation b", "doc"]))

    def chat(self, messages_lists, rows, **sampling):
        self.calls.append(len(messages_lists))
        steps = [m[-1]["content"].count("<think>") + 1 if m[-1]["role"] == "assistant" else 1 for m in messages_lists]
        return ["<answer> b </answer>" if s >= self.answer_at else f"<think> step {s} </think>" for s in steps]

    def search(self, queries, k, rows):
        hits = []
        for _ in queries:
            self.searches += 1
            i = 0 if self.same else self.searches
            hits.append([dict(id=f"d{i}", title=f"t{i}", text="doc", triples=[f"<a; relation; b{i}>"])])
        return hits


def scripted(rd="no", log=None):
    """act(requests, seed): forced texts as given; RD writes `rd` (a list: one per call), QF a query, KI the first."""
    answers = iter(rd) if isinstance(rd, list) else None

    def act(requests, seed):
        if log is not None:
            log.append([r.agent for r in requests])
        out = []
        for r in requests:
            if r.fixed is not None:
                text = r.fixed
            elif r.agent == "rd":
                text = next(answers) if answers else rd
            elif r.agent == "qf":
                text = "step 1 : chain : <a ; relation ; [unknown]> step 2 : gap : b step 3 : query : a relation"
            else:
                text = r.cands[0][1]
            out.append((text, [1, 2], [3, 4]))
        return out

    return act


ROW = dict(id="q", question="what is b ?", golden_answers=["b"], metadata={"supporting_doc_ids": ["d1", "d2"]})


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_binary_tree_has_two_to_the_L_leaves_and_its_op_counts(depth):
    args = args_for(tree_depth=depth)
    log = []
    (tree,) = sparkle.rollout([ROW], scripted(log=log), FakeEnv(answer_at=depth + 1), args, "tree")
    leaves = [n for n in tree["nodes"] if n["kind"] == "leaf"]
    ops = {a: [n for n in tree["nodes"] if n["kind"] == a] for a in sparkle.AGENTS}
    expansions = 2**depth - 1
    assert len(leaves) == 2**depth
    assert [len(ops[a]) for a in sparkle.AGENTS] == [2 * expansions, expansions, expansions]
    assert all(n["fixed"] in ("yes", "no") for n in ops["rd"])  # the tree part's RD answers are forced, not sampled
    yes_no = [(a["prompt"], b["prompt"]) for a, b in zip(ops["rd"][::2], ops["rd"][1::2])]
    assert all(a == b for a, b in yes_no)  # the Yes and No operations of a decision share their state
    assert all(len(set(call)) == 1 for call in log) and len(log) == 3 * depth  # one proxy call per agent and depth
    assert min(n["reward"] for n in leaves) == pytest.approx(0.7)  # the all-No path: F1 1, no document: recall 0


def test_pruning_removes_retrieval_branches_that_leave_the_context_unchanged():
    args = args_for(tree_depth=2)
    (tree,) = sparkle.rollout([ROW], scripted(), FakeEnv(answer_at=3, same_document=True), args, "tree")
    leaves = [n for n in tree["nodes"] if n["kind"] == "leaf"]
    assert len(leaves) == 3  # step 2's retrieval below step 1's retrieval finds the same document again
    assert sum(n.get("pruned", False) for n in tree["nodes"]) == 1
    samples = sparkle.op_samples([tree | {"nodes": tree["nodes"]}])
    assert Counter_of(samples) == {"rd": 5, "qf": 2, "ki": 2}  # the pruned chain's RD, QF and KI give no sample


def test_standard_rollout_after_L_and_rd_sampled_throughout():
    args = args_for(tree_depth=1)
    (tree,) = sparkle.rollout([ROW], scripted(rd="yes"), FakeEnv(answer_at=3), args, "tree")
    assert len([n for n in tree["nodes"] if n["kind"] == "leaf"]) == 2  # binary at step 1 only, then one path each
    rd = [n for n in tree["nodes"] if n["kind"] == "rd"]
    assert [n["fixed"] for n in rd] == ["yes", "no", None, None]
    (tree,) = sparkle.rollout([ROW], scripted(rd="yes"), FakeEnv(answer_at=3), args, "standard")
    assert len([n for n in tree["nodes"] if n["kind"] == "leaf"]) == 1
    assert all(n["fixed"] is None for n in tree["nodes"] if n["kind"] == "rd")


def test_without_rd_a_tree_rollout_is_one_unpruned_path():
    env = FakeEnv(answer_at=4, same_document=True)
    chat = FakeEnv.chat
    env.chat = lambda messages_lists, rows, **kw: [
        r.replace("step", "<search>") for r in chat(env, messages_lists, rows)
    ]
    (tree,) = sparkle.rollout([ROW], scripted(), env, args_for(ablation="no_rd", tree_depth=2), "tree")
    assert [n["kind"] for n in tree["nodes"]].count("leaf") == 1 and env.searches == 3  # the LLM asked three times
    assert not any(n["kind"] == "rd" for n in tree["nodes"])


def test_inference_loop_with_scripted_agents():
    args = args_for()
    env = FakeEnv(answer_at=3)
    (tree,) = sparkle.rollout([ROW], scripted(rd=["Yes (retrieval is required)", "No"]), env, args, "greedy")
    kinds = [n["kind"] for n in tree["nodes"][1:]]
    assert kinds == ["llm", "rd", "qf", "ki", "llm", "rd", "llm", "leaf"] and env.searches == 1
    leaf = tree["nodes"][-1]
    assert leaf["docs"] == ["d1"] and leaf["answer"] == "b" and leaf["recall"] == 0.5 and leaf["f1"] == 1.0
    assert leaf["trace"] == [(["d1"], 1), (["d1"], 1), (["d1"], 1)] and tree["llm_calls"] == 3
    args = args_for(max_retrievals=1)
    env = FakeEnv(answer_at=4)
    (tree,) = sparkle.rollout([ROW], scripted(rd="yes"), env, args, "greedy")  # RD is not asked after the cap
    assert [n["kind"] for n in tree["nodes"]].count("rd") == 1 and env.searches == 1
    (tree,) = sparkle.rollout([ROW], scripted(rd="yes"), FakeEnv(answer_at=99), args_for(max_steps_eval=3), "greedy")
    assert tree["nodes"][-1]["why"] == "max_steps" and tree["llm_calls"] == 4  # one non-stepwise generation more


def test_a_reasoning_llm_steps_in_paragraphs_and_answers_in_boxed():
    # [App. A.4, Fig. 7] --reasoning_llm: Fig. 7's prompt, one paragraph a step (stop at a blank line), no <think> tags
    # added, and the step with \\boxed{} ends the trajectory with its content as the answer
    env, seen = FakeEnv(), []

    def chat(messages_lists, rows, **sampling):
        seen.extend((m[0]["content"], sampling["stop"]) for m in messages_lists)
        steps = [m[-1]["content"].count("\n\n") + 2 if m[-1]["role"] == "assistant" else 1 for m in messages_lists]
        return [
            "so it is b .\n\n\\boxed{b}" if s >= 3 else "<think>\n" * (s == 1) + f"step {s} : which b ?\n\n"
            for s in steps
        ]

    env.chat = chat
    args = args_for(reasoning_llm=True, templates="paper")
    (tree,) = sparkle.rollout([ROW], scripted(rd="No"), env, args, "greedy")
    fig_7 = "Instruction:\nPlease answer the following question. You should think step-by-step to solve it. Provide "
    assert seen[0][0].startswith(fig_7 + "your final answer in the format \\boxed{YOUR_ANSWER}.")
    assert all(stop == ["\n\n"] for _, stop in seen) and len(seen) == 3
    llm = [n["text"] for n in tree["nodes"] if n["kind"] == "llm"]
    assert llm[:2] == ["<think>\nstep 1 : which b ?", "step 2 : which b ?"]  # no </think> added to a reasoning step
    assert tree["nodes"][-1]["answer"] == "b" and tree["nodes"][-1]["f1"] == 1.0
    rd = [n for n in tree["nodes"] if n["kind"] == "rd"]
    assert (
        len(rd) == 2
        and "Previous Reasoning: step 1 : which b ?\n\n\nCurrent Reasoning Step: step 2 : which b ?"
        in rd[1]["prompt"][1]
    )


def test_prompts_and_sft_sequences_fit_the_papers_max_length():
    # [Tab. 5, 6] max length 2048: a prompt longer than max_length - max_new_tokens is cut in the middle (both ends
    # kept), in the rollout as in SFT; an SFT sequence holds at most max_length tokens, its target's labels kept
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    long = ("system", "question : " + " ".join(["zorvak"] * 300) + " velbo")
    (full,), (cut,) = sparkle.encode_prompts(tokenizer, [long]), sparkle.encode_prompts(tokenizer, [long], 101)
    assert len(full) > 300 and len(cut) == 101 and cut[:50] == full[:50] and cut[50:] == full[-51:]
    args = args_for(max_length=120, max_new_tokens=16)
    ids, labels, attention = sparkle.sft_batch([(dict(prompt=long, output="velbo"), "0")], tokenizer, args, None)
    target = tokenizer("velbo", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert (
        ids.shape == (1, 104 + len(target)) and labels[0, 104:].tolist() == target and (labels[0, :104] == -100).all()
    )
    request = sparkle.Request(None, "rd", long)
    ((_, prompt_ids, action_ids),) = sparkle.proxy_actor(model, tokenizer, args, greedy=True)([request], 0)
    assert prompt_ids == sparkle.encode_prompts(tokenizer, [long], 104)[0] and len(prompt_ids + action_ids) <= 120
    assert sparkle.Args().max_length == 2048


def test_add_documents_deduplicates_and_evicts_the_oldest():
    docs = [dict(id=i) for i in "abc"]
    assert [d["id"] for d in sparkle.add_documents(docs, [dict(id="b"), dict(id="d"), dict(id="d")], 3)] == list("bcd")


def test_the_context_keeps_the_best_documents_in_rank_order():
    # w/o KI [App. D.2] under the paper preset: top-10 hits, a context of 5: ranks 1-5 stay, never ranks 6-10
    ranked = [dict(id=f"r{i}") for i in range(1, 11)]
    assert [d["id"] for d in sparkle.add_documents([], ranked, 5)] == ["r1", "r2", "r3", "r4", "r5"]
    old = [dict(id="a"), dict(id="r2")]  # r2 already there: ranks 1, 3-5 join it, the oldest goes
    assert [d["id"] for d in sparkle.add_documents(old, ranked, 5)] == ["r2", "r1", "r3", "r4", "r5"]
    env = FakeEnv(answer_at=2)
    env.search = lambda queries, k, rows: [[dict(id=f"r{i}", title="t", text="doc") for i in range(1, k + 1)]]
    (tree,) = sparkle.rollout([ROW], scripted(rd="yes"), env, args_for(ablation="no_ki", top_k=10), "greedy")
    assert tree["nodes"][-1]["docs"] == ["r1", "r2", "r3", "r4", "r5"]


def test_triples_ranked_by_question_and_query():
    encoder = TfidfEncoder().fit(["zorvak directed velbo", "zorvak released 1950", "other born city"])
    hits = [dict(id="1", triples=["<zorvak; release year; 1950>", "<zorvak; directed by; velbo>"]),
            dict(id="2", triples=["<other; born in; city>"])]  # fmt: skip
    (ranked,) = sparkle.rank_triples(encoder, ["who directed zorvak ?"], ["zorvak directed"], [hits], 2)
    assert [t for _, t in ranked] == ["<zorvak; directed by; velbo>", "<zorvak; release year; 1950>"]
    assert sparkle.rank_triples(encoder, ["q"], ["q"], [[dict(id="3")]], 2) == [[]]


# ---------------------------------------------------------------- the toy world: reader, renaming, oracle teacher
def test_toy_reader_think_mode_fits_the_llm_prompt():
    from common.toy import ToyReader

    reader, tpl = ToyReader(ROOT / "data/toy"), sparkle.TEMPLATES["compact"]
    row = next(r for r in map(json.loads, (ROOT / "data/toy/test.jsonl").read_text().splitlines())
               if r["metadata"]["type"] == "two_hop" and not any(r["metadata"]["popular_hops"]))  # fmt: skip
    step = reader.chat([sparkle.llm_messages(tpl, args_for(), row["question"], [], "")], stop=["</think>"])[0]
    assert step.startswith("<think> i need to know") and step.endswith("</think>")
    whole = reader.chat([sparkle.llm_messages(tpl, args_for(), row["question"], [], "")], stop=[])[0]
    assert whole.count("<think>") == 2 and whole.endswith("<answer> unknown </answer>")  # not stopped: to the end
    search = reader.chat([sparkle.llm_messages(tpl, args_for(ablation="no_rd"), row["question"], [], "")])[0]
    assert search.startswith("<think> <search> i need to know")


def test_renaming_env_renames_the_triples_of_a_hit():
    from common.toy import RenamingEnv

    class Retriever:
        def search(self, queries, k):
            return [[dict(id="1", title="zorvak", text="x", contents="x", triples=["<zorvak; directed by; velbo>"])]]

    row = dict(rename=({"zorvak": "kimo", "velbo": "dapu"}, {"kimo": "zorvak", "dapu": "velbo"}))
    ((hit,),) = RenamingEnv(Retriever()).search(["kimo directed"], 1, [row])
    assert hit["title"] == "kimo" and hit["triples"] == ["<kimo; directed by; dapu>"] and hit["id"] == "1"


@pytest.fixture(scope="module")
def toy():
    args = args_for(n_train=60)
    env = sparkle.environment(args)
    rows = [r for r in map(json.loads, (ROOT / "data/toy/train.jsonl").read_text().splitlines())
            if r["metadata"]["type"] in ("one_hop", "two_hop")][:60]  # fmt: skip
    return args, env, rows


@pytest.mark.parametrize("ablation", sparkle.ABLATIONS)
def test_the_oracle_teacher_solves_questions_under_every_ablation(toy, ablation):
    args, env, rows = toy
    args = replace_args(args, ablation=ablation, teacher_noise=0.0)
    env = sparkle.environment(args) if ablation in ("no_ki", "direct_ki") else env
    trees = sparkle.rollout(rows, sparkle.teacher_actor(args, env.llm, 0), env, args, "standard")
    f1 = [
        next(n for n in t["nodes"] if n["kind"] == "leaf")["f1"] for t in trees if t["row"]["metadata"]["answerable"]
    ]
    kinds = {n["kind"] for t in trees for n in t["nodes"]}
    if ablation == "no_ki":  # every retrieved document joins the context: decoys read last mislead the toy reader
        assert 0.75 <= sum(f1) / len(f1) < 1
    else:  # KG triples pick the right document
        assert sum(f1) == len(f1) > 40, ablation
    assert ("rd" in kinds) is (ablation != "no_rd") and ("qf" in kinds) is (ablation != "no_qf")
    assert ("ki" in kinds) is (ablation != "no_ki")
    if ablation == "direct_ki":
        assert all(n["text"].isdigit() for t in trees for n in t["nodes"] if n["kind"] == "ki")


def replace_args(args, **changes):
    from dataclasses import replace

    return replace(args, **changes)


def teacher_trees(args, env, rows, k=4):
    """The warm-up's rollout: the teacher playing the proxy, k trajectories per question."""
    samples = [dict(r, sample=i) for r in rows for i in range(k)]
    return sparkle.rollout(samples, sparkle.teacher_actor(args, env.llm, args.seed), env, args, "standard")


def test_cheapest_warm_up_keeps_the_fewest_retrievals(toy):
    args, env, rows = toy
    trees, without = teacher_trees(args, env, rows[:20]), 0
    for group in (trees[i : i + 4] for i in range(0, len(trees), 4)):
        got = sparkle.successful_paths(group, "cheapest")
        wins = [n for t in group for n in t["nodes"] if n["kind"] == "leaf" and n["why"] == "answer" and n["f1"] == 1]
        if got:
            fewest = min(n["trace"][-1][1] for n in wins)
            assert sum(e["agent"] == "ki" for e in got) <= fewest * len(wins)
            assert all(isinstance(e["prompt"], tuple) and e["output"] for e in got)
            if fewest == 0:  # (popular questions: the toy reader knows them) the cheapest success asks nothing
                assert all(e["output"] == "no" for e in got)
                without += len(got) < len(sparkle.successful_paths(group))  # a needless Yes, now left out
    assert without >= 2


def current_step(prompt):
    """The current reasoning step of an RD prompt, either template set."""
    return prompt[1].replace("Current Reasoning Step:", "current :").rsplit("current :", 1)[1]


@pytest.mark.parametrize("select, templates", [("cheapest", "compact"), ("uniform", "paper")])
def test_the_warm_up_trains_on_the_teachers_own_decisions_never_on_forced_ones(toy, select, templates):
    # [§D.3] the teacher plays the proxy: each RD target is what the noiseless oracle decides (retrieve iff the
    # current thought asks for a fact), never Eq. 1's forced answers (under the tree rollout: 180 of 224 were forced)
    args, env, rows = toy
    args = replace_args(args, teacher_noise=0.0, warmup_select=select, templates=templates, tree_depth=2)
    examples, solved = sparkle.build_warmup(rows, env.llm, env, args)
    rd = [(e["prompt"], e["output"]) for e in examples if e["agent"] == "rd"]
    assert solved > 0.8 and len(rd) > 60
    assert all(sparkle.parse_rd(out) == ("i need to know" in current_step(prompt)) for prompt, out in rd)
    assert len({prompt for prompt, _ in rd}) == len(rd)  # no state labelled both Yes and No


def test_the_warm_up_is_the_same_however_its_questions_are_split(toy):
    # the questions are split over the processes (runs.map_shared): a question's examples never depend on the others
    args, env, rows = toy
    whole = sparkle.build_warmup(rows[:24], env.llm, env, args)[0]
    halves = sparkle.build_warmup(rows[:12], env.llm, env, args)[0] + sparkle.build_warmup(rows[12:24], env.llm, env,
                                                                                         args)[0]  # fmt: skip
    assert whole == halves and len(whole) > 24


def test_the_llm_teacher_is_its_own_model_not_the_frozen_llm(toy, tmp_path, monkeypatch):
    args, env, rows = toy
    made, seen = [], []
    monkeypatch.setattr(sparkle, "make_llm", lambda spec, **kw: made.append((spec, kw)) or "the teacher")
    monkeypatch.setattr(sparkle, "build_warmup", lambda rows, llm, *_: seen.append(llm) or stop())
    monkeypatch.setattr(sparkle, "load_proxy", lambda *_: (None, None))
    monkeypatch.setattr(sparkle, "evaluate_stage", lambda *_, **__: {})
    args = replace_args(args, teacher_model="http://h/v1", teacher_llm_model="Qwen2.5-72B-Instruct")
    with pytest.raises(Stop):
        sparkle.warm_up(SimpleNamespace(device="cpu"), args, tmp_path, rows, rows[:2], env, None, {"warnings": []})
    assert made == [("http://h/v1", {"model": "Qwen2.5-72B-Instruct"})] and seen == ["the teacher"]
    assert sparkle.PRESETS["teacher_model"] == ("oracle", "hf:Qwen/Qwen2.5-72B-Instruct")  # [§D.3]
    with pytest.raises(Stop):  # --teacher_model empty: the frozen LLM plays it
        sparkle.warm_up(SimpleNamespace(device="cpu"), replace_args(args, teacher_model=""), tmp_path, rows, rows[:2],
                        env, None, {"warnings": []})  # fmt: skip
    assert seen[-1] is env.llm and len(made) == 1


class Stop(Exception):
    pass


def stop():
    raise Stop


@pytest.mark.parametrize("types", ["", "one_hop,two_hop", "comparison, yes_no", "untyped"])
def test_the_warm_up_data_comes_from_the_warmup_types_only(toy, types, tmp_path, monkeypatch):
    args, env, _ = toy
    rows = [json.loads(line) for line in (ROOT / "data/toy/train.jsonl").read_text().splitlines()]
    if types == "untyped":  # a FlashRAG folder without types: the toy preset's one_hop,two_hop keeps every row
        rows, types = [dict(r, metadata={}) for r in rows], "one_hop,two_hop"
    seen = []

    def build_warmup(rows, *_):
        seen.extend(rows)
        raise Stop

    monkeypatch.setattr(sparkle, "load_proxy", lambda *_: (None, None))
    monkeypatch.setattr(sparkle, "evaluate_stage", lambda *_, **__: {})
    monkeypatch.setattr(sparkle, "build_warmup", build_warmup)
    with pytest.raises(Stop):
        sparkle.warm_up(
            SimpleNamespace(device="cpu"),
            replace_args(args, warmup_types=types),
            tmp_path,
            rows,
            rows[:2],
            env,
            None,
            {},
        )
    if not rows[0]["metadata"]:
        assert seen == rows
        return
    wanted = {t.strip() for t in types.split(",") if t.strip()} or {r["metadata"]["type"] for r in rows}
    assert len(wanted) >= 2 and {r["metadata"]["type"] for r in seen} == wanted
    assert seen == [r for r in rows if r["metadata"]["type"] in wanted]  # every row of those types, in order


# ---------------------------------------------------------------- CLI and end to end on the toy world
def preset_fields(monkeypatch, **fields):
    """Preset-only fields (no flags) set for the runs of sparkle.main, as a changed preset would set them."""
    apply = sparkle.apply_preset
    monkeypatch.setattr(sparkle, "apply_preset", lambda args: replace_args(apply(args), **fields))


def run(args, capsys):
    """sparkle.main in this process; returns the captured stdout."""
    capsys.readouterr()
    sparkle.main(args)
    return capsys.readouterr().out


TINY = ["--n_train", "32", "--n_eval", "8", "--sft_steps", "8", "--ppo_iterations", "2", "--rollout_batch", "4",
        "--sft_batch_size", "16", "--ppo_batch_size", "64", "--eval_every", "1", "--model", TINY_LM]  # fmt: skip


def outcome(result):
    """What an evaluation measured, without its wall-clock latency."""
    return [{k: v for k, v in r.items() if k not in ("latency_s", "sampled")} for r in (result, result["sampled"])]


@pytest.mark.parametrize("fields, shaped", [({}, True), ({"code_shaping": False}, False)])
def test_train_hands_the_code_shaping_to_the_samples(tmp_path, capsys, monkeypatch, fields, shaped):
    # the toy preset shapes the Eq. 2 credits (header 14), a preset can turn it off
    seen, op_samples = [], sparkle.op_samples
    spy = lambda trees, canonical, shaping: seen.append(shaping) or op_samples(trees, canonical, shaping)
    monkeypatch.setattr(sparkle, "op_samples", spy)
    preset_fields(monkeypatch, **fields)
    run(["--train", "--output_dir", str(tmp_path / "run"), *TINY], capsys)
    assert seen == [shaped] * 2  # one rollout per PPO update (TINY: 2)


def own_questions(folder, splits=("test",), n=4):
    """A FlashRAG folder of one's own questions: the first n toy rows of each split, without metadata."""
    folder.mkdir()
    for split in splits:
        rows = [json.loads(line) for line in (ROOT / f"data/toy/{split}.jsonl").read_text().splitlines()[:n]]
        kept = [{k: r[k] for k in ("id", "question", "golden_answers")} for r in rows]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return folder


def test_toy_train_then_eval_and_ask(tmp_path, capsys, monkeypatch):
    from common import runs

    bars, progress = [], runs.progress  # every bar is runs.progress's: at most a line every 30 s in a log
    monkeypatch.setattr(
        runs, "progress", lambda items, desc, *a, **k: bars.append(desc) or progress(items, desc, *a, **k)
    )
    out = tmp_path / "run"
    stdout = run(["--train", "--output_dir", str(out), *TINY], capsys)
    results = check_contract(out, stdout)
    assert results["method"] == "sparkle" and results["train_steps"] == {"sft": 8, "ppo": 2}
    assert {"f1", "em", "recall", "recall_by_step", "queries_by_step", "latency_s", "sampled"} <= set(results["after"])
    assert results["warnings"] == [] and {"eval", "warm-up"} <= set(bars)
    # the run ends with the table (headline rows: Recall(c_T), steps and latency beside the answer scores) and paths
    table = stdout[stdout.rindex("start    before     after") :].splitlines()
    assert [line.split()[0] for line in table[1:11]] == list(sparkle.TABLE)
    assert table[11:14] == [f"results: {out / 'results.json'}", f"checkpoint: {out / 'ppo'}",
                            f"predictions: {out / 'predictions_ppo.jsonl'}"]  # fmt: skip
    for stage in ("sft", "ppo"):  # a checkpoint names its method and the toy world of its toy-lm and toy reader
        state = json.loads((out / stage / "run_state.json").read_text())
        assert (state["method"], state["world"], state["data_dir"]) == ("sparkle", "data/toy", "data/toy")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["sft/step"], m["sft/loss"] > 0) for m in metrics if "sft/loss" in m] == [(1, True), (8, True)]
    updates = [m for m in metrics if "iteration" in m]
    assert [m["iteration"] for m in updates] == [1, 2] and all(m["rollout/samples"] > 0 for m in updates)
    for stage, result in (("raw", results["before_sft"]), ("sft", results["before"]), ("ppo", results["after"])):
        lines = [json.loads(line) for line in (out / f"predictions_{stage}.jsonl").read_text().splitlines()]
        greedy = [r for r in lines if r["decoding"] == "greedy"]
        assert len(greedy) == 8 and sum(r["f1"] for r in greedy) / 8 == pytest.approx(result["f1"])
        assert all(r["trajectory"].startswith("llm") and "leaf" in r["trajectory"] for r in lines)
    with pytest.raises(SystemExit, match="pass --resume"):
        run(["--train", "--output_dir", str(out), *TINY], capsys)
    again = run(["--train", "--output_dir", str(out), "--resume", *TINY], capsys)  # neither SFT nor PPO is redone
    assert "sft/loss" not in again and "iteration=" not in again
    # two evaluations of one checkpoint: two folders, <model>/eval/<data>-<time>, each printed, neither overwritten
    evals = [run(["--eval", "--model", str(out / "ppo"), "--n_eval", "8"], capsys) for _ in range(2)]
    folders = sorted((out / "ppo" / "eval").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("toy-") for f in folders)
    for folder, stdout in zip(folders, evals):
        assert f"results: {folder / 'results.json'}" in stdout
        assert outcome(check_contract(folder, stdout)["after"]) == outcome(results["after"])
    # one's own questions (no world.json, no metadata): the checkpoint's world, recall 0, F1 still scored
    mine = own_questions(tmp_path / "mine")
    kg = ["--corpus", str(ROOT / "data/toy/corpus.jsonl"), "--triples", str(ROOT / "data/toy/triples.jsonl")]
    stdout = run(["--eval", "--model", str(out / "ppo"), "--data_dir", str(mine), *kg, "--output_dir",
                  str(tmp_path / "mine_eval")], capsys)  # fmt: skip
    flash = check_contract(tmp_path / "mine_eval", stdout)
    assert flash["n_eval"] == 4 and flash["after"]["recall"] == 0.0 and flash["args"]["world"] == "data/toy"
    stdout = run(["--ask", "what is the birthplace of the director of zekil ?", "--model", str(out / "ppo")], capsys)
    assert "step 0 llm:" in stdout and "leaf" in stdout


def test_ones_own_questions_with_the_toy_models_of_world(tmp_path, capsys):
    """A FlashRAG folder without world.json or metadata: --world names the toy world of the toy-lm and the toy
    reader; without it one line names --world; --train, whose toy teacher reads metadata, names the fields."""
    from common import runs

    mine = own_questions(tmp_path / "mine", ("train", "test"))
    kg = ["--corpus", str(ROOT / "data/toy/corpus.jsonl"), "--triples", str(ROOT / "data/toy/triples.jsonl")]
    flags = ["--model", TINY_LM, "--data_dir", str(mine), *kg]
    stdout = run(["--eval", *flags, "--world", "data/toy", "--output_dir", str(tmp_path / "e")], capsys)
    assert check_contract(tmp_path / "e", stdout)["n_eval"] == 4
    with pytest.raises(SystemExit, match=f"^--model {TINY_LM} and --llm toy: no toy world in --data_dir {mine}; pass"):
        run(["--eval", *flags, "--output_dir", str(tmp_path / "e2")], capsys)
    with pytest.raises(SystemExit) as stop:
        runs.run_main(sparkle.main, ["--train", *flags, "--world", "data/toy", "--output_dir", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {mine}: row 'toy-train-")  # the folder and the first row of the sample
    assert "has no metadata 'type', 'entities', 'relations', which --teacher_model oracle needs" in err


def test_a_stage_that_trains_on_nothing_warns_and_results_record_it(tmp_path, capsys, monkeypatch):
    # a teacher that solves no question: no SFT (the raw proxy goes on); rollouts whose operations get no credit
    monkeypatch.setattr(sparkle, "build_warmup", lambda rows, teacher, env, args: ([], 0.0))
    monkeypatch.setattr(sparkle, "op_samples", lambda *a: [])
    out = tmp_path / "run"
    stdout = run(["--train", "--output_dir", str(out), *TINY, "--n_eval", "2"], capsys)
    results = check_contract(out, stdout)
    assert results["train_steps"] == {"sft": 0, "ppo": 2} and results["warnings"] == [
        "sft: the teacher solved no question (check --llm)",
        "ppo update 1: no credited operation",
        "ppo update 2: no credited operation",
    ]
    assert "warning: sft trained on nothing (the teacher solved no question (check --llm))" in stdout
    assert json.loads((out / "sft" / "run_state.json").read_text())["warnings"] == results["warnings"][:1]


def test_another_methods_checkpoint_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "tearag_dpo"
    folder.mkdir()
    (folder / "run_state.json").write_text(json.dumps({"method": "tearag", "data_dir": "data/toy", "args": {}}))
    with pytest.raises(SystemExit, match=f"^--model {folder} is a tearag checkpoint, not a sparkle one$"):
        sparkle.main(["--eval", "--model", str(folder)])


@pytest.mark.parametrize(
    "flag, value, accepted",
    [("alpha", "1.5", "in [0, 1]"), ("n_train", "-5", ">= 1"), ("top_k", "0", ">= 1"), ("kl_coef", "-0.5",
     ">= 0"), ("sft_lr", "-0.001", ">= 0"), ("tree_depth", "-1", ">= 0"), ("rollout_batch", "0", ">= 1")],
)  # fmt: skip
def test_a_number_out_of_its_range_is_one_line_exit_2(flag, value, accepted, capsys):
    with pytest.raises(SystemExit) as stop:
        sparkle.main(["--train", f"--{flag}", value])
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: --{flag} {value}: must be {accepted}\n"


def test_a_missing_kg_corpus_and_bad_flags_are_one_line_errors(tmp_path, capsys):
    from common import runs

    with pytest.raises(SystemExit) as stop:
        runs.run_main(sparkle.main, ["--eval", "--model", TINY_LM, "--triples", str(tmp_path / "none.jsonl"),
                                     "--output_dir", str(tmp_path / "e"), "--n_eval", "2"])  # fmt: skip
    assert stop.value.code == 2 and "no KG corpus" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^choose one mode: --train, --eval or --ask"):  # never silently one of them
        sparkle.main(["--train", "--eval"])
    with pytest.raises(SystemExit) as stop:
        sparkle.main(["--train", "--ablation", "no_such"])
    assert stop.value.code == 2 and len(capsys.readouterr().err.splitlines()) == 1


def test_dry_run_lists_an_uncached_teacher_under_hf_hub_offline(monkeypatch, capsys):
    from common import runs

    if runs.where_is("Qwen/Qwen2.5-72B-Instruct") == "hub id, in the local cache":
        pytest.skip("the paper's teacher is cached here")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="not found: .*--teacher_model hf:Qwen/Qwen2.5-72B-Instruct \\(a hub id not"):
        sparkle.main(["--preset", "paper", "--dry_run"])


def test_the_docs_smoke_command(tmp_path, capsys):
    """docs/sparkle.md's smoke command, as written there: the warm-up builds pairs for every agent, the SFT loss falls
    from its first step, and every PPO update's rollout credits operations."""
    import ast
    import re
    import shlex

    page = (ROOT / "docs/sparkle.md").read_text()
    command = re.search(r"## Smoke test\n.*?```bash\n(python sparkle\.py [^\n]*)\n```", page, re.S)[1]
    stdout = run([*shlex.split(command)[2:], "--output_dir", str(tmp_path / "smoke")], capsys)
    check_contract(tmp_path / "smoke", stdout)
    pairs = ast.literal_eval(re.search(r"^warm-up: (\{.*?\});", stdout, re.M)[1])
    assert set(pairs) == {"rd", "qf", "ki"} and min(pairs.values()) > 0
    metrics = [json.loads(line) for line in (tmp_path / "smoke/metrics.jsonl").read_text().splitlines()]
    losses = [m["sft/loss"] for m in metrics if "sft/loss" in m]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2] and losses[2] < losses[0] / 2, losses
    updates = [m for m in metrics if "iteration" in m]
    assert len(updates) == 2 and all(m["rollout/samples"] > 0 and m["ops/qf"] > 0 for m in updates)


def test_extract_triples_with_any_llm(tmp_path, monkeypatch, capsys):
    class Extractor:
        def chat(self, messages_lists, **sampling):
            assert messages_lists[0][0]["content"] == sparkle.EXTRACTION_PROMPT
            return ["<x; born in; y>, <head entity; relation; tail entity>, <broken; triple>" for _ in messages_lists]

    monkeypatch.setattr(sparkle, "make_llm", lambda spec, **kw: Extractor())
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "7", "contents": "\\"x\\"\\nx was born in y ."}\n')
    sparkle.main(
        ["--extract_triples", "--corpus", str(corpus), "--triples", str(tmp_path / "t.jsonl"), "--llm", "hf:m"]
    )
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows == [dict(doc_id="7", head="x", relation="born in", tail="y")]  # templates and broken spans dropped


def test_paper_templates_and_standard_rollout_run_a_few_steps(tmp_path, capsys, monkeypatch):
    preset_fields(monkeypatch, templates="paper")
    stdout = run(["--train", "--output_dir", str(tmp_path / "p"), "--standard_rollout", *TINY, "--n_eval", "2",
                  "--max_new_tokens", "8"], capsys)  # fmt: skip
    results = check_contract(tmp_path / "p", stdout)
    assert results["args"]["templates"] == "paper" and results["train_steps"]["ppo"] == 2


def test_trains_on_a_freshly_generated_world(tmp_path, capsys):
    """The tokenizer, the toy reader, the triples and the renaming come from --data_dir: another world trains."""
    from common.toy import write_world

    world = write_world(tmp_path / "world", seed=3, size=0.5)
    out = tmp_path / "run"
    stdout = run(["--train", "--data_dir", str(world), "--output_dir", str(out), "--n_eval", "40", "--n_train", "120",
                  "--sft_steps", "150", "--ppo_iterations", "1", "--rollout_batch", "4",
                  "--question_types", "one_hop,two_hop"], capsys)  # fmt: skip  # the world's plumbing, on easy types
    results = check_contract(out, stdout)
    assert results["dataset"] == str(world) and results["args"]["world"] == str(world)
    assert results["before"]["f1"] > results["before_sft"]["f1"] and results["before"]["recall"] > 0
