"""The paper path rehearsed on the toy world: what only the paper preset's values, several processes or a real model's
output reach, which no toy-preset run shows.

- Oracle agents writing in the paper's output format (`<think>` blocks, step headers, tags) score under `--preset
  paper` (its top-k, caps, widths, depths and lengths) within 0.02 of the same oracle under the toy preset, on the
  same questions: a cap that keeps the wrong documents, a parser that misses the paper's format or a cut that loses
  the answer fails it.
- Every SFT, PPO and DPO stage gives under two processes, on counts that leave a short last batch, the loss and the
  gradient of one process (tests/rehearsal_stages.py, launched once with each).
- Every loss is the same for micro-batch 1 and the whole batch (gradients compared).
- `--preset paper --dry_run` prints every paper value, pinned here to the paper's tables.

    python -m pytest -q tests/test_paper_rehearsal.py        # the whole rehearsal, a few minutes on 2 CPU cores
"""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import rehearsal_stages
import torch
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ one process and two: every stage of every method
@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """Every stage of tests/rehearsal_stages.py run by one process, then by two (gloo, CPU): (one, two)."""
    out, script = tmp_path_factory.mktemp("stages"), str(ROOT / "tests" / "rehearsal_stages.py")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port"]
    for command in (
        [sys.executable, script, str(out / "one.pt")],
        [*launch, free_port(), script, str(out / "two.pt")],
    ):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"{n}.pt", weights_only=True) for n in ("one", "two")]


@pytest.mark.parametrize("name", list(rehearsal_stages.STAGES))
def test_a_stage_under_two_processes_gives_the_loss_and_gradient_of_one(name, stage_runs):
    one, two = (runs[name] for runs in stage_runs)
    assert one.keys() == two.keys() and {"loss", "grad"} <= one.keys()
    for key in one:
        assert torch.allclose(torch.as_tensor(two[key]), torch.as_tensor(one[key]), rtol=1e-4, atol=1e-6), key
    assert torch.as_tensor(one["grad"]).abs().max() > 0  # the step moved the weights


# ------------------------------------------------------------------ smartrag

# ------------------------------------------------------------------ c3po

# ------------------------------------------------------------------ sparkle

# ------------------------------------------------------------------ tearag

# ------------------------------------------------------------------ sparcrag
SPARCRAG_ORACLE = {"teacher_duplicate": 0.0, "teacher_accept_correct": 1.0, "teacher_accept_wrong": 0.0}


def sparcrag_oracle(preset, rows):
    """SPARC-RAG's toy oracle as the trained roles (Query Rewriter, Answer Evaluator) and the toy reader as the Context
    Manager and Answer Generator (--llm toy: no random model plays a role), under a preset's values and templates:
    (args, ctx, tokenizer, the runs of the tuned system: adaptive depth, capped at --depth)."""
    import sparcrag

    args = rehearsal_stages.sparcrag_args(preset=preset, **SPARCRAG_ORACLE)
    retrievers, llm = sparcrag.frozen_parts(args)
    policy, tokenizer = sparcrag.load_policy(args, torch.device("cpu"))  # its tokenizer counts the tokens
    teacher = {role: sparcrag.teacher_role(role, args, args.seed + i) for i, role in enumerate(sparcrag.TRAINED)}
    ctx = sparcrag.make_ctx(policy, tokenizer, retrievers, llm, args, teacher)
    return args, ctx, tokenizer, sparcrag.sparc_rag(rows, ctx, args.width, args.depth, True, args.seed)


def test_sparcrag_oracle_scores_the_same_under_the_paper_preset_and_its_pairs_train_on_what_it_wrote():
    """On 60 toy test questions the oracle writing the paper's formats (a <think> block before the rewrites, a reason
    before the decision) under --preset paper (top-6, depth cap 8 and fixed depth 6, the App. D prompts, 600-token
    caps) scores within 0.02 of the oracle under the toy preset (top-3, depth 4, compact prompts), adaptive and at
    fixed depth; the preference pairs built from its runs (recall and correctness labels, against a sample cut inside
    its <think> block) train on the responses as written: the <think> block kept, the cut one without [END] or EOS."""
    import sparcrag
    from common.data import load_split

    rows, scores, cut = load_split(str(ROOT / "data" / "toy"), "test")[:60], {}, "<think> i need to know the"
    for preset in ("toy", "paper"):
        args, ctx, tokenizer, played = sparcrag_oracle(preset, rows)
        fixed = sparcrag.sparc_rag(rows, ctx, args.width, args.untuned_depth, False, args.seed)
        scores[preset] = [sparcrag.summarize([sparcrag.run_record(r, args) for r in runs], rows)["f1"]
                          for runs in (played, fixed)]  # fmt: skip
        written = {e["prompt"]: e["output"] for run in played for e in run["trace"]}
        sample = lambda prompts, n, temperatures: [[written[p], cut] for p in prompts]  # the oracle's, a cut one
        pairs = sparcrag.build_pairs(played, ctx, sample, replace(args, n_samples=2))
        assert {p["role"] for p in pairs} == {"rewrite", "evaluate"} and all(p["rejected"] == cut for p in pairs)
        think = [p["chosen"].startswith("<think>") for p in pairs if p["role"] == "rewrite"]
        assert think and set(think) == {preset == "paper"}  # the paper's Rewrite prompt asks for the block
        tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        for pair in pairs:
            n = len(tokens(sparcrag.chat_prompts(tokenizer, [[{"role": "user", "content": pair["prompt"]}]])[0]))
            assert sparcrag.encode(tokenizer, pair["prompt"], pair["chosen"])[0][n:] == tokens(pair["chosen"]) + [
                tokenizer.eos_token_id
            ]
            assert sparcrag.encode(tokenizer, pair["prompt"], cut)[0][n:] == tokens(cut)
    for adaptive_or_fixed in (0, 1):
        assert abs(scores["paper"][adaptive_or_fixed] - scores["toy"][adaptive_or_fixed]) <= 0.02, scores
    assert min(min(s) for s in scores.values()) > 0.8  # the oracle answers (the toy reader: unanswerable ones aside)


@pytest.mark.parametrize("rpo_alpha", [0.0, 0.5])
def test_sparcrag_dpo_gives_the_same_step_at_micro_batch_1_and_the_whole_batch(rpo_alpha):
    """sparcrag.dpo_train on one batch of 4 pairs (a <think> block, a lambda-weighted pair, unequal lengths), at the
    paper's micro-batch 1 and at 4 (the --rpo_alpha term too): the same loss, margins and weight change."""
    from accelerate import Accelerator

    one, whole = (rehearsal_stages.sparcrag_dpo(Accelerator(cpu=True), dpo_batch_size=4, micro_batch_size=m,
                                                rpo_alpha=rpo_alpha) for m in (1, 4))  # fmt: skip
    assert one["grad"].abs().max() > 0 and len(one["loss"]) == 1
    for key in one:
        assert torch.allclose(one[key], whole[key], rtol=1e-5, atol=1e-7), key


def test_sparcrag_paper_preset_prints_every_value_pinned_to_the_paper(capsys):
    """`--preset paper --dry_run` prints the resolved configuration (then checks its paths); each value as
    the paper states it, or as the header's departures say."""
    import json

    import sparcrag

    try:
        sparcrag.main(["--preset", "paper", "--dry_run"])
    except SystemExit:  # the paper's corpora (data/sparcrag) are not in the repository, its models not cached
        pass
    printed = capsys.readouterr().out
    config = json.loads(printed[: printed.index("\n}\n") + 2])
    paper = {
        "model": "Qwen/Qwen2.5-7B-Instruct",  # [§4.2] (and Qwen3-32B)
        "llm": "policy",  # [§4.2] the backbone plays every agent
        "templates": "paper",  # [App. D]
        "width": 2,  # [§4.5: fixed W = 2]
        "depth": 8,  # [§4.5: capped at a maximum depth of 8; App. A.4: up to 8 rounds]
        "untuned_depth": 6,  # [§4.5: D = 6 for Qwen-2.5-7B-Instruct without fine-tuning]
        "early_exit": True,  # [§3.3] the winner's STOP ends the loop
        "top_k": 6,  # [App. A.3: k = 6]
        "temperature": 0.5,  # [App. A.4: generation modules]
        "max_new_tokens": 600,  # [App. A.4: maximum generation length 600]
        "evaluator_max_tokens": 600,  # [App. A.4] (the evaluator: temperature 0, make_ctx)
        "seed": 42,  # [App. A.4: global random seed 42]
        "dense_only": False,  # [§4.3: hybrid retrieval; Tab. 6 the dense-only ablation]
        "bootstrap_with_q0": False,  # [Alg. 1: the Rewriter from round 1]
        "lam": 2.0,  # [§5.2: lambda = 2 in the final model]
        "beta": 0.1,  # [App. A.4]
        "reference_free": False,  # header item 6: TRL 0.23.1's DPO with LoRA [App. A.4]
        "lora_r": 16,  # [App. A.4]
        "lora_alpha": 32,  # [App. A.4]
        "lora_dropout": 0.05,  # [App. A.4]
        "dpo_lr": 5e-5,  # [App. A.4: 5e-5 (LoRA)]
        "dpo_epochs": 3,  # [App. A.4]
        "dpo_batch_size": 16,  # [App. A.4: effective batch size 16]
        "micro_batch_size": 1,  # [App. A.4: batch size 1, gradient accumulation]
        "max_length": 8192,  # [App. A.4: maximum sequence length 8192]
        "role_adapters": False,  # [§4.5: the base LLM fine-tuned on the combined data]
        "warmup": "none",  # [§3.4: pairs from the base model's own runs]
        "sft_steps": 0,
        "n_train": None,  # [§4.1: the training splits]
        "n_eval": None,  # [§4.1: the test splits (500-question subsamples)]
        "system": "sparcrag",
        "naive_n": 3,  # [App. A.5: Sequential (Naive), D = 3 attempts]
        "correct_by": "acc",  # [§4.1: acc.]; the label itself the paper does not define (ours)
        "encoder": "intfloat/e5-base-v2",  # header item 7 (the paper: BGE-large-en-v1.5, App. A.2)
        "format_tokens": False,  # a pretrained tokenizer reads the tags as text (header item 4: the toy's tokens)
        "n_samples": 4,  # ours: samples per state [§3.4 gives none]
        "rewrite_pair_temperature": 1.0,  # ours
        "rpo_alpha": 0.0,  # DPO alone [§3.4]
        "augment_p": 0.0,  # no toy renaming (header item 3)
        "dpo_augment_p": 0.0,
        "evaluator_epochs": 3,  # [App. A.4: 3] (used with --role_adapters only)
    }
    assert {k: config[k] for k in paper} == paper
    ignored = """preset train eval ask output_dir run_name resume dry_run report_to data_dir corpus bm25_index
    dense_index llm_model question_types gen_batch_size synthesize_missing sft_lr sft_batch_size warmup_widths
    teacher_accept_correct teacher_accept_wrong teacher_duplicate""".split()  # modes, paths, memory, the toy warm-up
    assert set(config) == set(paper) | set(ignored)  # every printed value pinned or named here
