"""SPARC-RAG's toy world (sparcrag.py reaches it through the toy preset's values and the adapters below): the oracle
warm-up teacher and its SFT (the untuned start a tiny toy-lm lacks), the compact templates and single-token format
tags, the entity renaming of SFT examples and DPO pairs, and one LoRA adapter per trained role. sparcrag.py's header
lists these as its toy-world adaptations (8-13)."""

import random
import re
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import AddedToken

from common import runs
from common.data import require_metadata
from common.metrics import exact_match
from common.toy.world import rename_entities, world_or_none

# the toy preset's templates: the paper set's fields, tags and output formats without the prose (header item 10)
COMPACT_TEMPLATES = {
    "update": "keep what answers the query , end with [END] . original query : {query} old note : {note} "
    "new information : {new_context} updated note :",
    "answer": "answer the question based on the notes , end with [END] . notes : {note} question : {query} answer :",
    "rewrite": "write {N} queries , each with a strategy bm25 or dense , end with [END] . original query : "
    "{query} current query : {current_query} context : {context} output :",
    "select": "question : {question} answers : {answer_blocks} select the best answer in <answer> </answer> , "
    "end with [END] . final answer :",
    "merge": "combine the notes into a single note for {question} , end with [END] . notes : {reasoning_list} "
    "your response :",
    "evaluate": "decide stop or continue , end with [END] . original query : {query} current query : "
    "{current_query} note : {note} answer : {answer} decision :",
}
# the output formats' tags as single tokens of a model trained from scratch (header item 10)
FORMAT_TOKENS = ["<queries>", "</queries>", "</item>", "<strategy>", "</strategy>", "<query>", "</query>", "[END]"]
FORMAT_TOKENS += ["<decision>", "</decision>", "<think>", "</think>"] + [f'<item rank="{i}">' for i in range(1, 9)]
TEACHER_READS = ("type", "entities", "sub_queries", "sub_answers")  # the question metadata the teacher reads
SFT_SHARES = {"rewrite": 0.75, "evaluate": 0.25}  # each warm-up batch: both trained roles, in these shares
STOP, CONTINUE = "STOP", "CONTINUE"


# ---------------------------------------------------------------- the oracle teacher and its warm-up (header item 8)
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


def teacher_role(role, args, seed, render):
    """The warm-up teacher as a trained role's backbone (a role of sparcrag.make_ctx) in its templates' format (the
    paper's: <think> before rewrites, a reason before a decision): the oracle's rewrites (`render`: the method's
    rewrite format), or STOP at the rates args.teacher_accept_correct / _wrong on EM (the toy truth)."""
    rng, paper = random.Random(seed), args.templates == "paper"

    def rewrite(r):
        items = oracle_sparcrag(r["run"].row, r["run"].note, r["info"]["width"], rng, args.teacher_duplicate)
        strategies = " , ".join(f"{k} {s}" for k, (s, _) in enumerate(items, 1))
        think = f"<think> i need to know : {' ; '.join(q for _, q in items)} . strategy : {strategies} . </think>\n"
        return think * paper + render(items)

    def decide(r):
        right = exact_match(r["info"]["answer"], r["run"].row["golden_answers"])
        stop = rng.random() < (args.teacher_accept_correct if right else args.teacher_accept_wrong)
        why = ("the note states the answer . " if stop else "i need more information . ") * paper
        return f"{why}<decision>{STOP if stop else CONTINUE}</decision> [END]"

    return lambda requests, seed=0: [(rewrite if role == "rewrite" else decide)(r) for r in requests]


def teacher_roles(args, render):
    """The teacher of each trained role (rewrite, evaluate), each with its own draws (seed, seed + 1)."""
    return {role: teacher_role(role, args, args.seed + i, render) for i, role in enumerate(SFT_SHARES)}


def warm_up(m, accelerator, args, out, rows, test_rows, parts, world, results):
    """The untuned start a tiny toy-lm lacks (header item 8): the raw model's evaluation (results["before_sft"]), the
    teacher's fixed-depth runs, the rows dealt over the warm-up widths, SFT on the trained roles' calls in them, saved
    to sft/; sft_steps 0 (the paper), none; resumed, sft/ loaded. The model, its tokenizer and the SFT steps. `m`: the
    sparcrag module (its rollout, evaluation, encoding); `parts`: its frozen parts, (retrievers, llm)."""
    state = runs.load_state(out / "sft") if args.sft_steps else None
    policy, tokenizer = m.load_policy(args, accelerator.device, str(out / "sft") if state else None)
    if not args.sft_steps or state:
        results["before_sft"] = state and state["before_sft"]
        return policy, tokenizer, state["steps"] if state else 0
    require_metadata(rows, TEACHER_READS, Path(args.data_dir) / "train.jsonl", "the toy teacher (--sft_steps >= 1)")
    examples, widths, saved = [], [int(w) for w in args.warmup_widths.split(",")], out / "predictions_raw.jsonl"
    with accelerator.autocast():
        ctx = m.make_ctx(policy, tokenizer, *parts, args)
        results["before_sft"] = m.evaluate(ctx, test_rows, args.width, args.untuned_depth, False, saved)
        accelerator.print(f"raw start (fixed depth {args.untuned_depth}) | {m.brief(results['before_sft'])}")
        ctx = m.make_ctx(policy, tokenizer, *parts, args, teacher_roles(args, m.format_rewrites))
        for i, width in enumerate(widths):
            for run in m.sparc_rag(rows[i :: len(widths)], ctx, width, args.untuned_depth, early_exit=False):
                examples += [
                    {k: e[k] for k in ("role", "prompt", "output")} for e in run.trace if e["role"] in SFT_SHARES
                ]
    accelerator.print(f"warm-up: {len(examples)} teacher examples from {len(rows)} questions")
    policy = sft(accelerator, policy, tokenizer, examples, args, world, out, m.batch_tensors)
    if accelerator.is_main_process:
        state = m.saved_state(args, before_sft=results["before_sft"], steps=args.sft_steps)
        runs.save_checkpoint(out / "sft", policy, tokenizer, state)
    accelerator.wait_for_everyone()
    return policy, tokenizer, args.sft_steps


def sft(accelerator, model, tokenizer, examples, args, world, out, batch_tensors):
    """The warm-up SFT on the teacher's (role, prompt, output) examples: cross-entropy on the output, [END] and EOS
    (runs.sft_step; `batch_tensors`: sparcrag.batch_tensors), AdamW, warm-up, linear decay; toy renaming."""
    rng, warm, every = random.Random(args.seed), max(1, args.sft_steps // 20), max(1, args.sft_steps // 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = lambda s: min((s + 1) / warm, 1 - 0.9 * s / args.sft_steps)  # warm-up, then linear decay to 0.1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    pools = [[e for e in examples if e["role"] == role] for role in SFT_SHARES]  # each batch: both roles, in shares
    shares = [round(args.sft_batch_size * share) for share in SFT_SHARES.values()]
    for step in range(args.sft_steps):
        batch = [e for pool, n in zip(pools, shares) for e in rng.sample(pool, min(n, len(pool)))]
        # renamed whole on every process: the same draws
        texts = [renamed([e["prompt"], e["output"]], world, rng, args.augment_p) for e in batch]
        own, weight = runs.own_share(texts, accelerator)  # the batch split over the processes
        ids, mask, attention = batch_tensors(tokenizer, own, accelerator.device)
        labels = ids.masked_fill(mask == 0, -100)  # (B, T): the loss on the output, [END] and EOS only
        loss = runs.sft_step(accelerator, model, optimizer, scheduler, ids, labels, attention, len(ids), weight=weight)
        if step % every == 0 or step + 1 == args.sft_steps:  # sft/loss: the first, every tenth, the last
            runs.log_update(accelerator, out, {"sft/loss": loss, "sft/step": step + 1}, step + 1)
    return accelerator.unwrap_model(model)


# ---------------------------------------------------------------- renaming (header item 9)
def renaming_world(args):
    """The toy world that renames SFT examples and DPO pairs (augment_p), or None (real data)."""
    return world_or_none(args.world) if args.world and args.augment_p else None


def renamed(texts, world, rng, p):
    """The texts entity-renamed as one with probability p in the toy world, else as they are (no world: no draw)."""
    return rename_entities(texts, world, rng, popular="keep") if world and rng.random() < p else texts


# ---------------------------------------------------------------- format tokens (header item 10)
def add_format_tokens(model, tokenizer):
    """The formats' tags as single tokens of the tokenizer (a toy-lm has no `item`), the embeddings resized."""
    if new := [t for t in FORMAT_TOKENS if t not in tokenizer.get_vocab()]:
        tokenizer.add_tokens([AddedToken(w, single_word=w.isalpha(), normalized=False) for w in new])
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)


# ---------------------------------------------------------------- one LoRA adapter per trained role (header item 13)
def load_role_adapters(model, folder):
    """A checkpoint's second adapter (folder/evaluate: the evaluator's), loaded beside its "default" one."""
    if (second := Path(folder) / "evaluate").is_dir():
        model.load_adapter(str(second), adapter_name="evaluate", is_trainable=True)


def use_role_adapter(model, adapter):
    """A model with per-role adapters serves a role with its own adapter, the other roles with "default"."""
    if len(names := getattr(model, "peft_config", {})) > 1:
        model.set_adapter(adapter if adapter in names else "default")


def add_role_adapter(model, adapter):
    """A second adapter, the "default" one's configuration, made the one that trains."""
    model.add_adapter(adapter, replace(model.peft_config["default"]))
    model.set_adapter(adapter)


def tune_per_role(dpo_train, accelerator, model, tokenizer, pairs, args, world, out):
    """sparcrag.dpo_train once per trained role on its own pairs: the rewriter's adapter ("default") for
    args.dpo_epochs, then the evaluator's ("evaluate") for args.evaluator_epochs; the tuned model and all DPO steps."""
    done = 0
    for role, epochs in zip(("rewrite", "evaluate"), (args.dpo_epochs, args.evaluator_epochs)):
        mine, name = [p for p in pairs if p["role"] == role], {"rewrite": "default"}.get(role, role)
        model, done = dpo_train(accelerator, model, tokenizer, mine, args, world, out, name, done, epochs)
    return model, done
