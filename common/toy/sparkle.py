"""SPARKLE's toy world, reached from sparkle.py through --teacher_model oracle and the toy preset's fields (header
items 10-14): the oracle teacher that plays the proxy's three agents in the warm-up, in place of the paper's
Qwen2.5-72B-Instruct; the warm-up's choice of question types and of the cheapest successes; the entity renaming of
SFT examples and PPO questions (the toy proxy copies facts from the context instead of memorising them); the
authors' code's shaping of the PPO credits (item 14)."""

import random
import re

from common.toy.world import RELATIONS, RenamingEnv, load_world, rename_entities, rename_rows  # noqa: F401

# the toy preset's templates: the paper set's fields and output formats without the instruction prose, for a tiny
# proxy that reads them from scratch (sparkle.TEMPLATES["paper"] holds the paper's, App. A)
COMPACT_TEMPLATES = dict(
    llm="think step by step , one thought per <think> </think> , then the answer in <answer> </answer> . "
    "context : {context} question : {question}",
    llm_boxed="think step by step , then the answer in \\boxed{{ }} . context : {context} question : {question}",
    llm_search="think step by step , one thought per <think> </think> , then the answer in <answer> </answer> "
    ", a thought that needs a fact has <search> . context : {context} question : {question}",
    rd="retrieval ? context : {context} question : {question} previous : {history} current : {current}",
    rd_qf="retrieval and query ? context : {context} question : {question} previous : {history} current : {current}",
    qf="query . question : {question} thoughts : {thoughts}",
    qf_direct="query only . question : {question} thoughts : {thoughts}",
    ki="select a triple . triples : {candidates} question : {question} chain : {chain} query : {query}",
    ki_direct="select a document . documents : {candidates} question : {question} query : {query}",
    rd_yes="yes",
    rd_no="no",
    qf_output="step 1 : chain : {chain} step 2 : gap : {gap} step 3 : query : {query}",
    document="{title} : {text}",
    documents=" ",
    candidate="{i} . {text}",
    candidates=" ",
)


# ---------------------------------------------------------------- renaming (header 12) and warm-up selection (11)
def renaming_world(world_dir, p):
    """The world whose entities the renaming draws from, when a renaming probability is above 0 (else None)."""
    return load_world(world_dir) if world_dir and p else None


def renamed_texts(texts, world, seed, p):
    """An SFT example's (system, user, output) with its entities renamed with probability p, seeded by `seed`."""
    rng = random.Random(seed)
    return rename_entities(texts, world, rng, popular="keep") if world is not None and rng.random() < p else texts


def warmup_rows(rows, types):
    """The training rows of the comma-separated metadata `types` (empty: all; rows without a type are kept)."""
    kept = {t.strip() for t in types.split(",") if t.strip()}
    return [r for r in rows if not kept or r["metadata"].get("type") in kept | {None}]


def cheapest(paths):
    """The successful paths (each leaf to root) with the fewest QF and KI operations, then the fewest steps."""
    cost = lambda path: (sum(n["kind"] in ("qf", "ki") for n in path), path[0]["depth"])
    return [p for p in paths if cost(p) == min(map(cost, paths))]


# ---------------------------------------------------------------- PPO credit shaping (header 14)
def code_shaping(nodes, credit, is_yes, pruned=0.1, final=0.05):
    """The authors' code's shaping of sparkle.leaf_credits' Eq. 2 credits (impl; not in the paper; the toy preset's
    code_shaping, header 14), on a copy of `credit`; is_yes: sparkle.parse_rd."""
    credit, last = list(credit), []  # last[i]: the nearest RD node at or above node i
    for i, n in enumerate(nodes):  # a parent before its children, a decision's Yes before its No (rd_requests)
        if n.get("pruned") and n["kind"] == "rd":  # a pruned Yes: its No's credit - 0.1, that No + 0.1
            no = next(j for j, m in enumerate(nodes) if m["parent"] == n["parent"] and m["kind"] == "rd" and j != i)
            credit[i], credit[no] = credit[no] - pruned, credit[no] + pruned
        last.append(i if n["kind"] == "rd" else None if n["parent"] is None else last[n["parent"]])
        if n["kind"] == "leaf" and last[i] is not None:  # a leaf's last RD operation: -0.05 if Yes, +0.05 if No
            credit[last[i]] += -final if is_yes(nodes[last[i]]["text"]) else final
    return credit


# ---------------------------------------------------------------- the oracle teacher (header 10)
def oracle_text(request, tpl, ablation, seed, noise):
    """The oracle's output for a pending agent state (sparkle.Request: agent, its path's thoughts and current thought,
    candidates, prefix, the tree's row) in the template set's output formats (tpl: rd_yes, rd_no, qf_output; the paper
    set's: Fig. 4's answers, Tab. 8's QF output); w/o QF the RD output carries the chain and the query, w/ Direct QF
    the query alone, w/ Direct KI a candidate's number. A tree's draws are seeded by `seed`, its question and
    row["sample"], whatever the other trees of its batch."""
    path, cands, agent = request.path, request.cands or [], request.agent
    row = path.tree["row"]
    rng = path.tree.setdefault("oracle_rng", random.Random(f"{seed} {row['question']} {row.get('sample')}"))
    state = dict(thoughts=path.thoughts, current=path.current, candidates=[(h["title"], t) for h, t in cands])
    decide = lambda agent: oracle_decision(row, agent, state, rng, noise)
    qf = lambda chain, gap, query: tpl["qf_output"].format(
        chain=", ".join(f"<{h}; {r}; {t}>" for h, r, t in chain), gap=gap, query=query or "None"
    )
    if agent == "rd" and ablation == "no_qf":
        return tpl["rd_yes"] + " " + qf(*decide("qf")) if request.prefix or decide("rd") else tpl["rd_no"]
    if agent == "rd":
        return tpl["rd_yes"] if decide("rd") else tpl["rd_no"]
    if agent == "qf":
        chain, gap, query = decide("qf")
        return str(query) if ablation == "direct_qf" else qf(chain, gap, query)
    i = decide("ki")
    return str(i + 1) if ablation == "direct_ki" else cands[i][1]


def stated_tail(thoughts, head, rel):
    """The tail the thoughts last state for (head, rel), the reader's way ("velbo was born in 1931 ."), or None."""
    left = RELATIONS[rel][2].split("{t}")[0].format(h=head)
    tails = re.findall(r"\b" + re.escape(left).replace(r"\ ", r"\s+") + r"([a-z0-9]+)\b", thoughts.lower())
    tails = [t for t in tails if t.isdigit() == (RELATIONS[rel][1] == "year")]
    return tails[-1] if tails else None


def reasoning_chain(row, thoughts):
    """The KG reasoning chain the thoughts state for a question, the reader's way: [(head, relation, tail or None)] up
    to the first link not stated yet (a chain follows the stated tails; a comparison looks up both entities)."""
    meta = row["metadata"]
    comparison = meta["type"] in ("comparison", "yes_no")
    chain = []
    for i, rel in enumerate(meta["relations"]):
        head = meta["entities"][i] if comparison else chain[-1][2] if chain else meta["entities"][0]
        chain.append((head, rel, stated_tail(thoughts, head, rel)))
        if chain[-1][2] is None:
            break
    return chain


def oracle_decision(row, agent, state, rng, noise):
    """The warm-up teacher's decision in the toy world, rendered by oracle_text. state: "thoughts" (all LLM thoughts
    so far), "current" (the latest one), "candidates" ([(title, text)] for KI: triples "<h ; r ; t>" or documents).
    rd -> retrieve? (yes iff the current thought asks for a fact); qf -> (chain as [(head, relation phrase, tail or
    "[unknown]")], knowledge gap, query or None when nothing is missing); ki -> the index of the candidate that fills
    the gap (its triple, or its entity's document). With probability `noise` the decision is wrong: rd flipped, the
    raw question as the query, a random candidate."""
    wrong = rng.random() < noise
    chain = reasoning_chain(row, state["thoughts"])
    gap = next((link for link in chain if link[2] is None), None)
    if agent == "rd":
        return ("i need to know" in state["current"]) != wrong
    if agent == "qf":
        triples = [(h, RELATIONS[r][3], t or "[unknown]") for h, r, t in chain]
        if gap is None:
            return triples, "nothing", None
        query = row["question"] if wrong else f"{gap[0]} {RELATIONS[gap[1]][5]}"
        return triples, RELATIONS[gap[1]][4].format(h=gap[0]), query
    candidates = state["candidates"]
    want = [gap[0], *RELATIONS[gap[1]][3].split()] if gap else None
    fits = lambda title, text: (re.findall(r"[a-z0-9]+", text.lower())[: len(want)] == want
                                if text.lstrip().startswith("<") else title == gap[0])  # fmt: skip
    right = [i for i, (title, text) in enumerate(candidates) if want and fits(title, text)]
    return rng.randrange(len(candidates)) if wrong or not right else right[0]
