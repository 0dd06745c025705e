"""The toy world: its entities, facts, corpus, questions and splits (generation), and the world as the reader and
the renaming augmentation see it (load_world, renaming)."""

import functools
import json
import random
import re
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
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
