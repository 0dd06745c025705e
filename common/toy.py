"""The toy world: a seeded world of fictional entities, its corpus and questions, and the toy reader (a frozen LLM).

    python -m common.toy --seed 0 --out data/toy          # write a world (same seed, same bytes)
    python -m common.toy baselines --world data/toy       # the baseline table on its test split

A world folder holds corpus.jsonl (FlashRAG {"id", "contents": '"title"\\ntext'}), train/dev/test.jsonl (FlashRAG QA
rows), triples.jsonl ({"doc_id", "head", "relation", "tail"}) and world.json (entities, types, popularity, facts: what
the reader's memory, the tiny models' vocabulary and the renaming augmentation use). docs/toy_world.md describes it.
Whatever reads a world takes its folder (ToyReader, load_world, baselines, world_stats): only the CLI defaults to
data/toy. Model code imports this module, not the reverse (common.llm and common.toy_lm import it).

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
import functools
import json
import random
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORLD = REPO_ROOT / "data" / "toy"
TYPES = ("person", "film", "city", "country", "company")
BASE_COUNTS = {"person": 120, "film": 80, "city": 60, "country": 15, "company": 40}
POPULAR_SHARE, HIDDEN_SHARE, DECOY_SHARE, DESCRIPTOR_P = 0.3, 0.1, 0.35, 0.5
YEARS = {"birth_year": (1900, 1979), "release_year": (1930, 1999)}
SPLIT_SIZES = {
    "test": {"one_hop": 150, "two_hop": 110, "three_hop": 70, "comparison": 35, "yes_no": 35},
    "dev": {"one_hop": 60, "two_hop": 45, "three_hop": 30, "comparison": 15, "yes_no": 15},
}
# relation -> (head type, tail type, passage sentence, triple phrase, noun phrase, oracle query word)
RELATIONS = {
    "born_in": ("person", "city", "{h} was born in {t} .", "born in", "the birthplace of {h}", "born"),
    "birth_year": ("person", "year", "{h} was born in {t} .", "birth year", "the birth year of {h}", "born"),
    "directed_by": (
        "film",
        "person",
        "{h} is a film directed by {t} .",
        "directed by",
        "the director of {h}",
        "directed",
    ),
    "release_year": (
        "film",
        "year",
        "{h} was released in {t} .",
        "release year",
        "the release year of {h}",
        "released",
    ),
    "country": ("city", "country", "{h} is a city in {t} .", "country", "the country of {h}", "city"),
    "capital": ("country", "city", "the capital of {h} is {t} .", "capital", "the capital of {h}", "capital"),
    "founded_by": (
        "company",
        "person",
        "{h} is a company founded by {t} .",
        "founded by",
        "the founder of {h}",
        "founded",
    ),
    "located_in": ("company", "city", "{h} is based in {t} .", "based in", "the home city of {h}", "based"),
}
TYPE_RELATIONS = {t: [r for r, spec in RELATIONS.items() if spec[0] == t] for t in TYPES}
CHAINS = {  # relations -> question template; {0} is the first entity
    ("born_in",): "what is the birthplace of {0} ?",
    ("birth_year",): "what is the birth year of {0} ?",
    ("directed_by",): "who is the director of {0} ?",
    ("release_year",): "in what year did {0} come out ?",
    ("country",): "which country is {0} in ?",
    ("capital",): "what is the capital of {0} ?",
    ("founded_by",): "who is the founder of {0} ?",
    ("located_in",): "where is the headquarters of {0} ?",
    ("directed_by", "born_in"): "what is the birthplace of the director of {0} ?",
    ("directed_by", "birth_year"): "what is the birth year of the director of {0} ?",
    ("founded_by", "born_in"): "what is the birthplace of the founder of {0} ?",
    ("founded_by", "birth_year"): "what is the birth year of the founder of {0} ?",
    ("born_in", "country"): "in which country was {0} born ?",
    ("located_in", "country"): "in which country is {0} based ?",
    ("country", "capital"): "what is the capital of the country where {0} is ?",
    ("directed_by", "born_in", "country"): "in which country was the director of {0} born ?",
    ("founded_by", "born_in", "country"): "in which country was the founder of {0} born ?",
    ("born_in", "country", "capital"): "what is the capital of the country where {0} was born ?",
    ("located_in", "country", "capital"): "what is the capital of the country where {0} is based ?",
}
COMPARISONS = {  # (type, year relation) -> question template; {0}, {1} are the two entities
    ("yes_no", "birth_year"): "was {0} born before {1} ?",
    ("yes_no", "release_year"): "did {0} come out before {1} ?",
    ("comparison", "birth_year"): "who was born first , {0} or {1} ?",
    ("comparison", "release_year"): "which film came out first , {0} or {1} ?",
}
HOP_TYPES = {1: "one_hop", 2: "two_hop", 3: "three_hop"}
HATNOTE = "often confused with {0} ."
PLAN_WORDS = re.compile(r"\b(roadmap|plan|plans|planning|sub-goals?|subgoals?|decompos\w*)\b")
NOTE_WORDS = re.compile(r"\b(updated|single) note\b")
CONFIDENCE_WORDS = re.compile(r"\bconfidence\b")
UNKNOWN = "unknown"
ONSETS, VOWELS, CODAS = "bdfgklmnprstvz", "aeiou", ("", "", "n", "r", "l", "k", "x", "s")
FORMAT_WORDS = """a an the of in on at to by for from with about into over after before between and or but not no yes
if then else than so as is are was were be been being do does did done has have had can could will would should may
might must shall it its this that these those there here which who whom whose what when where why how all any each
every some none other another same first second third last next previous new old more most less least only also
just very one two three four five six seven eight nine ten i you he she we they me my your our their us them
question questions answer answers answered document documents doc docs passage passages context contexts evidence
reference references query queries search searched retrieve retrieval retrieved retriever plan planning roadmap step
steps thought thoughts think thinking action actions observation observations reasoning reason decision decide
final given following based using use need know known unknown find found compare years year entity entities relation
relations triple triples chain note notes summary output input response respond reply true false stop continue end
llm model system user assistant instruction instructions information info relevant irrelevant useful sub subquery
subqueries subquestion goal goals key title text source select selected selection keep filter id ids rank score
strategy bm25 dense rewrite rewritten original current existing analysis gap gaps missing please only short phrase
word words directly born birthplace birth director directed film films released release come came out country
countries city cities capital company companies founded founder based headquarters home where person people
confused called named known was""".split()
FORMAT_WORDS += [str(i) for i in range(21)] + list(":.,?!;[](){}<>\"'/-_=+*#|&%$@~`")
FORMAT_WORDS_SET = frozenset(FORMAT_WORDS)


# ---------------------------------------------------------------- generation: entities and facts


def make_names(rng, n, taken):
    """n new syllable names (2-3 syllables, one optional coda), each two letters or more from every taken name."""
    names = []
    while len(names) < n:
        syllables = rng.choice((2, 2, 3))
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
        if name not in taken and all(hamming(name, other) > 1 for other in taken):
            taken.add(name)
            names.append(name)
    return names


def hamming(a, b):
    """Letters that differ between two names of the same length (a large number for different lengths)."""
    return sum(x != y for x, y in zip(a, b)) if len(a) == len(b) else 99


def near_name(rng, name, taken):
    """A new name one vowel away from `name` and two letters or more from every other taken name, or None."""
    spots = [i for i, ch in enumerate(name) if ch in VOWELS]
    rng.shuffle(spots)
    for i in spots:
        for v in rng.sample(VOWELS, len(VOWELS)):
            candidate = name[:i] + v + name[i + 1 :]
            if (
                candidate != name
                and candidate not in taken
                and all(hamming(candidate, other) > 1 for other in taken if other != name)
            ):
                taken.add(candidate)
                return candidate
    return None


def random_facts(rng, etype, by_type, country_of=None):
    """Random facts {relation: tail} for a new entity of a type (cities get their country from country_of)."""
    facts = {}
    for rel in TYPE_RELATIONS[etype]:
        tail_type = RELATIONS[rel][1]
        if tail_type == "year":
            facts[rel] = str(rng.randint(*YEARS[rel]))
        elif rel == "capital":
            facts[rel] = rng.choice(by_type["city"])
        else:
            facts[rel] = rng.choice(by_type[tail_type])
    return facts


def make_entities(rng, size):
    """World entities: {name: {"type", "popular", "hidden", "decoy_of", "facts"}} with consistent capitals."""
    taken, entities, by_type = set(FORMAT_WORDS_SET), {}, {}
    for etype in TYPES:
        by_type[etype] = make_names(rng, max(4, round(BASE_COUNTS[etype] * size)), taken)
    cities = by_type["city"]
    countries = by_type["country"]
    country_of = {
        c: countries[i % len(countries)] if i < len(countries) else rng.choice(countries) for i, c in enumerate(cities)
    }
    capital = {k: next(c for c in cities if country_of[c] == k) for k in countries}
    for etype in TYPES:
        names = by_type[etype]
        popular = set(rng.sample(names, round(POPULAR_SHARE * len(names))))
        others = [n for n in names if n not in popular]
        hidden = set(rng.sample(others, round(HIDDEN_SHARE * len(others))))
        for name in names:
            facts = random_facts(rng, etype, by_type)
            if etype == "city":
                facts["country"] = country_of[name]
            if etype == "country":
                facts["capital"] = capital[name]
            entities[name] = {
                "type": etype,
                "popular": name in popular,
                "hidden": name in hidden,
                "decoy_of": None,
                "facts": facts,
            }
    for name in sorted(entities):
        if rng.random() < DECOY_SHARE:
            decoy = near_name(rng, name, taken)
            if decoy:
                etype = entities[name]["type"]
                facts = random_facts(rng, etype, by_type)
                for rel, tail in entities[name]["facts"].items():  # every decoy fact differs from the true one
                    while facts[rel] == tail:
                        facts[rel] = random_facts(rng, etype, by_type)[rel]
                entities[decoy] = {"type": etype, "popular": False, "hidden": False, "decoy_of": name, "facts": facts}
    return entities


def passage_text(name, entity):
    """The passage of an entity: one sentence per fact, plus the hatnote for a decoy."""
    sentences = [RELATIONS[rel][2].format(h=name, t=tail) for rel, tail in entity["facts"].items()]
    if entity["decoy_of"]:
        sentences.append(HATNOTE.format(entity["decoy_of"]))
    return " ".join(sentences)


def make_corpus(rng, entities):
    """(corpus rows, triples rows, doc id of each entity) for all non-hidden entities, in a seeded order."""
    names = sorted(n for n, e in entities.items() if not e["hidden"])
    rng.shuffle(names)
    corpus, triples, doc_of = [], [], {}
    for i, name in enumerate(names):
        doc_id = str(i)
        doc_of[name] = doc_id
        corpus.append({"id": doc_id, "contents": f'"{name}"\n{passage_text(name, entities[name])}'})
        for rel, tail in entities[name]["facts"].items():
            triples.append({"doc_id": doc_id, "head": name, "relation": RELATIONS[rel][3], "tail": tail})
    return corpus, triples, doc_of


# ---------------------------------------------------------------- generation: questions and splits


def chain_question(entities, doc_of, rels, start):
    """A chain question row (no id, no descriptor) from a start entity, or None if the chain does not type-check."""
    if entities[start]["type"] != RELATIONS[rels[0]][0]:
        return None
    chain = [start]
    for rel in rels:
        chain.append(entities[chain[-1]]["facts"][rel])
    heads = chain[:-1]
    return make_row(
        entities, doc_of, CHAINS[tuple(rels)].format(start), chain[-1], HOP_TYPES[len(rels)], list(rels), heads, chain
    )


def comparison_question(entities, doc_of, kind, rel, a, b):
    """A comparison or yes/no question row about the years of two entities, or None on a tie."""
    ya, yb = entities[a]["facts"][rel], entities[b]["facts"][rel]
    if ya == yb:
        return None
    answer = ("yes" if ya < yb else "no") if kind == "yes_no" else (a if ya < yb else b)
    return make_row(
        entities, doc_of, COMPARISONS[(kind, rel)].format(a, b), answer, kind, [rel, rel], [a, b], [a, b, answer]
    )


def make_row(entities, doc_of, question, answer, qtype, rels, heads, chain):
    """A FlashRAG QA row with the metadata every method may use (oracle sub-queries, bridges, popularity...)."""
    popular_hops = [entities[h]["popular"] for h in heads]
    meta = {
        "type": qtype,
        "hops": len(rels),
        "relations": rels,
        "entities": chain,
        "bridge_entities": chain[1:-1] if qtype.endswith("hop") else [],
        "sub_queries": [f"{h} {RELATIONS[r][5]}" for h, r in zip(heads, rels)],
        "sub_answers": [entities[h]["facts"][r] for h, r in zip(heads, rels)],
        "supporting_doc_ids": [doc_of[h] for h in heads if h in doc_of],
        "distractor_doc_ids": sorted({doc_of[d] for d, e in entities.items() if e["decoy_of"] in heads}, key=int),
        "popular": all(popular_hops),
        "popular_hops": popular_hops,
        "answerable": all(p or h in doc_of for p, h in zip(popular_hops, heads)),
        "descriptor": None,
    }
    return {"question": question, "golden_answers": [answer], "metadata": meta}


def all_questions(rng, entities, doc_of):
    """Every chain question of the world plus a seeded sample of comparison and yes/no pairs."""
    real = sorted(n for n, e in entities.items() if not e["decoy_of"])
    rows = [row for rels in CHAINS for name in real if (row := chain_question(entities, doc_of, rels, name))]
    for (kind, rel), _ in COMPARISONS.items():
        pool = [n for n in real if entities[n]["type"] == RELATIONS[rel][0]]
        for _ in range(len(pool) * 2):
            a, b = rng.sample(pool, 2)
            if row := comparison_question(entities, doc_of, kind, rel, a, b):
                rows.append(row)
    return rows


def used_facts(entities, row):
    """The non-popular (head, relation) facts a question needs."""
    m = row["metadata"]
    heads = m["entities"][:2] if m["type"] in ("comparison", "yes_no") else m["entities"][:-1]
    return {(h, r) for h, r in zip(heads, m["relations"]) if not entities[h]["popular"]}


def split_questions(rng, entities, rows):
    """train/dev/test: test and dev facts never appear in train questions (popular facts are shared by design)."""
    rng.shuffle(rows)
    splits, held = {}, set()
    for split in ("test", "dev"):
        chosen, facts = [], set()
        for qtype in ("three_hop", "two_hop", "comparison", "yes_no", "one_hop"):
            n = SPLIT_SIZES[split][qtype]
            of_type = [r for r in rows if r["metadata"]["type"] == qtype]
            popular = [r for r in of_type if r["metadata"]["popular"]]
            n_popular = round(n * len(popular) / len(of_type))
            pool = [r for r in of_type if not r["metadata"]["popular"] and not (used_facts(entities, r) & held)]
            picked = popular[:n_popular]
            for _ in range(min(n - n_popular, len(pool))):  # fewest new held-out facts first: train keeps the rest
                row = min(pool, key=lambda r: len(used_facts(entities, r) - facts))
                pool.remove(row)
                picked.append(row)
                facts |= used_facts(entities, row)
            chosen += picked
        held |= facts
        rng.shuffle(chosen)
        splits[split] = chosen
    taken = {id(r) for s in splits.values() for r in s if not r["metadata"]["popular"]}
    splits["train"] = [r for r in rows if id(r) not in taken and not (used_facts(entities, r) & held)]
    return splits, held


def add_descriptor(rng, entities, row, forbidden):
    """With probability DESCRIPTOR_P, name a related entity after the first entity ("velbo ( the director of x )")."""
    m = row["metadata"]
    if m["type"] not in HOP_TYPES.values() or rng.random() >= DESCRIPTOR_P:
        return row
    first = m["entities"][0]
    options = sorted(
        (other, rel)
        for other, e in entities.items()
        for rel, tail in e["facts"].items()
        if tail == first
        and not e["decoy_of"]
        and not e["hidden"]
        and (other, rel) not in forbidden
        and other not in m["entities"]
    )
    if not options:
        return row
    other, rel = rng.choice(options)
    described = f"{first} ( {RELATIONS[rel][4].format(h=other)} )"
    return {
        **row,
        "question": row["question"].replace(f" {first} ", f" {described} ", 1),
        "metadata": {**m, "descriptor": other},
    }


def generate_world(seed=0, size=1.0):
    """All files of a world as {filename: rows or dict}; deterministic in (seed, size)."""
    rng = random.Random(seed)
    entities = make_entities(rng, size)
    corpus, triples, doc_of = make_corpus(rng, entities)
    splits, held = split_questions(rng, entities, all_questions(rng, entities, doc_of))
    files = {"corpus.jsonl": corpus, "triples.jsonl": triples}
    for split in ("train", "dev", "test"):
        forbidden = held if split == "train" else set()
        rows = [add_descriptor(rng, entities, row, forbidden) for row in splits[split]]
        files[f"{split}.jsonl"] = [{"id": f"toy-{split}-{i}", **row} for i, row in enumerate(rows)]
    files["world.json"] = {"seed": seed, "size": size, "years": YEARS, "entities": entities}
    return files


def write_world(out, seed=0, size=1.0):
    """Write a world folder; same seed and size, same bytes."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in generate_world(seed, size).items():
        if name.endswith(".jsonl"):
            text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in content)
        else:
            text = json.dumps(content, sort_keys=True, indent=0) + "\n"
        tmp = out / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)
    return out


# ---------------------------------------------------------------- the world as the reader and augmentation see it


@functools.lru_cache(maxsize=8)
def load_world(world_dir):
    """world.json with indexes: types, popular set, memory of popular facts, near names, renaming pools."""
    path = Path(world_dir) / "world.json"
    if not path.is_file():
        from common.data import DataError  # a user's mistake: one line, no traceback (common.runs.run_main)

        raise DataError(
            f"{path}: no toy world here (the toy reader, toy-lm and the toy teacher need one): pass --world DIR "
            f"(a folder with world.json), or write one with python -m common.toy --out {world_dir}"
        )
    world = json.loads(path.read_text(encoding="utf-8"))
    ents = world["entities"]
    world["types"] = {n: e["type"] for n, e in ents.items()}
    world["popular"] = {n for n, e in ents.items() if e["popular"]}
    world["memory"] = {(n, r): t for n in world["popular"] for r, t in ents[n]["facts"].items()}
    by_len = defaultdict(list)
    for n in ents:
        by_len[(len(n), ents[n]["type"])].append(n)
    world["near"] = {n: [o for o in by_len[(len(n), e["type"])] if hamming(n, o) == 1] for n, e in ents.items()}
    world["pools"] = {
        t: sorted(n for n, e in ents.items() if e["type"] == t and not e["popular"] and not e["decoy_of"])
        for t in TYPES
    }
    world["popular_pools"] = {t: sorted(n for n in world["popular"] if ents[n]["type"] == t) for t in TYPES}
    lo, hi = min(y[0] for y in world["years"].values()), max(y[1] for y in world["years"].values())
    world["year_range"] = (lo, hi)
    return world


def world_or_none(data_dir):
    """The toy world in data_dir, or None for a folder without world.json (real data: no renaming)."""
    return load_world(str(data_dir)) if (Path(data_dir) / "world.json").is_file() else None


def rename_entities(texts, world, rng, popular="keep", rename_years=True, searched=()):
    """Rename the toy entities of texts consistently (one injective map for all texts): non-popular ones onto
    non-popular entities of the same type, years by an order-preserving map. Popular entities: "keep" (their facts
    are the memory a model learns; years are then kept too), "shuffle" (onto other popular entities of the same type:
    for texts that use no memorised fact) or "rename" (onto non-popular ones). "free": the `searched` names onto
    non-popular entities, every other name onto any entity of its type, popular or not (for texts that use no
    memorised fact: popular names then get copied out of passages too, docs/toy_world.md). Text without toy names is
    unchanged."""
    if popular not in ("keep", "shuffle", "rename", "free"):
        raise ValueError(f"popular must be 'keep', 'shuffle', 'rename' or 'free', not {popular!r}")
    world = load_world(str(world)) if isinstance(world, (str, Path)) else world
    if popular == "free":
        return rename_free(texts, world, rng, set(searched), rename_years)
    found = sorted({w for text in texts for w in re.findall(r"\b[a-z]+\b|\b\d{4}\b", text)})
    names = [w for w in found if w in world["types"]]
    moved = [n for n in names if popular == "rename" or n not in world["popular"]]
    mapping = {}
    for group, pools in ((moved, world["pools"]), ([n for n in names if n not in moved], world["popular_pools"])):
        for etype in TYPES:
            present = [n for n in group if world["types"][n] == etype]
            if popular == "keep" and pools is world["popular_pools"]:
                continue
            if len(present) > len(pools[etype]):
                raise ValueError(f"cannot rename {len(present)} {etype} names onto {len(pools[etype])} targets")
            mapping.update(zip(present, rng.sample(pools[etype], len(present))))
    lo, hi = world["year_range"]
    kept = popular == "keep" and any(n in world["popular"] for n in names)
    years = [w for w in found if w.isdigit() and lo <= int(w) <= hi] if rename_years and not kept else []
    mapping.update(zip(years, map(str, sorted(rng.sample(range(lo, hi + 1), len(years))))))
    return apply_mapping(texts, mapping)


def rename_free(texts, world, rng, searched, rename_years=True):
    """rename_entities' "free" mode: searched names onto non-popular entities, other names onto any entity."""
    found = sorted({w for text in texts for w in re.findall(r"\b[a-z]+\b|\b\d{4}\b", text)})
    names = [w for w in found if w in world["types"]]
    mapping = {}
    for etype in TYPES:
        fixed = [n for n in names if world["types"][n] == etype and n in searched]
        free = [n for n in names if world["types"][n] == etype and n not in searched]
        mapping.update(zip(fixed, rng.sample(world["pools"][etype], len(fixed))))
        used = set(mapping.values())
        rest = [n for n in world["pools"][etype] + world["popular_pools"][etype] if n not in used]
        mapping.update(zip(free, rng.sample(rest, len(free))))
    lo, hi = world["year_range"]
    years = [w for w in found if w.isdigit() and lo <= int(w) <= hi] if rename_years else []
    mapping.update(zip(years, map(str, sorted(rng.sample(range(lo, hi + 1), len(years))))))
    return apply_mapping(texts, mapping)


WORD = re.compile(r"\b\w+\b")


def world_renaming(world, rng, searched=()):
    """A type-preserving bijection of all the world's names, as (forward, inverse) dicts: the `searched` names onto
    non-popular entities, every other name onto what is left of its type (years kept). For augmenting whole episodes
    whose later texts are not known yet (RL rollouts): a policy's query goes back through `inverse` to the real
    corpus, the passages found come forward through `forward`."""
    forward = {}
    for etype in TYPES:
        names = sorted(n for n, t in world["types"].items() if t == etype)
        fixed = [n for n in names if n in searched]
        forward.update(zip(fixed, rng.sample(world["pools"][etype], len(fixed))))
        used = set(forward.values())
        rest = [n for n in names if n not in used]
        forward.update(zip([n for n in names if n not in searched], rng.sample(rest, len(rest))))
    return forward, {v: k for k, v in forward.items()}


def renamed_row(row, world, rng):
    """A not-popular question with its entities renamed for one RL episode (the SFT augmentation's counterpart): the
    question and golds through a fresh world_renaming, kept with it as row["rename"] = (forward, inverse), so the
    episode's queries and LLM prompts go back to the real names and what comes back reads renamed. Popular questions
    stay as they are (their facts are the memory a model learns)."""
    if row["metadata"].get("popular", False):
        return row
    forward, inverse = world_renaming(world, rng, searched=row["metadata"].get("entities", [])[:1])
    question, *golds = apply_mapping([row["question"], *row["golden_answers"]], forward)
    return dict(row, question=question, golden_answers=golds, rename=(forward, inverse))


def rename_rows(rows, world, rng, p):
    """Each row renamed for one RL episode with probability p (renamed_row; popular questions stay as they are);
    rows unchanged without a world."""
    return [renamed_row(r, world, rng) if world and rng.random() < p else r for r in rows]


class RenamingEnv:
    """A frozen retriever and LLM as a renamed question sees them (the RL side of the renaming augmentation): for a
    row with row["rename"] = (forward, inverse) (renamed_row), queries and prompts go back to the real names and the
    documents and replies come forward into the row's names; any other row passes through unchanged, so the same
    object serves real data. search(queries, k, rows) and chat(messages_lists, rows, **sampling): one row per item.
    A hit's "triples" (a list of strings: a KG store's triples of that document) are renamed with its text."""

    def __init__(self, retriever, llm=None):
        self.retriever, self.llm = retriever, llm

    def search(self, queries, k, rows):
        back = [apply_mapping([q], r["rename"][1])[0] if r.get("rename") else q for q, r in zip(queries, rows)]
        hits = self.retriever.search(back, k)
        renamed = lambda key, v, m: apply_mapping([v], m)[0] if key in ("title", "text", "contents") else v
        forward = lambda hit, m: {
            k: apply_mapping(v, m) if k == "triples" else renamed(k, v, m) for k, v in hit.items()
        }
        return [
            [forward(h, r["rename"][0]) for h in found] if r.get("rename") else found for found, r in zip(hits, rows)
        ]

    def chat(self, messages_lists, rows, **sampling):
        back = lambda messages, m: [dict(x, content=apply_mapping([x["content"]], m)[0]) for x in messages]
        sent = [back(msgs, r["rename"][1]) if r.get("rename") else msgs for msgs, r in zip(messages_lists, rows)]
        replies = self.llm.chat(sent, **sampling) if sent else []
        return [apply_mapping([t], r["rename"][0])[0] if r.get("rename") else t for t, r in zip(replies, rows)]


def apply_mapping(texts, mapping):
    """Replace whole words of texts by their image under mapping (a dict of single words; texts unchanged when it is
    empty). One fixed pattern and a dict lookup, so a map of every name in the world costs no more than a small one."""
    if not mapping:
        return list(texts)
    return [WORD.sub(lambda m: mapping.get(m.group(0), m.group(0)), text) for text in texts]


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


# ---------------------------------------------------------------- the toy reader

FACT_PATTERNS = []  # (compiled regex with head/tail groups, candidate relations), built from RELATIONS
for _sentence in dict.fromkeys(spec[2] for spec in RELATIONS.values()):
    _regex = re.escape(_sentence[:-2]).replace(r"\{h\}", r"\b([a-z]+)").replace(r"\{t\}", r"([a-z0-9]+)\b")
    FACT_PATTERNS.append(
        (re.compile(_regex.replace(r"\ ", r"\s+")), [r for r, spec in RELATIONS.items() if spec[2] == _sentence])
    )
TRIPLE_PATTERN = re.compile(r"<\s*([a-z]+)\s*;\s*([a-z ]+?)\s*;\s*([a-z0-9]+)\s*>")
PHRASE_RELATIONS = {spec[3]: rel for rel, spec in RELATIONS.items()}


def question_patterns():
    """(compiled regex, kind, relations) for every question template, entity slots as ([a-z]+) groups."""
    out = []
    templates = [(t, "chain", list(rels)) for rels, t in CHAINS.items()]
    templates += [(t, kind, [rel, rel]) for (kind, rel), t in COMPARISONS.items()]
    for template, kind, rels in templates:
        regex = re.escape(template).replace(r"\{0\}", r"([a-z]+)").replace(r"\{1\}", r"([a-z]+)")
        out.append((re.compile(r"\b" + regex.replace(r"\ ", r"\s+")), kind, rels))
    return out


QUESTION_PATTERNS = question_patterns()


class ToyReader:
    """The toy world's frozen LLM: deterministic, reads toy facts in its prompt plus a memory of popular entities.
    See the module docstring for the protocol (question finding, fact reading, careless lookup, the three modes)."""

    def __init__(self, world_dir, **_):
        self.world = load_world(str(world_dir))

    def chat(self, messages_lists, stop=None, **_sampling):
        """One reply per conversation (list of {"role", "content"}); sampling arguments are ignored. In think mode a
        `stop` without "</think>" (given, and not None) asks for every step at once."""
        stepwise = stop is None or "</think>" in ([stop] if isinstance(stop, str) else list(stop))
        return [self.reply("\n".join(m["content"] for m in messages), stepwise) for messages in messages_lists]

    def reply(self, prompt, stepwise=True):
        """The reply to one prompt text."""
        text = prompt.lower()
        question = self.find_question(text)
        if "<think>" in text:
            steps = [self.think(text, question)]
            while not stepwise and not steps[-1].startswith("<answer>"):  # ends: a link repeats at most twice
                steps.append(self.think(text + "\n" + "\n".join(steps), question))
            return "\n".join(steps)
        if PLAN_WORDS.search(text):
            return self.plan(text, question)
        if NOTE_WORDS.search(text):
            return self.note(text, question) + (" [END]" if "[end]" in text else "")
        answer = self.answer(self.read_facts(text), question) if question else UNKNOWN
        if CONFIDENCE_WORDS.search(text):
            answer = "0.0" if answer == UNKNOWN else "1.0"
        answer = f"<answer> {answer} </answer>" if "<answer>" in text else answer
        return answer + " [END]" if "[end]" in text else answer

    def find_question(self, text):
        """(kind, relations, entities) of the last question template matched in the text, or None."""
        flat = re.sub(r"\s*\([^()]*\)", "", text)
        flat = re.sub(r"\s*([?,])\s*", r" \1 ", flat)
        best = None
        for pattern, kind, rels in QUESTION_PATTERNS:
            for m in pattern.finditer(flat):
                names = m.groups()
                wanted = [RELATIONS[rels[0]][0]] * len(names)
                if [self.world["types"].get(n) for n in names] == wanted and (best is None or m.end() > best[0]):
                    best = (m.end(), kind, rels, names)
        return best[1:] if best else None

    def read_facts(self, text):
        """Every (head, relation, tail) stated in the text, in order of appearance."""
        found = []
        for pattern, rels in FACT_PATTERNS:
            for m in pattern.finditer(text):
                found += [
                    (m.start(), h, r, t)
                    for h, r, t in [(m.group(1), None, m.group(2))]
                    for r in [self.relation_of(rels, h, t)]
                    if r
                ]
        for m in TRIPLE_PATTERN.finditer(text):
            rel = PHRASE_RELATIONS.get(" ".join(m.group(2).split()))
            if rel and self.relation_of([rel], m.group(1), m.group(3)):
                found.append((m.start(), m.group(1), rel, m.group(3)))
        return [f[1:] for f in sorted(found)]

    def relation_of(self, rels, head, tail):
        """The relation among rels that the head and tail types fit, or None."""
        types = self.world["types"]
        for rel in rels:
            h_type, t_type = RELATIONS[rel][:2]
            tail_ok = tail.isdigit() if t_type == "year" else types.get(tail) == t_type
            if types.get(head) == h_type and tail_ok:
                return rel
        return None

    def lookup(self, facts, entity, rel):
        """The tail the reader believes for (entity, rel): see the careless rule in the module docstring."""
        if entity in self.world["popular"]:
            exact = [t for h, r, t in facts if h == entity and r == rel]
            return exact[-1] if exact else self.world["memory"].get((entity, rel))
        names = {entity, *self.world["near"].get(entity, ())}
        said = [t for h, r, t in facts if h in names and r == rel]
        return said[-1] if said else None

    def links(self, facts, question):
        """[(head, relation, believed tail or None)] along the question, stopping after the first unknown."""
        kind, rels, names = question
        out = []
        if kind == "chain":
            head = names[0]
            for rel in rels:
                tail = self.lookup(facts, head, rel)
                out.append((head, rel, tail))
                if tail is None:
                    break
                head = tail
        else:
            for name in names:
                out.append((name, rels[0], self.lookup(facts, name, rels[0])))
        return out

    def answer(self, facts, question):
        """The short answer to a question given the facts, or UNKNOWN."""
        kind, rels, names = question
        links = self.links(facts, question)
        if any(t is None for _, _, t in links):
            return UNKNOWN
        if kind == "chain":
            return links[-1][2]
        first = int(links[0][2]) < int(links[1][2])
        return ("yes" if first else "no") if kind == "yes_no" else (names[0] if first else names[1])

    def think(self, text, question):
        """One reasoning step: the next link stated, the missing one asked for, or the final <answer>."""
        if not question:
            return f"<answer> {UNKNOWN} </answer>"
        facts = self.read_facts(text)
        thoughts = " ".join(re.findall(r"<think>(.*?)</think>", text, flags=re.S))
        stated = {(h, r) for h, r, _ in self.read_facts(thoughts)}
        for head, rel, tail in self.links(facts, question):
            if tail is None:
                need = f"i need to know {RELATIONS[rel][4].format(h=head)} ."
                if thoughts.count(need) >= 2:
                    return f"<answer> {UNKNOWN} </answer>"
                asked = f"<search> {need} </search>" if "<search>" in text else need
                return f"<think> {asked} </think>"
            if (head, rel) not in stated:
                return f"<think> {RELATIONS[rel][2].format(h=head, t=tail)} </think>"
        return f"<answer> {self.answer(facts, question)} </answer>"

    def note(self, text, question):
        """A query-aware note: the statements of the text along the question's links, exact names, each once."""
        if not question:
            return ""
        kind, rels, names = question
        said = {(h, r): t for h, r, t in self.read_facts(text)}  # the most recent statement of each fact
        kept = []
        if kind == "chain":
            head = names[0]
            for rel in rels:
                tail = said.get((head, rel))
                if tail is not None:
                    kept.append((head, rel, tail))
                elif head in self.world["popular"]:  # followed through memory, not written
                    tail = self.world["memory"].get((head, rel))
                if tail is None:
                    break
                head = tail
        else:
            kept = [(n, rels[0], said[(n, rels[0])]) for n in names if (n, rels[0]) in said]
        return " ".join(RELATIONS[r][2].format(h=h, t=t) for h, r, t in kept)

    def plan(self, text, question):
        """A roadmap: one 'step i : find ... .' line per needed fact, then 'step n : answer the question .'."""
        if not question:
            return "step 1 : answer the question ."
        kind, rels, names = question
        facts = self.read_facts(text)
        goals = []
        if kind == "chain":
            head, known = names[0], True
            for rel in rels:
                goals.append(RELATIONS[rel][4].format(h=head))
                tail = self.lookup(facts, head, rel) if known else None
                known = tail is not None
                head = tail if known else goals[-1]
        else:
            goals = [RELATIONS[rels[0]][4].format(h=n) for n in names]
        lines = [f"step {i} : find {g} ." for i, g in enumerate(goals, 1)]
        if kind != "chain":
            lines.append(f"step {len(lines) + 1} : compare the two years .")
        lines.append(f"step {len(lines) + 1} : answer the question .")
        return "\n".join(lines)


# ---------------------------------------------------------------- baselines


def reader_prompt(question, docs):
    """The prompt the baselines give the toy reader: documents then the question."""
    lines = ["answer the question using the documents ."] + [f"document : {d['contents']}" for d in docs]
    return "\n".join(lines + [f"question : {question}"])


def evaluate_reader(reader, rows, docs_per_row):
    """EM of the reader with the given documents per row: {"all", "answerable", <type>...} -> mean EM."""
    from common.metrics import exact_match

    prompts = [[{"role": "user", "content": reader_prompt(r["question"], d)}] for r, d in zip(rows, docs_per_row)]
    preds = reader.chat(prompts)
    groups = defaultdict(list)
    for row, pred in zip(rows, preds):
        em = exact_match(pred, row["golden_answers"])
        m = row["metadata"]
        for key in (
            "all",
            m["type"],
            "answerable" if m["answerable"] else "unanswerable",
            "popular" if m["popular"] else "not_popular",
            "multi_hop" if m["hops"] > 1 else "single_hop",
        ):
            groups[key].append(em)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def baselines(world_dir, split="test"):
    """The baseline table: {setting: {group: EM}} plus retrieval hit rates {name: rate}."""
    from common.data import load_qa
    from common.retrieval import DenseRetriever, load_corpus, make_encoder

    world_dir = Path(world_dir)
    rows = load_qa(world_dir / f"{split}.jsonl")
    corpus = load_corpus(world_dir / "corpus.jsonl")
    by_id = {d["id"]: d for d in corpus}
    retriever = DenseRetriever.build(corpus, make_encoder("tfidf"))
    reader = ToyReader(world_dir)
    raw = retriever.search([r["question"] for r in rows], 5)
    subs = [q for r in rows for q in r["metadata"]["sub_queries"]]
    sub_hits = iter(retriever.search(subs, 1))
    oracle = [[next(sub_hits)[0] for _ in r["metadata"]["sub_queries"]] for r in rows]
    gold = [[by_id[i] for i in r["metadata"]["supporting_doc_ids"]] for r in rows]
    distract = [[by_id[i] for i in r["metadata"]["distractor_doc_ids"]] for r in rows]
    settings = {
        "no retrieval": [[] for _ in rows],
        "gold documents": gold,
        "raw question, top-1": [h[:1] for h in raw],
        "raw question, top-3": [h[:3] for h in raw],
        "raw question, top-5": raw,
        "oracle sub-queries, top-1 each": oracle,
        "gold documents + distractors after": [g + d for g, d in zip(gold, distract)],
    }
    table = {name: evaluate_reader(reader, rows, docs) for name, docs in settings.items()}
    doc_of = {d["title"]: d["id"] for d in corpus}
    first_gold = [
        [doc_of[r["metadata"]["entities"][0]]] if r["metadata"]["entities"][0] in doc_of else [] for r in rows
    ]
    hits = {
        "raw question top-1 hits the first-hop document": rate(first_gold, [h[:1] for h in raw]),
        "oracle first sub-query top-1 hits the first-hop document": rate(first_gold, [o[:1] for o in oracle]),
        "raw question top-5 recall of all supporting documents": recall(rows, raw),
        "oracle sub-queries top-1 recall of all supporting documents": recall(rows, oracle),
    }
    return table, hits


def rate(golds, hits):
    """Share of rows (with a gold id) whose gold id is among the hits."""
    pairs = [(g[0], {h["id"] for h in hs}) for g, hs in zip(golds, hits) if g]
    return sum(g in ids for g, ids in pairs) / len(pairs)


def recall(rows, hits):
    """Mean recall of the supporting documents over rows that have some."""
    from common.metrics import doc_recall

    pairs = [(r["metadata"]["supporting_doc_ids"], [h["id"] for h in hs]) for r, hs in zip(rows, hits)]
    return sum(doc_recall(ids, gold) for gold, ids in pairs if gold) / sum(1 for gold, _ in pairs if gold)


def format_baselines(table, hits):
    """The baseline table as markdown."""
    cols = ["all", "answerable", "one_hop", "two_hop", "three_hop", "comparison", "yes_no", "popular", "not_popular"]
    lines = ["| setting | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, groups in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{groups.get(c, float('nan')):.3f}" for c in cols) + " |")
    lines += ["", "| retrieval | rate |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in hits.items()]
    return "\n".join(lines)


def world_stats(world_dir):
    """Counts of a world folder: entities by type and flag, questions by split and type, corpus size, bytes."""
    from common.data import read_jsonl

    world_dir = Path(world_dir)
    ents = load_world(str(world_dir))["entities"]
    stats = {
        "entities": dict(Counter(e["type"] for e in ents.values() if not e["decoy_of"])),
        "popular": sum(e["popular"] for e in ents.values()),
        "hidden": sum(e["hidden"] for e in ents.values()),
        "decoys": sum(bool(e["decoy_of"]) for e in ents.values()),
        "corpus": len(read_jsonl(world_dir / "corpus.jsonl")),
        "bytes": sum(p.stat().st_size for p in world_dir.iterdir() if p.is_file()),
    }
    for split in ("train", "dev", "test"):
        rows = read_jsonl(world_dir / f"{split}.jsonl")
        stats[split] = dict(
            Counter(r["metadata"]["type"] for r in rows),
            total=len(rows),
            unanswerable=sum(not r["metadata"]["answerable"] for r in rows),
            popular=sum(r["metadata"]["popular"] for r in rows),
        )
    return stats


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


if __name__ == "__main__":
    main()


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


class ReasoningReader:
    """The toy reader as a reasoning LLM, for SPARKLE's Fig. 7 mode: its steps are paragraphs without tags and its
    answer is in \\boxed{}; the paragraphs of the thoughts so far are read back as its <think> steps. A `stop` with a
    blank line (or none) asks for one step, any other for every step at once."""

    def __init__(self, reader):
        self.reader = reader

    def chat(self, messages_lists, stop=None, **sampling):
        tag = lambda text: "".join(f"<think> {p.strip()} </think>\n" for p in text.split("\n\n") if p.strip())
        tagged = [[dict(m, content=m["content"] + "\n<think> </think>" if m["role"] == "user" else tag(m["content"]))
                   for m in messages] for messages in messages_lists]  # fmt: skip
        replies = self.reader.chat(tagged, stop=["</think>"] if stop is None or "\n\n" in list(stop) else [])
        boxed = lambda r: re.sub(r"<answer>(.*?)</answer>", r"\\boxed{\1}", re.sub(r"</?think>", "\n\n", r))
        return [re.sub(r"\s*\n\s*", "\n\n", boxed(r).strip()) for r in replies]


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
