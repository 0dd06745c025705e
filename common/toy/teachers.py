"""The oracle teachers: the papers' teacher LLMs on the toy world, each writing its method's output formats from a
question's metadata."""

import random
import re

from common.toy.reader import ToyReader
from common.toy.world import RELATIONS, UNKNOWN

# ---------------------------------------------------------------- oracle teachers (the papers' teacher LLMs)


def tearag_tail(evidence, head, rel):
    """The tail that `evidence` (lowercased) states for (head, rel): a passage sentence ("dites was born in makux .")
    or a triplet line ("triplet : dites born in makux") about the exact name; None when it states none."""
    lefts = (RELATIONS[rel][2].split("{t}")[0].format(h=head), f"triplet : {head} {RELATIONS[rel][3]} ")
    pattern = lambda left: r"(?<![a-z0-9])" + re.escape(left).replace(r"\ ", r"\s+") + r"([a-z0-9]+)\b"
    tails = [t for left in lefts for t in re.findall(pattern(left), evidence)]
    tails = [t for t in tails if t.isdigit() == (RELATIONS[rel][1] == "year")]
    return tails[0] if tails else None


def oracle_tearag(row, path, rng=None, noise=0.0):
    """TeaRAG's agent in the toy world, in the paper's step format (Tab. 11): the next turn of a reasoning path, `path`
    being the text after the prompt (its steps, summaries and the environment's Reference blocks). It follows the
    question's chain (metadata entities and relations), one step a hop, and reads each hop's answer in that step's
    evidence (tearag_tail), so that a retrieval that misses it ends the path with "unknown"; after the environment's
    "Final answer:" (the step cap) it writes the answer alone. With probability `noise` (rng) a turn goes wrong: the
    first step header without its entity line, or at the end a wrong final answer or (half the time) a redundant step
    that it then repeats until the step cap."""
    meta, wrong = row["metadata"], rng is not None and rng.random() < noise
    comparison, rels = meta["type"] in ("comparison", "yes_no"), meta["relations"]
    text = " ".join(re.sub(r"\s*:\s*", " : ", path.lower()).split())
    asked = re.findall(r"subquery : (.*?) <reference>", text)
    blocks = re.findall(r"<reference>(.*?)</reference>", text)
    hops, tails = [], {}  # each step's hop (a repeated subquery: the same hop), each hop's tail read
    for i, query in enumerate(asked):
        hops.append(hops[-1] if i and query == asked[i - 1] else len(set(hops)))
    head = lambda hop: meta["entities"][hop] if comparison or hop == 0 else tails[hop - 1]
    for i, block in enumerate(blocks):
        tails[hops[i]] = tearag_tail(block, head(hops[i]), rels[hops[i]])
        if tails[hops[i]] is None:
            break

    def step(hop):
        entity = "" if wrong and not asked else f"Important entity: {head(hop)}\n"
        return f"Step {len(asked) + 1}:\n{entity}Subquery: {head(hop)} {RELATIONS[rels[hop]][5]}\n<Reference>"

    if not asked:
        return step(0)
    hop = hops[len(blocks) - 1]
    answer = tails[hop] or "unknown"
    if comparison and hop == 1 and tails[1]:
        first = int(tails[0]) < int(tails[1])
        answer = ("yes" if first else "no") if meta["type"] == "yes_no" else meta["entities"][0 if first else 1]
    if text.endswith("final answer :"):  # written by the environment at the step cap
        return answer
    if tails[hop] is None:
        return f"Summary: No evidence states {RELATIONS[rels[hop]][4].format(h=head(hop))}.\nFinal answer: unknown"
    summary = f"Summary: The fact {head(hop)} {RELATIONS[rels[hop]][3]} {tails[hop]} logically implies the answer: "
    summary += f"{tails[hop]}.\n"
    if hop + 1 < len(rels):
        return summary + step(hop + 1)
    if (len(hops) > 1 and hops[-1] == hops[-2]) or (wrong and rng.random() < 0.5):
        return summary + step(hop)  # a redundant step (the same subquery again), then again until the step cap
    if wrong:  # the other entity, the other yes/no, the start entity of a chain
        answer = {"yes": "no", "no": "yes", meta["entities"][0]: meta["entities"][1]}.get(answer, meta["entities"][0])
    return summary + f"Final answer: {answer}"


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
