"""The toy world: a seeded world of fictional entities, its corpus and questions, and the toy reader (a frozen LLM).

    python -m common.toy --seed 0 --out data/toy          # write a world (same seed, same bytes)
    python -m common.toy baselines --world data/toy       # the baseline table on its test split

A world folder holds corpus.jsonl (FlashRAG {"id", "contents": '"title"\\ntext'}), train/dev/test.jsonl (FlashRAG QA
rows), triples.jsonl ({"doc_id", "head", "relation", "tail"}) and world.json (entities, types, popularity, facts: what
the reader's memory, the tiny models' vocabulary and the renaming augmentation use). docs/toy_world.md describes it.
Whatever reads a world takes its folder (ToyReader, load_world, baselines, world_stats): only the CLI defaults to
data/toy. Model code imports this module, not the reverse (common.llm and common.toy.lm import it).

World. Entities of five types (person, film, city, country, company) with single-token syllable names and eight
relations (RELATIONS). Each entity has one passage stating its facts ("velbo was born in tuvia . velbo was born in
1931 ."). Three twists make every decision of the papers matter:
- popular entities (30% per type): the reader knows all their facts without retrieval;
- hidden entities (10% of the others): no passage at all, so their facts are nowhere (unanswerable questions);
- decoys: phantom entities whose names are one letter away from a real entity ("zorvek" for "zorvak"), with a
  passage of different facts and the hatnote "often confused with zorvak ." (so a search for zorvak finds it).
Questions (metadata "type"): one_hop, two_hop, three_hop chains ("what is the birthplace of the director of
zorvak ?"), comparison ("who was born first , a or b ?") and yes_no ("was a born before b ?"). Question words differ
from passage words (birthplace / born), and some questions carry a descriptor naming a related entity
("... of velbo ( the director of zorvak ) ?"), so the raw question is a worse query than "<entity> <relation word>".

Toy reader protocol (ToyReader.chat; the environment's physics, deterministic, sampling arguments ignored):
1. The prompt is the concatenated message contents. The question is the last match of a question template in it
   (case-insensitive, parenthesised descriptors ignored); no match -> the answer "unknown".
2. Facts are every passage sentence ("x is a film directed by y", ...) or triple "<x ; directed by ; y>" anywhere in
   the prompt (documents, notes, earlier <think> steps), in order of appearance.
3. Lookup of (entity e, relation r): if e is popular, the last exact statement about e, else its memory (the facts of
   popular entities in world.json). If e is not popular, the LAST statement about e OR A NEAR NAME of e (same type,
   one letter apart): the reader is careless, so a decoy passage read after the true one misleads it.
4. Mode, from keywords of the prompt (lowercased): "<think>" -> think; else one of the words "roadmap", "plan",
   "plans", "planning", "sub-goal(s)", "subgoal(s)", "decompos..." -> plan; else answer.
   - answer: the short answer ("velbo", "1931", "yes"); "unknown" when a needed fact is not found. Wrapped as
     "<answer> x </answer>" when the prompt mentions "<answer>"; " [END]" appended when it mentions "[end]".
   - think: one step per call. The first link of the chain not yet stated in an earlier <think> step: stated as a
     passage sentence "<think> zorvak is a film directed by velbo . </think>" when resolvable, else
     "<think> i need to know the director of zorvak . </think>" (after two such steps for the same link:
     "<answer> unknown </answer>"). All links stated -> "<answer> x </answer>". When the prompt mentions "<search>",
     a step that needs a fact asks for it: "<think> <search> i need to know ... </search> </think>". A call whose
     `stop` strings omit "</think>" gets every remaining step and the answer in one reply (a real LLM not stopped).
   - plan: one line per sub-goal, "step 1 : find the director of zorvak .", "step 2 : find the birthplace of the
     director of zorvak ." (known bridges are filled in), and a last "step n : answer the question .".
   - note (the words "updated note" or "single note", as in SPARC-RAG's context manager): a query-aware note, the
     passage sentences of the prompt along the question's links, exact names only (a near name's statement is
     dropped), the most recent statement of a fact kept, each once ("" when none; popular facts are followed
     through memory but not written).
   - confidence (the word "confidence"): "1.0" when the reader can answer the question from the prompt and its
     memory, else "0.0" (a self-evaluated confidence).
The reader never sees gold answers or question metadata.
"""

import argparse
import json
import sys

# the package's names as one module (common.toy.X): world generation and renaming, the reader; each method's toy side
# (common.toy.<method>: oracle teacher, renaming, warm-up) is imported by its method file; the tiny models
# (common.toy.lm) are imported only when asked for, so the toy world never pulls in torch
from common.toy.reader import *  # noqa: F403
from common.toy.reader import baselines, format_baselines, world_stats
from common.toy.world import *  # noqa: F403
from common.toy.world import DEFAULT_WORLD, write_world


def main(argv=None):
    """CLI: write a world, or print the baselines of one."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["baselines"]:
        parser = argparse.ArgumentParser(prog="python -m common.toy baselines", description=baselines.__doc__)
        parser.add_argument("--world", default=str(DEFAULT_WORLD), help="world folder")
        parser.add_argument("--split", default="test", help="train, dev or test")
        args = parser.parse_args(argv[1:])
        print(json.dumps(world_stats(args.world), sort_keys=True))
        print(format_baselines(*baselines(args.world, args.split)))
        return
    parser = argparse.ArgumentParser(prog="python -m common.toy", description="Write a toy world folder.")
    parser.add_argument("--seed", type=int, default=0, help="world seed (same seed, same bytes)")
    parser.add_argument("--out", default=str(DEFAULT_WORLD), help="output folder")
    parser.add_argument("--size", type=float, default=1.0, help="entity count multiplier (1.0: 315 entities)")
    args = parser.parse_args(argv)
    out = write_world(args.out, args.seed, args.size)
    print(json.dumps(world_stats(out), sort_keys=True))
