"""Is the toy world learnable? Plain SFT of the tiny toy model on oracle retrieve-then-answer demonstrations.

    python bench/toy_sft.py                      # about 3 min 15 s on 2 CPU cores (about 181 s of training)
    python bench/toy_sft.py --types one_hop --steps 600 --curriculum 0   # a quicker probe

Policy format (one step per call, greedy):  question : <q> [OBS] <passage> ... [ACT]  ->  [SEARCH] <entity> <word>
or [ANSWER] <answer>, then EOS. The oracle searches "<entity> <relation word>" (metadata sub_queries) for every hop
whose entity is not popular and answers directly from memory otherwise; retrieval is TF-IDF top-1 over the toy
corpus.
Renaming augmentation, fresh per batch: an example of an episode that uses no memorised fact is renamed with
probability --augment_p (default 1: such facts are never memorised, only copied), its searched entities onto
non-popular entities and every other name (answers, other passage names) onto any entity of its type, popular or
not (--popular free: a tiny model otherwise answers popular names from memory instead of copying them out of the
passage); an example that uses memory is renamed with probability --memory_p (default 0), popular names kept.
Curriculum: the first --curriculum steps train on one-hop episodes only (the copy skill), then on all types
(--one_hop_share of the later examples still drawn from one-hop episodes).
Held-out: the test split, whose non-popular facts never appear in a training question; unanswerable questions are
left out. Prints EM by question type and popularity.
"""

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from common.data import load_qa
from common.llm import generate
from common.metrics import exact_match
from common.retrieval import DenseRetriever, load_corpus, make_encoder
from common.toy import DEFAULT_WORLD, load_world, rename_entities
from common.toy.lm import load_toy_lm

TAGS = ("[SEARCH]", "[ANSWER]", "[OBS]", "[ACT]")


def parse_args():
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default=str(DEFAULT_WORLD), help="toy world folder")
    p.add_argument("--model", default="toy-lm", help="toy model spec")
    p.add_argument("--steps", type=int, default=800, help="SFT steps")
    p.add_argument("--batch", type=int, default=64, help="examples per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then linear decay to 0.1x")
    p.add_argument(
        "--augment_p", type=float, default=1.0, help="probability of renaming a retrieval example's entities"
    )
    p.add_argument("--memory_p", type=float, default=0.0, help="probability of renaming a memory example")
    p.add_argument(
        "--popular",
        default="free",
        choices=("free", "shuffle", "rename", "keep"),
        help="renaming of popular names in examples that use no memorised fact",
    )
    p.add_argument("--types", default="one_hop,two_hop,three_hop,comparison,yes_no", help="question types to train on")
    p.add_argument(
        "--curriculum", type=int, default=400, help="train on one-hop episodes only for this many first steps"
    )
    p.add_argument(
        "--one_hop_share",
        type=float,
        default=0.5,
        help="after the curriculum, probability that an example is drawn from one-hop episodes only",
    )
    p.add_argument(
        "--eval_every", type=int, default=0, help="also evaluate every this many steps (0: only at the end)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, batches and renaming")
    return p.parse_args()


def prompt_of(question, observations):
    """The policy prompt: question, observations so far, then the action tag."""
    return " ".join([f"question : {question}"] + [f"[OBS] {o}" for o in observations] + ["[ACT]"])


def oracle_steps(row, passage_of):
    """(prompt, target, uses memory, searched entities, question type) of each step of a QA row's oracle episode."""
    m = row["metadata"]
    heads = m["entities"][:2] if m["type"] in ("comparison", "yes_no") else m["entities"][:-1]
    steps, observations, memory = [], [], any(m["popular_hops"])
    for head, query, popular in zip(heads, m["sub_queries"], m["popular_hops"]):
        if not popular:
            steps.append((prompt_of(row["question"], observations), f"[SEARCH] {query}", memory, heads, m["type"]))
            observations.append(passage_of[head])
    steps.append(
        (prompt_of(row["question"], observations), f"[ANSWER] {row['golden_answers'][0]}", memory, heads, m["type"])
    )
    return steps


def rename_example(prompt, target, memory, heads, world, rng, popular):
    """An SFT example renamed: popular names kept in memory episodes, else as --popular says."""
    if memory:
        return rename_entities([prompt, target], world, rng, popular="keep")
    if popular == "free":
        return rename_entities([prompt, target], world, rng, popular="free", searched=heads)
    return rename_entities([prompt, target], world, rng, popular=popular)


def make_batch(tokenizer, pairs):
    """Right-padded input ids, attention mask and labels (loss on the target and its EOS only)."""
    rows = []
    for prompt, target in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + t, [-100] * len(p) + t))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in rows])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in rows])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in rows])
    return ids, mask, labels


def train(model, tokenizer, pairs, world, args, test_rows, retriever):
    """SFT with AdamW, warm-up then linear decay, renaming augmentation per example (test EM every eval_every)."""
    rng = random.Random(args.seed)
    one_hop = [pair for pair in pairs if pair[-1] == "one_hop"] or pairs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    start = time.time()
    for step in range(args.steps):
        batch = [
            rng.choice(one_hop if step < args.curriculum or rng.random() < args.one_hop_share else pairs)
            for _ in range(args.batch)
        ]
        batch = [
            rename_example(prompt, target, memory, heads, world, rng, args.popular)
            if rng.random() < (args.memory_p if memory else args.augment_p)
            else (prompt, target)
            for prompt, target, memory, heads, _ in batch
        ]
        ids, mask, labels = make_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} elapsed {time.time() - start:.1f}s", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            table = report(test_rows, *evaluate(model, tokenizer, test_rows, retriever))
            print(f"step {step} test EM " + " ".join(f"{k}={table[k]['em']:.3f}" for k in ("all", "one_hop unseen")))
            model.train()
    return time.time() - start


@torch.no_grad()
def evaluate(model, tokenizer, rows, retriever, max_steps=4):
    """Greedy episodes on rows: (EM per row, retrievals per row)."""
    model.eval()
    observations = [[] for _ in rows]
    answers, searches = [None] * len(rows), [0] * len(rows)
    for _ in range(max_steps):
        active = [i for i, a in enumerate(answers) if a is None]
        if not active:
            break
        out = generate(
            model,
            tokenizer,
            [prompt_of(rows[i]["question"], observations[i]) for i in active],
            max_new_tokens=6,
            do_sample=False,
        )
        queries = {}
        for i, text in zip(active, out.texts):
            action = text.strip()
            if action.startswith("[ANSWER]"):
                answers[i] = action[len("[ANSWER]") :].strip()
            elif action.startswith("[SEARCH]"):
                queries[i] = action[len("[SEARCH]") :].strip()
            else:
                answers[i] = ""  # invalid action ends the episode
        hits = retriever.search(list(queries.values()), 1) if queries else []
        for i, hit in zip(queries, hits):
            observations[i].append(hit[0]["text"])
            searches[i] += 1
    ems = [exact_match(a or "", r["golden_answers"]) for a, r in zip(answers, rows)]
    return ems, searches


def knowledge_group(meta):
    """ "unseen" (no hop uses a memorised fact: every fact is only in the corpus and in no training question),
    "popular" (every hop memorised) or "mixed" (memory and reading must be combined in one chain)."""
    hops = meta["popular_hops"]
    return "popular" if all(hops) else "mixed" if any(hops) else "unseen"


def report(rows, ems, searches):
    """EM and retrievals per question type and popularity, as a dict."""
    groups = defaultdict(list)
    for r, em, n in zip(rows, ems, searches):
        m = r["metadata"]
        for key in ("all", m["type"], f"{m['type']} {knowledge_group(m)}"):
            groups[key].append((em, n))
    return {
        k: {
            "n": len(v),
            "em": round(sum(e for e, _ in v) / len(v), 3),
            "retrievals": round(sum(n for _, n in v) / len(v), 2),
        }
        for k, v in sorted(groups.items())
    }


def main():
    """Build the world's pieces, train, evaluate, print a RESULT line."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # tiny weights late in training are denormal floats: 5x slower steps on CPU
    world_dir = Path(args.world)
    world = load_world(str(world_dir))
    corpus = load_corpus(world_dir / "corpus.jsonl")
    passage_of = {d["title"]: d["text"] for d in corpus}
    retriever = DenseRetriever.build(corpus, make_encoder("tfidf"))
    types = set(args.types.split(","))
    train_rows = [
        r for r in load_qa(world_dir / "train.jsonl") if r["metadata"]["answerable"] and r["metadata"]["type"] in types
    ]
    test_rows = [r for r in load_qa(world_dir / "test.jsonl") if r["metadata"]["answerable"]]
    pairs = [pair for r in train_rows for pair in oracle_steps(r, passage_of)]
    model, tokenizer = load_toy_lm(args.model, extra_tokens=TAGS, seed=args.seed, world=world_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(train_rows)} train questions -> {len(pairs)} SFT steps; {len(test_rows)} test questions; "
        f"{n_params} parameters; vocab {len(tokenizer)}",
        flush=True,
    )
    train_s = train(model, tokenizer, pairs, world, args, test_rows, retriever)
    start = time.time()
    ems, searches = evaluate(model, tokenizer, test_rows, retriever)
    table = report(test_rows, ems, searches)
    for key, value in table.items():
        print(f"{key:28s} n={value['n']:4d} EM={value['em']:.3f} retrievals={value['retrievals']:.2f}")
    print(
        "RESULT "
        + json.dumps(
            {
                "train_s": round(train_s, 1),
                "eval_s": round(time.time() - start, 1),
                "steps": args.steps,
                "augment_p": args.augment_p,
                "memory_p": args.memory_p,
                "popular": args.popular,
                "curriculum": args.curriculum,
                "params": n_params,
                "test": table,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
