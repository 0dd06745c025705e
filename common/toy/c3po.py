"""C-3PO's toy world (c3po.py reaches it through `--teacher oracle`, the toy preset's values and the adapters below):
the oracle warm-up teacher, the compact templates, the cheapest-strategy warm-up selection, the entity renaming of SFT
examples and PPO trees. c3po.py's header lists these as its toy-world adaptations (12-18)."""

from pathlib import Path

from common.data import require_metadata
from common.toy.world import RELATIONS, load_world, rename_entities, rename_rows

__all__ = ["COMPACT_TEMPLATES", "oracle_c3po", "oracle_replies", "cheapest", "renaming_world", "rename_pairs"]
__all__ += ["rename_rows", "require_oracle_metadata"]

# the toy preset's templates: the paper set's fields and output formats without the instruction prose (header 17)
COMPACT_TEMPLATES = dict(
    router="decide : no retrieval , retrieval or planning . question : {question}",
    filter_plan="filter documents . goal : {objective} question : {question} documents : {documents}",
    filter_direct="filter documents . question : {question} documents : {documents}",
    dm="decide next action . existing documents : {documents} plan : {roadmap} question : {question}",
    dm_llm="use llm . existing documents : {documents} plan : {roadmap} question : {question}",
    roadmap="write a plan . question : {question}",
    answer="answer the question using the documents . documents : {documents} question : {question}",
    answer_no_docs="answer the question . question : {question}",
)
# the metadata the oracle reads (data/README.md)
ORACLE_FIELDS = ("type", "entities", "sub_queries", "hops", "popular", "popular_hops")
# the strategies' cost order (§4.2, §6.4): No Retrieval < Retrieval < Planning
STRATEGY_COST = {"No Retrieval": 0, "Retrieval": 1, "Planning": 2}


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


def oracle_replies(requests, rng_of, noise, style):
    """The oracle's output for each (free, unforced) request of c3po.rollout, prefix included: its draws come from
    rng_of(request), one stream per request (seeded by question and node: the same on any process)."""
    rng = {id(r): rng_of(r) for r in requests}
    return (
        r.prefix + oracle_c3po(r.tree["row"], r.agent, r.ctx, r.prefix, rng[id(r)], noise, style) for r in requests
    )


def require_oracle_metadata(rows, args):
    """Under --teacher oracle, which reads each question's hops: a one-line DataError naming the first row without
    them."""
    if args.teacher == "oracle":
        require_metadata(rows, ORACLE_FIELDS, Path(args.data_dir) / "train.jsonl", "the oracle teacher (--teacher)")


def cheapest(nodes, wins):
    """The successful leaves `wins` (indices into a c3po tree's `nodes`) whose path took the cheapest strategy (its
    router node's; unknown: costliest)."""
    router = lambda i: i if nodes[i]["kind"] == "router" else router(nodes[i]["parent"])  # the path's router node
    cost = {i: STRATEGY_COST.get(nodes[router(i)].get("strategy"), 3) for i in wins}
    return [i for i in wins if cost[i] == min(cost.values())]


def renaming_world(args):
    """The toy world that renames SFT examples and PPO trees (augment_p, rl_augment_p), or None (real data)."""
    return load_world(args.world) if args.world and (args.augment_p or args.rl_augment_p) else None


def rename_pairs(pairs, world, rng, p):
    """Each SFT (prompt, output) pair renamed with probability p (popular names kept: the reader's memory); the draws
    are made for the whole batch, so the rng stays the same on every process. Unchanged without a world."""
    if world is None:
        return pairs
    return [rename_entities(pair, world, rng, "keep") if rng.random() < p else pair for pair in pairs]
