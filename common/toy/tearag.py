"""TeaRAG's toy-world machinery, reached from tearag.py through values and two adapters: the lexical cross-scorer
(--reranker lexical, standing in for BGE-reranker-v2), the SFT paths' toy augmentation (entity renaming) and the
oracle agent that writes the paper's step format from a question's metadata (the policy of
tests/test_paper_rehearsal.py)."""

import math
import random
import re
from collections import Counter
from dataclasses import replace
from fractions import Fraction

import numpy as np

from common.retrieval import tokenize_words
from common.toy.world import RELATIONS, rename_entities

# the toy world's cross-scorer, --reranker lexical (BGE-reranker-v2 in the paper)
STOPWORDS = frozenset(
    tokenize_words("a an the of in on at to by for from with and or is are was were be been what which who whom")
    + tokenize_words("whose when where why how did do does it its this that as")
)


class LexicalReranker:
    """The toy world's cross-scorer: logit = 8 F1 - 4, F1 of the idf-weighted overlap
    of the two texts' content words (not stopwords, seen in the corpus); sigmoid(logit) lies in [0.018, 0.982]."""

    def __init__(self, texts):
        df = Counter(w for t in texts for w in set(tokenize_words(t)))
        self.idf = {w: math.log((1 + len(texts)) / (1 + c)) + 1 for w, c in df.items()}

    def __call__(self, pairs):
        """Logits of (query, passage) pairs, (n,)."""
        words = lambda text: {w for w in tokenize_words(text) if w in self.idf and w not in STOPWORDS}
        weight = lambda ws: sum(self.idf[w] for w in sorted(ws))  # sorted: a set's order follows the hash seed
        out = []
        for query, passage in pairs:
            q, p = words(query), words(passage)
            out.append(8 * (2 * weight(q & p) / (weight(q) + weight(p)) if q and p else 0.0) - 4)
        return np.array(out, dtype=np.float64)


# ---------------------------------------------------------------- the SFT paths' augmentation (toy world only)
def renamed(texts, world, rng, p):
    """An SFT path's texts (question first) entity-renamed with probability p (rng), so that the tiny model reads its
    evidence instead of memorising the world's facts (augment_p); no world: as they are."""
    if world is not None and rng.random() < p:
        return rename_entities(texts, world, rng, popular="free")
    return texts


def curriculum(args, rows, build):
    """The toy SFT's first stage, args.sft_curriculum 'types:share:lr' -> (the SFT paths of the rows of those metadata
    types, build(rows, rng=random.Random(args.seed)); the args of that stage: sft_steps = share x args.sft_steps,
    rounded (0 without a path), and sft_lr = lr).
    Trained on every type at once, the tiny model learns the chains' two copy rules (the question's first name, the
    last summary's answer) and never a comparison's second step, which names the question's second entity; trained
    on comparison and yes/no paths first, it does, and keeps it through the whole mix (docs/tearag.md)."""
    types, share, lr = args.sft_curriculum.split(":")
    wanted = set(types.split(","))
    steps = round(Fraction(share) * args.sft_steps)
    paths = build([r for r in rows if (r.get("metadata") or {}).get("type") in wanted], rng=random.Random(args.seed))
    return paths, replace(args, sft_steps=steps if paths else 0, sft_lr=float(lr))


# ---------------------------------------------------------------- the oracle agent (the policy in the rehearsal)
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
    summary += f"{answer if comparison and hop == 1 else tails[hop]}.\n"  # the last implies the answer (Tab. 11)
    if hop + 1 < len(rels):
        return summary + step(hop + 1)
    if (len(hops) > 1 and hops[-1] == hops[-2]) or (wrong and rng.random() < 0.5):
        return summary + step(hop)  # a redundant step (the same subquery again), then again until the step cap
    if wrong:  # the other entity, the other yes/no, the start entity of a chain
        answer = {"yes": "no", "no": "yes", meta["entities"][0]: meta["entities"][1]}.get(answer, meta["entities"][0])
    return summary + f"Final answer: {answer}"


def format_tokens(unknown):
    """The format words that a word-level toy tokenizer cannot read (`unknown`: common.llm.unknown_words of TeaRAG's
    format words; none for a real tokenizer) as tokens to add, so that the toy model writes them, not <unk>."""
    from tokenizers import AddedToken

    return [
        AddedToken(w.lower(), normalized=True, single_word=True) for w in unknown if re.fullmatch(r"[A-Za-z]{2,}", w)
    ]
