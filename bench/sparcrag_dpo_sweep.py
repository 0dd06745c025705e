"""The DPO stage of SPARC-RAG alone, from a saved warm-up (sft/), scored on a validation set (docs/log.md).

    python bench/sparcrag_dpo_sweep.py --sft runs/toy/sft --cache /tmp/pairs_s0.pt --seed 0             # preset
    python bench/sparcrag_dpo_sweep.py --sft runs/toy/sft --cache /tmp/pairs_s0.pt --seed 0 --dpo_lr 1e-4 --lam 4
    python bench/sparcrag_dpo_sweep.py --sft runs/toy/sft --cache /tmp/pairs_s0.pt --seed 0 --pairs evaluate
    python bench/sparcrag_dpo_sweep.py --sft runs/toy/sft --cache /tmp/pairs_s0.pt --seed 0 --beta 0.2
    python bench/sparcrag_dpo_sweep.py --sft runs/toy/sft --cache /tmp/pairs_s0.pt --seed 0 --rewrite_repeat 2

The untuned system's runs on the --n_train training questions and their preference pairs are built once and cached
(--cache; the same seed gives the same pairs as `sparcrag.py --train`); each call then trains one weighted DPO run
with the given flags (any sparcrag.py flag: --dpo_lr, --beta, --lam ...; --lam re-weights the cached pairs;
--rewrite_repeat puts each rewriter pair that many times into the mix) and scores the tuned system (adaptive, cap
--depth) and the tuned model at fixed depth (its rewriter alone) against the untuned system (fixed depth). The
validation set: the dev split plus the training rows outside the --n_train sample (seen by neither the warm-up nor
DPO), so the test split stays untouched.
"""

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import set_seed

import sparcrag
from common import runs
from common.data import load_split, sample_rows
from common.toy import world_or_none


@dataclass
class Sweep:
    sft: str = field(default="runs/sparcrag/sft", metadata={"help": "the warmed-up model (a --train run's sft/)"})
    cache: str = field(default="", metadata={"help": "file of the cached pairs and untuned scores (built if absent)"})
    pairs: str = field(default="all", metadata={"help": "all, rewrite or evaluate: the pairs trained on"})
    rewrite_repeat: int = field(default=1, metadata={"help": "copies of each rewriter pair in the mix"})


def main(argv=None):
    sweep, args = runs.flag_parser((Sweep, sparcrag.Args)).parse_args_into_dataclasses(args=argv)
    lam, args.train = args.lam, True
    args = sparcrag.apply_preset(args)
    out = Path(args.output_dir or "/tmp/sparcrag_dpo_sweep")
    out.mkdir(parents=True, exist_ok=True)
    accelerator, start = runs.make_accelerator("none", out), time.time()
    set_seed(args.seed)
    train = load_split(args.data_dir, "train")
    used = {r["id"] for r in sample_rows(train, args.n_train, args.seed)}
    valid = (load_split(args.data_dir, "dev") + [r for r in train if r["id"] not in used])[: args.n_eval]
    retrievers, llm = sparcrag.frozen_parts(args)
    policy, tokenizer = sparcrag.load_policy(args, accelerator.device, sweep.sft)
    policy.name_or_path = sweep.sft
    ctx = sparcrag.make_ctx(policy, tokenizer, retrievers, llm, args)
    if sweep.cache and Path(sweep.cache).exists():
        cached = torch.load(sweep.cache, weights_only=True)  # plain lists, dicts, strings and numbers
    else:
        rows = sample_rows(train, args.n_train, args.seed)
        own = sparcrag.sparc_rag(rows, ctx, args.width, args.untuned_depth, early_exit=False, seed=args.seed)
        pairs = sparcrag.build_pairs(own, ctx, sparcrag.sampler(policy, tokenizer, args), args)
        untuned = sparcrag.evaluate(ctx, valid, args.width, args.untuned_depth, False)
        cached = {"pairs": pairs, "untuned": untuned}
        if sweep.cache:
            torch.save(cached, sweep.cache)
    print(f"validation rows {len(valid)} | untuned (fixed) | {sparcrag.brief(cached['untuned'])}", flush=True)
    pairs = [p for p in cached["pairs"] if sweep.pairs in ("all", p["role"])]
    pairs = [p for p in pairs for _ in range(sweep.rewrite_repeat if p["role"] == "rewrite" else 1)]
    if lam is not None:  # re-weight the continue-over-a-wrong-stop pairs
        pairs = [p | {"weight": lam} if p["weight"] > 1 else p for p in pairs]
    policy, steps = sparcrag.tune(accelerator, policy, tokenizer, pairs, args, world_or_none(args.data_dir), out)
    ctx = sparcrag.make_ctx(policy, tokenizer, retrievers, llm, args)
    tuned = sparcrag.evaluate(ctx, valid, args.width, args.depth, True, predictions=out / "predictions_tuned.jsonl")
    fixed = sparcrag.evaluate(ctx, valid, args.width, args.untuned_depth, False)
    print(f"{len(pairs)} pairs, {steps} DPO steps, {time.time() - start:.0f} s", flush=True)
    print(f"tuned (adaptive) | {sparcrag.brief(tuned)}", flush=True)
    print(f"tuned (fixed)    | {sparcrag.brief(fixed)}", flush=True)


if __name__ == "__main__":
    runs.run_main(main)
