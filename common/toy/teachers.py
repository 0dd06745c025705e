"""The oracle teachers: the papers' teacher LLMs on the toy world, each writing its method's output formats from a
question's metadata."""

import re

from common.toy.world import RELATIONS

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
