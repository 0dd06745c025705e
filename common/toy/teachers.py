"""The oracle teachers: the papers' teacher LLMs on the toy world, each writing its method's output formats from a
question's metadata."""

import re

from common.toy.world import RELATIONS

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
