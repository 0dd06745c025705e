"""SmartRAG's side of the toy world: what only the toy preset uses, reached from smartrag.py through values (the
rewriter spec "oracle", the base_llm spec "toy", the preset-only fields augment_p, rl_augment_p and
base_pretrain_steps) and the adapters below. smartrag.py's header lists them as its toy-world adaptations.
- oracle_rewrite: the warm-up rewriter (GPT-3.5 in the paper) as hop 1's entity + relation (header 9);
- the renaming augmentation: SFT pairs (rename_pair), PPO episodes (rename_rows) and the retriever they see
  (RenamingEnv) (header 10);
- pretrain_base: the raw toy-lm first learns the popular facts, as a pretrained LLM knows them (header 11);
- oracle_policy and oracle_base: a trained policy and the probed base model as they act in the toy world, written in
  the paper's formats (the paper rehearsal, tests/test_paper_rehearsal.py)."""

import re

from common import runs
from common.data import require_metadata
from common.toy.reader import ToyReader
from common.toy.world import RELATIONS, UNKNOWN, RenamingEnv, rename_entities, rename_rows, world_or_none

__all__ = ["RenamingEnv", "rename_rows", "renaming_world", "rename_pair", "renaming_tags", "oracle_rewrite",
           "check_metadata", "pretrain_base", "oracle_policy", "oracle_base"]  # fmt: skip


# ---------------------------------------------------------------- the renaming augmentation (header 10)
def renaming_world(args):
    """The toy world whose names the SFT pairs and PPO episodes are renamed onto, or None (no world, or the preset's
    augment_p and rl_augment_p both 0: nothing renamed)."""
    return world_or_none(args.world) if args.world and (args.augment_p or args.rl_augment_p) else None


def renaming_tags(row):
    """What the renaming of a warm-up pair reads from its question's metadata: whether the question is popular (its
    facts are the base model's memory) and the entity its query searches."""
    meta = row.get("metadata", {})
    return dict(popular=meta.get("popular", False), searched=meta.get("entities", [])[:1])


def rename_pair(texts, example, world, rng, p):
    """The texts (question, observations..., target) of a warm-up pair that retrieves or reads, entity-renamed with
    probability p: the searched names onto non-popular ones, other names onto any (docs/toy_world.md); popular
    questions keep their memorised names. Other pairs, and every pair without a world, unchanged."""
    if world is None or not (example["tag"] == "retrieve" or example["observations"]) or rng.random() >= p:
        return texts
    popular = "keep" if example["popular"] else "free"
    return rename_entities(texts, world, rng, popular=popular, searched=example["searched"])


# ---------------------------------------------------------------- the oracle rewriter (header 9) and its metadata
def oracle_rewrite(rows):
    """The warm-up query of each question: the entity + relation of its first hop (metadata "sub_queries")."""
    return [r["metadata"]["sub_queries"][0] for r in rows]


def check_metadata(rows, args, path):
    """The training rows' metadata that the oracle rewriter reads, checked up front (one line naming the file)."""
    if args.rewriter == "oracle":
        require_metadata(rows, ["sub_queries"], path, "the toy preset's --rewriter oracle (else an LLM spec)")


# ---------------------------------------------------------------- the toy base model (header 11)
def pretrain_base(model, rows, steps, train, accelerator, warnings):
    """The raw toy-lm knows nothing, while the paper's base LLMs know popular facts, the premise of the filtered
    warm-up and of learning when not to retrieve; so it first learns to answer the popular training questions in the
    template-1 prompt with no tag, as a pretrained LLM answers what it knows: train(examples, steps) -> the model
    (smartrag.sft). Rows without a `popular` flag count as not popular (a warning when none is)."""
    examples = [dict(question=r["question"], observations=[], tag=None, text=r["golden_answers"][0], popular=True,
                     searched=[]) for r in rows if r.get("metadata", {}).get("popular")]  # fmt: skip
    if not examples:
        runs.nothing_to_train(accelerator, warnings, "base pretraining", "no training question is popular")
        return model
    return train(examples, steps)


# ---------------------------------------------------------------- oracles in the paper's formats (the rehearsal)
def oracle_policy(prompt, world_dir):
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


def oracle_base(prompt, world_dir, paper):
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
