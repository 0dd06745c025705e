"""The five methods and the training-free baselines on one held-out split: same data, corpus and frozen LLM.

    python bench/compare.py                        # toy world, seed 0: trains what is missing (2 at a time), evaluates
    python bench/compare.py --seeds 0 1 2          # docs/results.md, docs/results.png, docs/curves.png, docs/curves/
    python bench/compare.py --data_dir /tmp/world1 --runs runs/compare_world1 --out /tmp/world1_results

The protocol: every method trains with its own preset on the same pool (the training split, every question type),
logs a learning curve (greedy, on the first runs.N_VAL questions of the dev split, from the SFT model on: the methods'
runs.curve_point) and its training budget (results.json "budget": updates, tokens generated in training, CPU seconds),
and is evaluated on the same test questions. Every method is trained by its own file (`python <method>.py --train
--seed S --output_dir RUNS/<method>/seed<S>`, --jobs at a time, OMP_NUM_THREADS=1 each, logs in
RUNS/<method>/seed<S>/train.log); a finished run (results.json) is
reused, an unfinished one (a checkpoint, no results.json) is resumed, so deleting RUNS/<method> retrains that method
only. Then every checkpoint (ppo/, else dpo/, else sft/) is evaluated here, in one process, by the method's own
`evaluate` (greedy, the paper's inference) on the same test rows (all of them, whatever the method trained on), and
so are the baselines the papers compare against, which need no training:
  none            the frozen LLM alone (no retrieval)
  vanilla         single-shot RAG: the question retrieves top-k once, the LLM answers (`naive` below)
  iterative:R     iterative RAG, R retrievals (IRCoT-style, ours: each later query is the LLM's last <think> step)
  parallel:N      naive parallel scaling: N answers at T 0.7, majority vote (`naive`) [SPARC-RAG App. A.5]
  sequential:N    naive sequential scaling: up to N attempts, retried below confidence 0.7 (`naive`) [App. A.5: 3]
The baselines use SPARC-RAG's answer prompt, its dense retriever and top-k (toy: TF-IDF, 3) and its token counter.
Costs per question, the same for all: retrievals (search calls), LLM calls (prompts sent to any language model: the
trained policy or proxy and the frozen LLM), generated tokens (written by either, counted in the trained model's
tokenizer; the frozen LLM's replies counted here where a method records only its own model's), and seconds (wall time
of the batched evaluation divided by the questions, --threads torch threads; training excluded).
Writes OUT/results.md (the tables, each paper's headline claim beside our figure, the budgets, the curves' points),
OUT/results.png (F1 against cost), OUT/curves.png (a panel per method: F1 and its headline cost against training
updates, mean and min-max over the seeds) and OUT/curves/<method>.png (each docs page's panel; matplotlib: pip
install -e ".[plot]"), RUNS/compare.json.
`--replot docs/results.md` only redraws OUT/results.png from that page's main table (rows edited in by hand).
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm  # noqa: E402

from common import runs  # noqa: E402
from common.data import load_split  # noqa: E402
from common.metrics import normalize_answer  # noqa: E402

METHODS = ("smartrag", "c3po", "sparkle", "tearag", "sparcrag")
TRAIN_MINUTES = {
    "sparkle": 20,
    "c3po": 12,
    "smartrag": 10,
    "tearag": 8,
    "sparcrag": 8,
}  # one core (README): longest first
STAGES = ("ppo", "dpo", "sft")  # the checkpoint evaluated: the last stage a run saved
COLUMNS = [("em", "EM", 3), ("f1", "F1", 3), ("acc", "acc", 3), ("retrievals", "retrievals", 2)]
COLUMNS += [("llm_calls", "LLM calls", 2), ("generated_tokens", "generated tokens", 1), ("seconds", "s / question", 4)]
THINK = (  # iterative RAG's step prompt (ours): one <think> step per call, read with the documents found so far
    "answer the question step by step , one step in <think> </think> , the final answer in <answer> </answer> . "
    "documents : {documents} question : {query} {thoughts}"
)


def parse_args(argv=None):
    """Command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default="data/toy", help="a FlashRAG folder (train/test jsonl, corpus.jsonl)")
    p.add_argument("--preset", default="toy", choices=("toy", "paper"), help="every method's --preset")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (docs/results.md: 0 1 2)")
    p.add_argument("--jobs", type=int, default=2, help="trainings at a time (one CPU core each)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="methods compared")
    p.add_argument("--baselines", default="none,vanilla,iterative:3,parallel:4,sequential:3", help="see above")
    p.add_argument("--n_eval", type=int, default=None, help="first test questions evaluated (default: all)")
    p.add_argument("--runs", default="runs/compare", help="the training runs' folder (reused when found)")
    p.add_argument("--out", default="docs", help="folder of results.md and results.png")
    p.add_argument("--untrained", action="store_true", help="evaluate each method's untrained start (no training)")
    p.add_argument("--replot", default="", help="a results.md: redraw OUT/results.png from its table, nothing else")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the evaluations (timed)")
    p.add_argument(
        "--train_flags",
        nargs="*",
        default=[],
        metavar="NAME=FLAGS",
        help="extra --train flags of a method (NAME: a method or all), e.g. 'sparcrag=--sft_steps 400'",
    )
    p.add_argument(
        "--eval_flags", nargs="*", default=[], metavar="NAME=FLAGS", help="extra flags of the evaluations (NAME: a "
        "method, baselines or all), e.g. 'all=--top_k 5'",
    )  # fmt: skip
    args = p.parse_args(argv)
    for name, value in [("train_flags", v) for v in args.train_flags] + [("eval_flags", v) for v in args.eval_flags]:
        if value.partition("=")[0] not in (*METHODS, "all", "baselines") or "=" not in value:
            raise SystemExit(f"--{name} {value!r}: expected NAME=FLAGS with NAME a method, all or baselines")
    for spec in args.baselines.split(",") if args.baselines else []:
        kind, _, n = spec.partition(":")
        if kind not in BASELINES or (kind in ("none", "vanilla")) != (n == "") or (n and not n.isdigit()):
            raise SystemExit(f"--baselines: bad item {spec!r} (none, vanilla, iterative:R, parallel:N, sequential:N)")
    if not (Path(args.data_dir) / "test.jsonl").is_file():
        raise SystemExit(f"--data_dir {args.data_dir}: no test.jsonl there")
    return args


def flags_of(items, name):
    """The extra flags for `name` (a method or "baselines"): those of `all` then its own, as an argv list."""
    return [f for item in items for key, _, v in [item.partition("=")] if key in ("all", name) for f in v.split()]


# --------------------------------------------------------------------------- training (subprocesses)
def run_dir(args, method, seed):
    """Where a method's training run of a seed lives."""
    return Path(args.runs).resolve() / method / f"seed{seed}"


def checkpoint(folder):
    """The last stage's checkpoint of a run folder (ppo/, dpo/ or sft/), or None."""
    return next((folder / s for s in STAGES if runs.load_state(folder / s) is not None), None)


def train_one(args, method, seed):
    """Train one method and seed in a subprocess (reused when finished, resumed when a checkpoint exists)."""
    out = run_dir(args, method, seed)
    if (out / "results.json").is_file():
        return method, seed, "reused"
    resume = ["--resume"] if checkpoint(out) else []
    command = [sys.executable, str(ROOT / f"{method}.py"), "--train", "--seed", str(seed), "--output_dir", str(out)]
    command += ["--data_dir", str(Path(args.data_dir).resolve()), "--preset", args.preset, *resume]
    command += flags_of(args.train_flags, method)
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(out / "train.log", "a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        return method, seed, f"failed (exit {done.returncode}): see {out / 'train.log'}"
    return method, seed, "resumed" if resume else "trained"


def train_all(args):
    """Every (method, seed) run that is missing, --jobs at a time: seed by seed, the longest first. Returns how many
    runs it trained or resumed."""
    todo = [(m, s) for s in args.seeds for m in sorted(args.methods, key=lambda m: -TRAIN_MINUTES[m])]
    failed, ran = [], 0
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool, tqdm(total=len(todo), desc="training") as bar:
        for future in as_completed([pool.submit(train_one, args, m, s) for m, s in todo]):
            method, seed, how = future.result()
            bar.set_postfix_str(f"{method} seed {seed} {how}")
            bar.update()
            if how.startswith("failed"):
                failed.append(f"{method} seed {seed} {how}")
            ran += how != "reused"
    if failed:
        raise SystemExit("training failed: " + "; ".join(failed))
    return ran


# --------------------------------------------------------------------------- evaluation (in process, timed)
class CountingLLM:
    """A frozen LLM that counts its calls and the tokens of its replies (in `tokenizer`)."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer, self.calls, self.tokens = llm, tokenizer, 0, 0

    def chat(self, messages_lists, **kw):
        replies = self.llm.chat(messages_lists, **kw)
        self.calls += len(replies)
        self.tokens += sum(len(ids) for ids in self.tokenizer(list(replies), add_special_tokens=False)["input_ids"])
        return replies


def method_args(module, args, seed, model, name=None):
    """A method's Args for `--eval` (its preset filled in) on the compared data, with the model `model` (None: the
    preset's) and the --eval_flags of `name` (default: the method)."""
    argv = ["--eval", "--data_dir", args.data_dir, "--preset", args.preset, "--seed", str(seed)]
    argv += ["--model", str(model)] * (model is not None) + flags_of(args.eval_flags, name or module.__name__)
    return module.apply_preset(runs.parse_args(module.Args, argv))


def uniform(result, calls, generated, seconds, n):
    """The compared figures of one evaluation (common.metrics.summarize or sparcrag.summarize), per question."""
    groups = result["groups"]
    by_type = {k.removeprefix("type="): g["f1"] for k, g in groups.items() if "=" not in k or k.startswith("type=")}
    out = {k: result[k] for k in ("em", "f1", "acc", "retrievals")}
    return out | {"llm_calls": calls, "generated_tokens": generated, "seconds": seconds / n, "f1_by_type": by_type}


def timed(fn):
    """(result, wall seconds) of fn()."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def evaluate_method(method, args, seed, model, rows, accelerator):
    """One checkpoint (or the untrained start, model None) evaluated by its method's own code: the uniform figures."""
    m = importlib.import_module(method)
    a, device, n = method_args(m, args, seed, model), accelerator.device, len(rows)
    with accelerator.autocast():
        if method == "smartrag":  # the policy retrieves and answers: no frozen LLM
            policy, tokenizer, tag_ids = m.load_policy(a, device)
            env = m.environment(a)
            (r, _), s = timed(lambda: m.evaluate(policy, tokenizer, env, rows, a, tag_ids, greedy=True, seed=seed))
            return uniform(r, r["policy_calls"], r["generated_tokens"], s, n)
        if method in ("c3po", "sparkle"):  # the proxy's calls and tokens recorded, the frozen LLM's counted here
            policy, tokenizer = m.load_proxy(a, device)
            env = m.environment(a)
            env.llm = CountingLLM(env.llm, tokenizer)
            r, s = timed(lambda: m.evaluate(policy, tokenizer, env, rows, a, greedy=True, seed=seed))
            return uniform(r, r["llm_calls"] + r["proxy_calls"], r["generated_tokens"] + env.llm.tokens / n, s, n)
        if method == "tearag":  # the policy reasons, retrieves and answers: no frozen LLM
            system = m.RetrievalSystem(a, device)
            policy, tokenizer = m.load_policy(a, device)
            r, s = timed(lambda: m.evaluate(policy, tokenizer, system, rows, a))
            return uniform(r, r["llm_calls"], r["generated_tokens"], s, n)
        policy, tokenizer = m.load_policy(a, device)  # sparcrag: every role's calls and tokens recorded
        ctx = m.make_ctx(policy, tokenizer, *m.frozen_parts(a), a)
        r, s = timed(lambda: m.evaluate(ctx, rows, a.width, a.depth, a.early_exit))
        return uniform(r, r["llm_calls"], r["generated_tokens"], s, n)


def no_retrieval(sp, ctx, rows, seed):
    """The frozen LLM alone, with SPARC-RAG's answer prompt and an empty note."""
    runs_ = [sp.Run(r) for r in rows]
    requests = [sp.req(run, ctx["tpl"]["answer"].format(note="", query=run.row["question"])) for run in runs_]
    for run, answer in zip(runs_, sp.call_role(ctx, "answer", 1, requests, seed)):
        run.answer = answer
    return runs_


def iterative(sp, ctx, llm, rows, rounds, seed):
    """Iterative RAG with a fixed number of retrievals (IRCoT-style, ours): round 1 retrieves with the question, each
    later round with the LLM's last <think> step (one step per call, read with every document found so far); the
    LLM then answers from all the documents with SPARC-RAG's answer prompt."""
    a, runs_ = ctx["args"], [sp.Run(r) for r in rows]
    docs, thoughts, queries = [{} for _ in rows], [[] for _ in rows], [r["question"] for r in rows]
    for t in range(1, rounds + 1):
        found = sp.retrieve(ctx["retrievers"], [("dense", q) for q in queries], a.top_k)
        for run, seen, hits in zip(runs_, docs, found):
            run.cost["retrievals"] += 1
            run.retrieved.append((t, [h["id"] for h in hits]))
            seen.update({h["id"]: h for h in hits})
            run.rounds = t
        if t == rounds:
            break
        fill = lambda i: {"query": rows[i]["question"], "thoughts": " ".join(thoughts[i])}
        prompts = [THINK.format(documents=sp.format_passages(docs[i].values()), **fill(i)) for i in range(len(rows))]
        messages = [[{"role": "user", "content": p}] for p in prompts]
        steps = llm.chat(messages, temperature=0.0, max_tokens=a.max_new_tokens, stop=["</think>"], seed=seed + t)
        steps = [s if "<think>" not in s or "</think>" in s else s + " </think>" for s in steps]  # a stop cut it
        for run, n_in, n_out in zip(runs_, *ctx["count"](prompts, steps)):
            run.cost.update(llm_calls=1, tokens=n_in + n_out, generated_tokens=n_out)
        for i, step in enumerate(steps):
            thoughts[i].append(step.strip())
            query = " ".join(re.sub(r"<[^>]*>", " ", step).split())
            queries[i] = query if query and "<answer>" not in step else rows[i]["question"]
    requests = [
        sp.req(run, ctx["tpl"]["answer"].format(note=sp.format_passages(seen.values()), query=run.row["question"]))
        for run, seen in zip(runs_, docs)
    ]
    for run, answer in zip(runs_, sp.call_role(ctx, "answer", rounds, requests, seed)):
        run.answer = answer
    return runs_


CONFIDENCE_PROMPTS = {  # ours: the Sequential (Naive) baseline's self-evaluation [SPARC-RAG App. A.5], not printed
    "paper": """\
The following are given documents:
{note}
Question: {query}
Answer: {answer}
How likely is the answer to be correct? Output only a confidence score between 0 and 1. End your response with the \
literal tag [END].
Confidence:""",
    "compact": "give a confidence from 0 to 1 , end with [END] . documents : {note} question : {query} "
    "answer : {answer} confidence :",  # the toy preset's (sparcrag's header item 10)
}


def with_naive_roles(sp, ctx, policy, tokenizer, llm):
    """SPARC-RAG's ctx (sparcrag.make_ctx) with the naive baselines' roles [App. A.5]: Parallel's answers at T 0.7,
    the confidence greedy (ours); Vanilla's and Sequential's answers are the Answer Generator's (App. A.4's T)."""
    a = ctx["args"]
    role = (lambda t: sp.policy_role(policy, tokenizer, a, t)) if llm is None else (lambda t: sp.llm_role(llm, a, t))
    return ctx | {"roles": ctx["roles"] | {"parallel": role(0.7), "confidence": role(0.0)}}


def parse_confidence(sp, text):
    """The first number of a self-evaluation before [END], clipped to [0, 1], else 0 (Sequential (Naive))."""
    m = re.search(r"\d*\.?\d+", sp.strip_end(text))
    return min(max(float(m.group(0)), 0.0), 1.0) if m else 0.0


def naive(sp, ctx, rows, system, n, seed=0):
    """SPARC-RAG's naive baselines [App. A.5], a sparcrag.Run per row: Vanilla RAG, Parallel (n answers at T 0.7,
    majority vote), Sequential (retried below confidence 0.7); the Answer Generator's prompt, passages as notes (ours).
    `ctx`: with_naive_roles's."""
    tpl, played = ctx["tpl"], [sp.Run(row, rounds=1) for row in rows]
    found = sp.retrieve(ctx["retrievers"], [("dense", r["question"]) for r in rows], ctx["args"].top_k)
    passages = [sp.format_passages(hits) for hits in found]
    prompts = [tpl["answer"].format(note=p, query=row["question"]) for p, row in zip(passages, rows)]
    for run, hits in zip(played, found):
        run.cost["retrievals"] += 1
        run.retrieved.append((1, [h["id"] for h in hits]))
    if system != "sequential":
        copies, role = (n, "parallel") if system == "parallel" else (1, "answer")
        requests = [sp.req(run, p) for run, p in zip(played, prompts) for _ in range(copies)]
        answers = sp.call_role(ctx, role, 1, requests, seed, lambda text, info: sp.clean_answer(text))
        for i, run in enumerate(played):
            votes = Counter(normalize_answer(a) for a in answers[i * copies : (i + 1) * copies])
            run.answer = next(a for a in answers[i * copies :] if normalize_answer(a) == votes.most_common(1)[0][0])
        return played
    live, best = list(range(len(rows))), [(-1.0, 0, "")] * len(rows)
    confidence = CONFIDENCE_PROMPTS[ctx["args"].templates]
    for attempt in range(1, n + 1):
        answers = sp.call_role(ctx, "answer", attempt, [sp.req(played[i], prompts[i]) for i in live], seed + attempt)
        fill = lambda i, a: confidence.format(note=passages[i], query=rows[i]["question"], answer=a)
        requests = [sp.req(played[i], fill(i, a)) for i, a in zip(live, answers)]
        read = lambda text, info: parse_confidence(sp, text)
        scores = sp.call_role(ctx, "confidence", attempt, requests, seed + attempt, read)
        for i, a, c in zip(live, answers, scores):  # the first of the most confident answers
            best[i] = max(best[i], (c, -attempt, a))
            played[i].rounds, played[i].answer = attempt, best[i][2]
        live = [i for i, c in zip(live, scores) if c < 0.7]
    return played


BASELINES = {
    "none": "no retrieval (the frozen LLM alone)",
    "vanilla": "single-shot RAG (top-k once)",
    "iterative": "iterative RAG, {n} retrievals (IRCoT-style)",
    "parallel": "naive parallel scaling, {n} answers, vote",
    "sequential": "naive sequential scaling, up to {n} attempts",
}


def evaluate_baselines(args, seed, rows, accelerator):
    """Each --baselines item with SPARC-RAG's retrievers, frozen LLM, answer prompt, token counter: {name: figures}."""
    sp = importlib.import_module("sparcrag")
    a = method_args(sp, args, seed, None, "baselines")
    policy, tokenizer = sp.load_policy(a, accelerator.device)  # its tokenizer counts; the toy-lm itself is not called
    retrievers, llm = sp.frozen_parts(a)
    ctx = with_naive_roles(sp, sp.make_ctx(policy, tokenizer, retrievers, llm, a), policy, tokenizer, llm)
    out = {}
    for spec in args.baselines.split(",") if args.baselines else []:
        kind, _, n = spec.partition(":")
        if kind == "iterative" and llm is None:
            raise SystemExit("--baselines iterative needs a frozen LLM: --eval_flags 'baselines=--llm SPEC'")
        play = {
            "none": lambda: no_retrieval(sp, ctx, rows, seed),
            "iterative": lambda: iterative(sp, ctx, llm, rows, int(n), seed),
        }.get(kind, lambda: naive(sp, ctx, rows, kind, int(n or 1), seed))
        with accelerator.autocast():
            played, s = timed(play)
        r = sp.summarize([sp.run_record(run, a) for run in played], rows)
        out[BASELINES[kind].format(n=n)] = uniform(r, r["llm_calls"], r["generated_tokens"], s, len(rows))
    return out


# --------------------------------------------------------------------------- the report
NAMES = {"smartrag": "SmartRAG", "c3po": "C-3PO", "sparkle": "SPARKLE", "tearag": "TeaRAG", "sparcrag": "SPARC-RAG"}
TYPES = ("one_hop", "two_hop", "three_hop", "comparison", "yes_no")


def trained_on(state):
    """The question types a checkpoint trained on, from its saved arguments ("all" when unfiltered)."""
    saved = (state or {}).get("args") or {}
    types = {t for k in ("question_types", "sft_types", "dpo_types") for t in (saved.get(k) or "").split(",") if t}
    return ", ".join(sorted(types)) or "all"


def stats(values):
    """(mean, spread = max - min, min, max) of a list of numbers."""
    return sum(values) / len(values), max(values) - min(values), min(values), max(values)


def table(results):
    """The main table as markdown: mean ± spread over the seeds of every column."""
    lines = ["| system | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for system, by_seed in results.items():
        cells = []
        for key, _, digits in COLUMNS:
            mean, spread, *_ = stats([f[key] for f in by_seed.values()])
            cells.append(f"{mean:.{digits}f} ± {spread:.{digits}f}" if len(by_seed) > 1 else f"{mean:.{digits}f}")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def type_table(results, trained):
    """F1 by question type (mean over the seeds) and what each system trained on."""
    lines = ["| system | trained on | " + " | ".join(TYPES) + " |", "|---" * (len(TYPES) + 2) + "|"]
    for system, by_seed in results.items():
        f1 = [stats([f["f1_by_type"].get(t, float("nan")) for f in by_seed.values()])[0] for t in TYPES]
        lines.append(f"| {system} | {trained.get(system, '-')} | " + " | ".join(f"{v:.3f}" for v in f1) + " |")
    return "\n".join(lines)


# the learning curves: each method's headline metric and headline cost on the validation subset (runs.curve_point)
CURVE_COST = {"smartrag": "retrievals", "c3po": "llm_calls", "sparkle": "generated_tokens",
              "tearag": "generated_tokens", "sparcrag": "tokens"}  # fmt: skip
CURVE_X = {"smartrag": "PPO iterations", "c3po": "PPO updates", "sparkle": "PPO updates", "tearag": "IP-DPO rounds",
           "sparcrag": "DPO steps (one offline stage)"}  # fmt: skip


def curve(folder):
    """A run's learning-curve points [(update, val figures, budget)] from its metrics.jsonl, by update (a resumed run
    logs a point again: the last one counts)."""
    path, points = Path(folder) / "metrics.jsonl", {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("stage") == "val":
            points[record["update"]] = (record["update"], record["val"], record.get("budget", {}))
    return [points[u] for u in sorted(points)]


def budget(folder):
    """A training run's budget (results.json): SFT and RL/DPO updates, tokens generated in training, CPU and wall
    seconds."""
    record = json.loads((Path(folder) / "results.json").read_text())
    steps, spent = record.get("train_steps") or {}, record.get("budget") or {}  # no budget: a run from before it
    warm = ("sft", "curriculum")  # SFT steps, TeaRAG's toy curriculum before its SFT on the whole mix included
    sft, rl = sum(steps.get(k, 0) for k in warm), sum(v for k, v in steps.items() if k not in warm)
    return {"sft": sft, "rl": rl, "tokens": spent.get("generated_tokens"), "cpu_s": spent.get("cpu_s"),
            "wall_s": record.get("wall_s", 0.0)}  # fmt: skip


def budget_table(budgets):
    """The training budget of each method: mean ± spread over the seeds."""
    head = "| method | SFT steps | RL / DPO updates | tokens generated in training | CPU s | wall s |"
    lines = [head, "|---|---|---|---|---|---|"]
    for method, by_seed in budgets.items():
        cells = []
        for key in ("sft", "rl", "tokens", "cpu_s", "wall_s"):
            if None in (values := [b[key] for b in by_seed.values()]):
                cells.append("-")
                continue
            mean, spread, *_ = stats(values)
            cells.append(f"{mean:,.0f} ± {spread:,.0f}" if len(by_seed) > 1 else f"{mean:,.0f}")
        lines.append(f"| {NAMES[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(curves):
    """Each method's curve as text: F1 and its headline cost at every point, mean [min, max] over the seeds."""
    lines = ["| method | update | F1 mean [min, max] | cost | cost mean [min, max] |", "|---|---|---|---|---|"]
    for method, by_seed in curves.items():
        for update, f1, cost in curve_stats(method, by_seed):
            digits = lambda s: 1 if s[0] >= 10 else 3  # tokens: one decimal
            cell = lambda s: f"{s[0]:.{digits(s)}f} [{s[2]:.{digits(s)}f}, {s[3]:.{digits(s)}f}]"
            lines.append(f"| {NAMES[method]} | {update} | {cell(f1)} | {CURVE_COST[method]} | {cell(cost)} |")
    return "\n".join(lines)


def curve_stats(method, by_seed):
    """[(update, F1 stats, cost stats)] at each point of the seeds' curves: by position when every seed logged the
    same number of points (SPARC-RAG's end falls at a seed's own DPO step count: x is their mean), else at the
    updates every seed holds."""
    curves = list(by_seed.values())
    if curves and len({len(c) for c in curves}) == 1:
        columns = list(zip(*curves))
    else:
        common = sorted(set.intersection(*[{u for u, _, _ in c} for c in curves])) if curves else []
        columns = [[next(p for p in c if p[0] == u) for c in curves] for u in common]
    figures = lambda points, key: stats([v[key] for _, v, _ in points])
    return [
        (round(sum(u for u, _, _ in points) / len(points)), figures(points, "f1"), figures(points, CURVE_COST[method]))
        for points in columns
    ]


def plot_curves(curves, path, single=None):
    """docs/curves.png: a panel per method, F1 (left axis) and the headline cost (right axis, dashed) on the
    validation subset against training updates, the mean and min-max band over the seeds, x = 0 the SFT start;
    `single`: a method, drawn alone (docs/curves/<method>.png)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no curves: matplotlib is missing (pip install -e ".[plot]" or pip install matplotlib)')
        return None
    methods = [single] if single else [m for m in curves if curves[m]]
    fig, axes = plt.subplots(1, len(methods), figsize=(3.4 * len(methods) + 0.6, 3.2), squeeze=False)
    for ax, method in zip(axes[0], methods):
        points = curve_stats(method, curves[method])
        x = [u for u, _, _ in points]
        cost_ax = ax.twinx()
        for axis, k, style, color, label in ((ax, 1, "-", "C0", "F1"), (cost_ax, 2, "--", "C3", CURVE_COST[method])):
            axis.plot(x, [p[k][0] for p in points], style, color=color, marker="o", markersize=3, label=label)
            axis.fill_between(x, [p[k][2] for p in points], [p[k][3] for p in points], color=color, alpha=0.2)
            axis.tick_params(axis="y", colors=color)
        ax.set_ylim(0, 1)
        ax.axvline(0, color="grey", linewidth=0.8, linestyle=":")
        ax.annotate("SFT start", (0, 1), xycoords=("data", "axes fraction"), fontsize=7, va="top", ha="left")
        ax.set_title(NAMES[method], fontsize=10)
        ax.set_xlabel(CURVE_X[method], fontsize=8)
        ax.set_ylabel("F1 (validation)", color="C0", fontsize=8)
        cost_ax.set_ylabel(CURVE_COST[method].replace("_", " ") + " / question", color="C3", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# each paper's headline claims (the paper's words, in short), what a toy run tests them with ("ours") and the metric
# (+ the cost it claims to cut); "after vs SFT start": the run's own test evaluations before and after its RL or DPO
CLAIMS = {
    "smartrag": dict(claim="PPO on the whole pipeline beats its own SFT warm-up", where="§4.4, Tab. 4",
                     paper="PopQA F1 45.95 vs 43.87", baseline="the SFT policy", ours="after vs SFT start",
                     metric="f1"),
    "smartrag_2": dict(claim="beats RAG that retrieves once with the question", where="Tab. 1",
                       paper="avg F1 41.25 vs 37.18", baseline="single-shot RAG", ours="vs single-shot RAG",
                       metric="f1"),
    "c3po": dict(claim="tree-rollout RL improves the proxy over its warm-up", where="§6.4", paper="acc +1.6 to +4.5",
                 baseline="the SFT proxy", ours="after vs SFT start", metric="accuracy"),  # the judge's
    "c3po_2": dict(claim="a small RL proxy with a frozen LLM beats standard RAG", where="Tab. 1",
                   paper="avg acc 62.08 vs 51.35", baseline="single-shot RAG", ours="vs single-shot RAG",
                   metric="acc"),
    "sparkle": dict(claim="RL training of the proxy matters", where="Tab. 4", paper="avg -4.63 without RL",
                    baseline="the proxy before RL (ours: after SFT)", ours="after vs SFT start", metric="f1"),
    "sparkle_2": dict(claim="beats the strongest iterative RAG baseline", where="Tab. 1", paper="avg 56.04 vs 52.24",
                      baseline="iterative RAG", ours="vs iterative RAG", metric="f1"),
    "tearag": dict(claim="IP-DPO raises EM over the SFT model with fewer thinking tokens", where="Tab. 6, §5.3.2",
                   paper="avg EM 45.12 vs 32.56", baseline="the SFT model", ours="after vs SFT start",
                   metric="em+generated_tokens"),
    "tearag_2": dict(claim="beats an iterative search agent's EM with ~61% fewer tokens", where="Tab. 6, Fig. 7",
                     paper="EM 45.12 vs 43.37, 884 vs 2,281 tokens", baseline="iterative RAG",
                     ours="vs iterative RAG", metric="em+generated_tokens"),
    "sparcrag": dict(claim="DPO tuning gains F1 over the untuned system at lower token cost", where="App. C.1, Tab. 3",
                     paper="HotpotQA F1 61.3 vs 55.9, 6.5K vs 20.2K tokens", baseline="untuned SPARC-RAG",
                     ours="after vs SFT start", metric="f1+tokens"),
    "sparcrag_2": dict(claim="depth-width scaling beats naive parallel scaling", where="Tab. 1",
                       paper="HotpotQA F1 55.9 vs 42.4", baseline="naive parallel scaling",
                       ours="vs naive parallel scaling", metric="f1"),
}  # fmt: skip


def verdict(diffs, lower=False):
    """ "yes" when every seed's difference has the claimed sign, "mean only" when the mean has it, else "no"."""
    sign = [-d if lower else d for d in diffs]
    return "yes" if min(sign) > 0 else "mean only" if sum(sign) / len(sign) > 1e-9 else "no"  # 1e-9: rounding


def claim_diffs(args, method, claim, results):
    """Per seed: (metric difference, cost difference or None) of the trained method against what it claims to beat."""
    metric, _, cost = claim["metric"].partition("+")
    if claim["ours"] == "after vs SFT start":
        runs_ = [json.loads((run_dir(args, method, s) / "results.json").read_text()) for s in args.seeds]
        diff = lambda key: [r["after"][key] - r["before"][key] for r in runs_]
    else:
        bases = [v for k, v in results.items() if k.startswith(claim["ours"][3:])]
        if not bases:
            return None, None
        base = max(bases, key=lambda v: stats([v[s][metric] for s in args.seeds])[0])  # the strongest of them
        mine = next(v for k, v in results.items() if k.startswith(NAMES[method] + " ("))
        diff = lambda key: [mine[s][key] - base[s][key] for s in args.seeds]
    return diff(metric), diff(cost) if cost else None


def claims_table(args, results):
    """Each paper's headline claim (CLAIMS) beside our figure with its seed spread, and whether it reproduces."""
    lines = ["| paper | claim | the paper's figure | against | ours: Δ mean [min, max] | reproduced |"]
    lines.append("|---|---|---|---|---|---|")
    for key, claim in CLAIMS.items():
        method = key.split("_")[0]
        if method not in args.methods:
            continue
        metric, cost = claim_diffs(args, method, claim, results)
        if metric is None:  # a baseline not run (--baselines)
            continue
        name = claim["metric"].split("+")
        cell = lambda d, n: f"{n} {stats(d)[0]:+.3f} [{stats(d)[2]:+.3f}, {stats(d)[3]:+.3f}]"
        ours, answer = cell(metric, name[0]), f"{name[0]}: {verdict(metric)}"
        if cost is not None:
            ours, answer = f"{ours}; {cell(cost, name[1])}", f"{answer}; {name[1]}: {verdict(cost, lower=True)}"
        text = f"{claim['claim']} [{claim['where']}]"
        lines.append(f"| {NAMES[method]} | {text} | {claim['paper']} | {claim['baseline']} | {ours} | {answer} |")
    return "\n".join(lines)


def report(args, results, trained, meta, budgets=None, curves=None, claims=""):
    """docs/results.md."""
    seeds = ", ".join(map(str, args.seeds))
    spread = "mean ± spread (max − min) over the seeds" if len(args.seeds) > 1 else "one seed"
    trainings = (
        "Every method is its untrained start (its preset's model)"
        if args.untrained
        else f"Every method is its own file's `--train` run with the `--preset {args.preset}` defaults (checkpoints "
        f"in `{args.runs}/<method>/seed<S>`), trained on the same pool, the training split's questions of every type"
    )
    trained_part, drawn = "", curves and any(curves.values())
    picture = "\n![F1 and the headline cost on the validation subset during training](curves.png)\n" if drawn else ""
    if budgets:
        trained_part = f"""
## Each paper's headline claim on the toy world

Each claim as the paper states it, the figure the paper reports, and ours: the difference (trained method minus the
system it claims to beat) per seed, its mean and [min, max] over the seeds. "yes": the difference has the paper's sign
on every seed; "mean only": in the mean, not on every seed; "no": not in the mean. Start-vs-trained rows use each
run's own test evaluations (results.json `before`, `after`); rows against a baseline use the table above.

{claims}

## Training budget

Per run, {spread}: the SFT warm-up's optimizer steps; the RL or preference stage's updates as each method counts them
(SmartRAG, C-3PO, SPARKLE: PPO iterations, each several optimizer steps; TeaRAG, SPARC-RAG: DPO optimizer steps);
the tokens the trained model generated in training (rollouts, sampled paths, pair collection; evaluations and a frozen
LLM's replies excluded: `runs.TrainingTokens`); its main process's CPU seconds (loading and its own evaluations
included; a resumed run's go on from its last checkpoint's) and its wall seconds (beside --jobs {args.jobs} trainings
on this machine).

{budget_table(budgets)}

## Learning curves
{picture}
Every method evaluates greedily on the same fixed validation subset (the first {runs.N_VAL} questions of the data's
dev split, every type) at fixed points of its RL or preference stage (`runs.curve_point`: x = 0 is the SFT model, then
every `eval_every` PPO updates, each IP-DPO round, SPARC-RAG's one offline DPO stage at its end, x its seeds' mean
step count); the line is the mean over the seeds, the band their min-max. The same points as numbers:

{curve_table(curves)}
"""
    return f"""# Results: the five methods and the baselines on one split

Written by `{meta["command"]}` ({meta["date"]}, {meta["machine"]}, torch {meta["torch"]}; the whole command took
{meta["wall"]}; trainings `--jobs {args.jobs}` at a time, one core each, each run's wall time in the budget table;
{args.threads} torch thread(s) for the timed evaluations, load average {meta["load"]} as they began and ended).
Data: `{args.data_dir}`, the first {meta["n"]} questions of its test split for every system; training seeds
{seeds}; {spread}. {trainings}, evaluated greedily by its own `evaluate`; the baselines need no training.

{table(results)}

F1 by question type (mean over the seeds), and the question types each method trained on:

{type_table(results, trained)}

![F1 against generated tokens and LLM calls per question](results.png)
{trained_part}
## The columns

- EM, F1, acc: FlashRAG's exact match, token F1 and sub-exact match (`common.metrics`), per question.
- retrievals: search calls per question (TeaRAG: one hybrid chunk + graph search per step; SPARC-RAG: one per
  branch, two branches a round).
- LLM calls: prompts sent to any language model per question, the trained model's (policy or proxy) and the frozen
  LLM's (the toy reader in the toy world; SmartRAG and TeaRAG train the model that answers and call no other).
- generated tokens: tokens written by either per question, counted in the trained model's tokenizer (the baselines:
  SPARC-RAG's).
- s / question: wall time of the batched evaluation (all questions advance together) over the question count;
  model loading and index building excluded. Rerun the command to re-measure: finished trainings are reused.
- The baselines (`bench/compare.py --baselines`): SPARC-RAG's dense retriever, top-k, answer prompt and frozen LLM;
  the toy reader ignores sampling, so naive parallel scaling draws the same answer N times.
"""


def table_results(path):
    """The main table of a results.md as results: two seeds per system at mean -/+ spread / 2, each column's min and
    max for a two-seed table (with more seeds, the bars span the spread around the mean)."""
    results = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(COLUMNS) + 1 and re.fullmatch(r"[\d.]+( ± [\d.]+)?", cells[1]):
            figures = [[float(x) for x in c.split(" ± ")] + [0.0] for c in cells[1:]]
            results[cells[0]] = {
                seed: {key: mean + sign * spread / 2 for (key, _, _), (mean, spread, *_) in zip(COLUMNS, figures)}
                for seed, sign in ((0, -1), (1, 1))
            }
    if not results:
        raise SystemExit(f"--replot {path}: no table of {len(COLUMNS)} figures per system found")
    return results


def bars(figures):
    """An error bar from stats(): [[mean - min], [max - mean]], never below 0 (equal values' mean can round off)."""
    return [[max(figures[0] - figures[2], 0.0)], [max(figures[3] - figures[0], 0.0)]]


def plot(results, methods, path):
    """results.png: F1 against generated tokens and against LLM calls per question, min-max bars over the seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no picture: matplotlib is missing (pip install -e ".[plot]" or pip install matplotlib)')
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    markers = "os^DvP*Xh<>p"
    for i, (system, by_seed) in enumerate(results.items()):
        is_method = system in methods
        y = stats([f["f1"] for f in by_seed.values()])
        for ax, key in zip(axes, ("generated_tokens", "llm_calls")):
            x = stats([f[key] for f in by_seed.values()])
            ax.errorbar(
                x[0], y[0], xerr=bars(x), yerr=bars(y),
                marker=markers[i % len(markers)], markersize=7, capsize=2, linestyle="none",
                markerfacecolor=None if is_method else "white", label=system,
            )  # fmt: skip
    for ax, label in zip(axes, ("generated tokens per question", "LLM calls per question")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("F1")
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None):
    """Train what is missing, evaluate everything, write the report."""
    import platform

    import torch

    args, begin = parse_args(argv), time.time()
    if args.replot:  # the picture of a table edited by hand: methods are the systems named after one
        results = table_results(args.replot)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        methods = [s for s in results if s.split(" (")[0] in NAMES.values()]
        if picture := plot(results, methods, Path(args.out) / "results.png"):
            print(f"wrote {picture} from {args.replot}")
        return None
    torch.set_num_threads(args.threads)
    rows = load_split(args.data_dir, "test")[: args.n_eval]
    n_trained = 0 if args.untrained else train_all(args)
    accelerator, load = runs.make_accelerator(), [os.getloadavg()[0]]
    results, trained, names = {}, {}, {}
    jobs = [(m, s) for m in args.methods for s in args.seeds] + [("baselines", s) for s in args.seeds]
    for name, seed in tqdm(jobs, desc="evaluation"):
        if name == "baselines":
            for system, figures in evaluate_baselines(args, seed, rows, accelerator).items():
                results.setdefault(system, {})[seed] = figures
            continue
        model = None if args.untrained else checkpoint(run_dir(args, name, seed))
        if model is None and not args.untrained:
            raise SystemExit(f"{run_dir(args, name, seed)}: no checkpoint (its train.log says why)")
        system = f"{NAMES[name]} ({model.name if model else 'untrained'})"
        names[system], trained[system] = name, trained_on(runs.load_state(model) if model else None)
        results.setdefault(system, {})[seed] = evaluate_method(name, args, seed, model, rows, accelerator) | {
            "checkpoint": str(model)
        }
    load.append(os.getloadavg()[0])
    order = [s for s in results if s in names] + [s for s in results if s not in names]
    results = {s: results[s] for s in order}
    budgets, curves, claims = None, None, ""
    if not args.untrained:  # the training budgets, learning curves and claims of the runs
        budgets = {m: {s: budget(run_dir(args, m, s)) for s in args.seeds} for m in args.methods}
        curves = {m: {s: c for s in args.seeds if (c := curve(run_dir(args, m, s)))} for m in args.methods}
        claims = claims_table(args, results)
    command = "python bench/compare.py" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    meta = {"command": command, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "n": len(rows)}
    minutes = (time.time() - begin) / 60
    meta["wall"] = f"{minutes:.0f} minutes" if minutes >= 2 else f"{minutes * 60:.0f} s"
    total = 0 if args.untrained else len(args.methods) * len(args.seeds)
    meta["wall"] += f" (it trained {n_trained} of the {total} runs and reused the others)" if total else ""
    meta["load"] = " and ".join(f"{x:.1f}" for x in load)  # the 1-minute load average as the evaluations began, ended
    meta["machine"] = (
        f"{platform.machine()} CPU, {os.cpu_count()} cores"
        if not torch.cuda.is_available()
        else (torch.cuda.get_device_name())
    )
    out, runs_dir = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / "compare.json").write_text(json.dumps({"meta": meta, "trained_on": trained, "results": results}))
    (out / "results.md").write_text(report(args, results, trained, meta, budgets, curves, claims))
    pictures = [plot(results, names, out / "results.png")]
    if curves and any(curves.values()):  # the curves, and each method's panel for its docs page
        (out / "curves").mkdir(exist_ok=True)
        pictures.append(plot_curves(curves, out / "curves.png"))
        pictures += [plot_curves(curves, out / "curves" / f"{m}.png", single=m) for m in curves if curves[m]]
    print(table(results))
    wrote = ", ".join(str(p) for p in pictures if p)
    print(f"wrote {out / 'results.md'}" + (f", {wrote}" if wrote else "") + f" and {runs_dir / 'compare.json'}")


if __name__ == "__main__":
    runs.run_main(main)
