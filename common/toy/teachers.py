"""The oracle teachers: the papers' teacher LLMs on the toy world, each writing its method's output formats from a
question's metadata."""

import random
import re

from common.toy.reader import ToyReader
from common.toy.world import RELATIONS, UNKNOWN

# ---------------------------------------------------------------- oracle teachers (the papers' teacher LLMs)


def oracle_c3po(row, agent, ctx, prefix, rng, noise, style="compact"):
    """C-3PO's warm-up teacher in the toy world: an output of `agent` (router, filter, dm) that knows the hops from the
    row's metadata. With probability `noise` the filter keeps every document (decoys mislead the reader) and the
    Decision Maker stops early. ctx holds the agent's state: docs (retrieved), acc (accumulated), used (queries
    issued), forced (the Decision Maker may only stop); prefix: a forced beginning of the output. style: "compact"
    (the toy preset's short thoughts), "paper" (the formats of the paper's App. B.1 and the authors' examples: a
    thought per document, a Decision Maker's thought naming the plan's step), "think" (paper, after a <think> block
    as a reasoning model writes one, naming the other actions)."""
    meta = row["metadata"]
    heads = meta["entities"][:2] if meta["type"] in ("comparison", "yes_no") else meta["entities"][:-1]
    wrong = rng.random() < noise
    think = {
        "router": "Should the LLM answer alone ([No Retrieval]), after one search ([Retrieval] <query>) or after a "
        "plan ([Planning])?",
        "filter": "I compare each document's title with the entities the question needs; the action: keep those.",
        "dm": "Which steps of the plan do the existing documents cover? The next action: [Retrieval] or [LLM].",
    }[agent]
    lead = f"<think>\n{think}\n</think>\n\n" if style == "think" and not prefix else ""
    if agent == "router":  # the forced root asks only for the query; a free router picks the strategy too
        if prefix:
            return f" {meta['sub_queries'][0]}"
        single = f"[Retrieval] {meta['sub_queries'][0]}"
        return lead + ("[No Retrieval]" if meta["popular"] else single if meta["hops"] == 1 else "[Planning]")
    if agent == "filter":
        docs = ctx["docs"]
        ids = list(range(1, len(docs) + 1)) if wrong else [i for i, d in enumerate(docs, 1) if d["title"] in heads]
        listed = ", ".join(map(str, ids))
        if style == "compact":
            return f"Thought: {'keep ' + listed if ids else 'none relevant'} .\nAction: [{listed}]"
        said = [f"Document {i}: {'Relevant' if i in ids else 'Not relevant'}, it is about {d['title']}."
                for i, d in enumerate(docs, 1)]  # fmt: skip
        return lead + "Thought: " + "\n".join(said) + f"\n\nAction: [{listed}]"
    titles, used = {d["title"] for d in ctx["acc"]}, ctx["used"]
    todo = [i for i, h in enumerate(heads)
            if not meta["popular_hops"][i] and h not in titles and not used.get(meta["sub_queries"][i])]  # fmt: skip
    if ctx["forced"] or not todo or wrong:
        done = "Every step of the plan is in the existing documents, so the next action: answer."
        return "Thought: done .\nAction: [LLM]" if style == "compact" else f"{lead}Thought: {done}\nAction: [LLM]"
    step, query = todo[0], meta["sub_queries"][todo[0]]
    if style == "compact":
        return f"Thought: need step {step + 1} .\nAction: [Retrieval] {query}"
    rel = (meta.get("relations") or [None] * len(heads))[step]  # the hop's relation: "the director of zekil"
    goal = RELATIONS[rel][4].format(h=heads[step]) if rel in RELATIONS else query
    return f"{lead}Thought: In our plan, the next action: find {goal} [step {step + 1}].\nAction: [Retrieval] {query}"


def oracle_smartrag(prompt, world_dir):
    """SmartRAG's policy as a trained one acts in the toy world, from its state alone (the paper rehearsal's oracle):
    a one-hop question about a popular entity answered from memory; another searched with its entity and relation
    word, then answered from the observation's statement about that exact entity ("unknown" without one). It writes
    the paper's actions (Tab. 7, Tab. 3): "[Answer] <answer>" or "[Search] <query>"."""
    reader = ToyReader(world_dir)
    text = prompt.lower()
    question = reader.find_question(text)
    if not question or question[0] != "chain" or len(question[1]) != 1:
        return f"[Answer] {UNKNOWN}"
    (rel,), (entity,) = question[1:]
    if entity in reader.world["popular"]:
        return f"[Answer] {reader.world['memory'][(entity, rel)]}"
    if not re.search(r"\bobservation\s*:", text):  # Tab. 7's second template: "Observation: ..."
        return f"[Search] {entity} {RELATIONS[rel][5]}"
    said = [t for h, r, t in reader.read_facts(text) if h == entity and r == rel]
    return f"[Answer] {said[-1] if said else UNKNOWN}"


def oracle_smartrag_base(prompt, world_dir, paper):
    """The base LLM of SmartRAG's knowledge probe (App. A.2) in the toy world: the toy reader's direct answer (it knows
    the popular facts). paper: as a reasoning chat model answers Tab. 7's direct template, a <think> block, then
    "[Answer] <answer>", or "[Search] <query>" when it does not know."""
    reader = ToyReader(world_dir)
    answer = reader.reply(prompt)
    if not paper:
        return answer
    if answer == UNKNOWN:
        names = " ".join((reader.find_question(prompt.lower()) or (None, None, ["it"]))[2])
        return f"<think>\nI do not remember this fact, so I should search for it.\n</think>\n\n[Search] {names}"
    return f"<think>\nThe question asks for a fact I remember: the answer is {answer}.\n</think>\n\n[Answer] {answer}"


def sparkle_oracle_text(request, tpl, ablation, seed, noise):
    """SPARKLE's toy teacher as text: oracle_sparkle's decision for a pending agent state (request: agent, the path's
    thoughts and current thought, candidates, prefix, the tree's row) in the template set's output formats (tpl:
    rd_yes, rd_no, qf_output; the paper set's: Fig. 4's answers, Tab. 8's QF output); w/o QF the RD output carries
    the chain and the query, w/ Direct QF the query alone, w/ Direct KI a candidate's number. A tree's draws are
    seeded by `seed`, its question and row["sample"], whatever the other trees of its batch."""
    path, cands, agent, row = request["path"], request["cands"] or [], request["agent"], request["tree"]["row"]
    rng = request["tree"].setdefault("oracle_rng", random.Random(f"{seed} {row['question']} {row.get('sample')}"))
    state = dict(thoughts=path["thoughts"], current=path["current"], candidates=[(h["title"], t) for h, t in cands])
    decide = lambda agent: oracle_sparkle(row, agent, state, rng, noise)
    qf = lambda chain, gap, query: tpl["qf_output"].format(
        chain=", ".join(f"<{h}; {r}; {t}>" for h, r, t in chain), gap=gap, query=query or "None"
    )
    if agent == "rd" and ablation == "no_qf":
        return tpl["rd_yes"] + " " + qf(*decide("qf")) if request["prefix"] or decide("rd") else tpl["rd_no"]
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


def sparkle_chain(row, thoughts):
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


def oracle_sparkle(row, agent, state, rng, noise):
    """SPARKLE's warm-up teacher in the toy world, as decisions the method renders in its own formats. state:
    "thoughts" (all LLM thoughts so far), "current" (the latest one), "candidates" ([(title, text)] for KI: triples
    "<h ; r ; t>" or documents). rd -> retrieve? (yes iff the current thought asks for a fact); qf -> (chain as
    [(head, relation phrase, tail or "[unknown]")], knowledge gap, query or None when nothing is missing); ki -> the
    index of the candidate that fills the gap (its triple, or its entity's document). With probability `noise` the
    decision is wrong: rd flipped, the raw question as the query, a random candidate."""
    wrong = rng.random() < noise
    chain = sparkle_chain(row, state["thoughts"])
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


def oracle_sparcrag(row, note, width, rng, duplicate):
    """SPARC-RAG's warm-up teacher in the toy world, as (strategy, query) items the method renders in its rewrite
    format: by bm25 the sub-queries (metadata) of the facts not yet in the global `note` whose subject the question or
    the note names, then by dense another granularity (a named subject alone, the question); with probability
    `duplicate` the second item repeats the first by dense (a near-duplicate set). The first `width` items."""
    meta, q0 = row["metadata"], row["question"]
    seen, noted = set(re.findall(r"\w+", f"{q0} {note}".lower())), set(re.findall(r"\w+", note.lower()))
    heads = meta["entities"][:2] if meta["type"] in ("comparison", "yes_no") else meta["entities"][:-1]
    facts = zip(heads, meta["sub_answers"], meta["sub_queries"])
    todo = [("bm25", q) for h, a, q in facts if h in seen and not {h, a} <= noted]
    if todo and rng.random() < duplicate:
        todo = [todo[0], ("dense", todo[0][1])]
    fillers = [("dense", h) for h in heads if h in seen] + [("dense", q0)]
    return list(dict.fromkeys(todo + fillers))[:width]
