"""bench/compare.py and bench/throughput.py in tiny versions: a tiny training budget, a few questions, one seed. The
comparison trains once and then reuses the run, counts each baseline's retrievals and LLM calls as its definition
says, and writes the report; the throughput bench runs every method's own rollout and training-step code."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"
SPARCRAG_TINY = "sparcrag=--n_train 12 --n_eval 6 --sft_steps 6 --dpo_epochs 1 --untuned_depth 2 "
SPARCRAG_TINY += "--depth 2 --max_new_tokens 96"
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(script, *flags):
    """Run a bench script from the repository root: (stdout, stderr), asserting a zero exit."""
    done = subprocess.run([sys.executable, f"bench/{script}", *flags], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def test_compare_trains_once_reuses_the_run_and_reports_uniform_costs(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "out"
    flags = ["--methods", "sparcrag", "--n_eval", "6", "--runs", str(runs_dir), "--out", str(out)]
    flags += ["--baselines", "none,vanilla,iterative:2,parallel:2,sequential:2"]
    flags += ["--train_flags", f"all=--model {TINY_LM}", SPARCRAG_TINY]
    flags += ["--eval_flags", "sparcrag=--depth 2 --max_new_tokens 96"]  # the tuned system at depth 2
    stdout, _ = run("compare.py", *flags)
    log = runs_dir / "sparcrag" / "seed0" / "train.log"
    commands = lambda: [line for line in log.read_text().splitlines() if line.startswith("$ ")]
    assert (runs_dir / "sparcrag" / "seed0" / "results.json").is_file() and len(commands()) == 1
    report = json.loads((runs_dir / "compare.json").read_text())
    results = {name: seeds["0"] for name, seeds in report["results"].items()}
    assert list(results) == ["SPARC-RAG (dpo)", "no retrieval (the frozen LLM alone)", "single-shot RAG (top-k once)",
                             "iterative RAG, 2 retrievals (IRCoT-style)", "naive parallel scaling, 2 answers, vote",
                             "naive sequential scaling, up to 2 attempts"]  # fmt: skip
    none, single, iterative, parallel, sequential = list(results.values())[1:]
    rows = [json.loads(line) for line in (ROOT / "data" / "toy" / "test.jsonl").read_text().splitlines()[:6]]
    popular = sum(r["metadata"]["popular"] for r in rows) / 6
    assert none["em"] == pytest.approx(popular)  # the reader alone knows exactly the popular facts
    assert (none["retrievals"], none["llm_calls"]) == (0, 1) and (single["retrievals"], single["llm_calls"]) == (1, 1)
    assert (iterative["retrievals"], iterative["llm_calls"]) == (2, 2)  # one <think> step, then the answer
    assert (parallel["retrievals"], parallel["llm_calls"]) == (1, 2) and parallel["em"] == single["em"]
    assert 2 <= sequential["llm_calls"] <= 4  # an answer and a confidence per attempt, a retry below 0.7
    for figures in results.values():
        assert 0 <= figures["em"] <= figures["acc"] <= 1 and figures["seconds"] > 0
        assert figures["generated_tokens"] >= figures["llm_calls"] > 0 or figures["llm_calls"] == 0
    assert results["SPARC-RAG (dpo)"]["retrievals"] in (2, 4)  # W = 2 branches, 1 or 2 rounds (depth 2)
    table = (out / "results.md").read_text()
    assert (
        table.count("| SPARC-RAG (dpo) |") == 2 and f"| no retrieval (the frozen LLM alone) | {popular:.3f}" in table
    )
    if (out / "results.png").exists():  # matplotlib installed (the dev extra)
        assert (out / "results.png").stat().st_size < 100_000
    points = compare().curve(runs_dir / "sparcrag" / "seed0")  # the untuned start and the end of its DPO stage
    steps = json.loads((runs_dir / "sparcrag" / "seed0" / "results.json").read_text())["train_steps"]["dpo"]
    assert [u for u, _, _ in points] == [0, steps] and all(v["n"] == 6 for _, v, _ in points)  # at most --n_eval
    assert "## Training budget" in table and "| SPARC-RAG | 6 | " in table  # its 6 SFT steps
    assert f"| SPARC-RAG | 0 | {points[0][1]['f1']:.3f} [" in table and f"| SPARC-RAG | {steps} | " in table
    assert "| SPARC-RAG | depth-width scaling beats naive parallel scaling [Tab. 1] |" in table
    if (out / "results.png").exists():
        assert (out / "curves.png").is_file() and (out / "curves" / "sparcrag.png").is_file()
    run("compare.py", *flags, "--baselines", "none")  # again: the finished run is reused, not trained again
    assert len(commands()) == 1


def compare():
    """bench/compare.py as a module."""
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    return compare


def test_curves_budgets_and_claims_read_the_runs_as_written(tmp_path):
    c = compare()
    for seed, (f1s, tokens) in enumerate([((0.5, 0.6, 0.7), (30, 20, 10)), ((0.3, 0.6, 0.9), (40, 40, 40))]):
        folder = tmp_path / "tearag" / f"seed{seed}"
        folder.mkdir(parents=True)
        lines = [{"stage": "val", "update": u, "val": {"f1": f, "generated_tokens": t}, "budget": {"cpu_s": 1.0}}
                 for u, f, t in zip((0, 1, 2), f1s, tokens)]  # fmt: skip
        lines.insert(2, {"stage": "val", "update": 1, "val": {"f1": 0.0, "generated_tokens": 0}})  # resumed: last wins
        lines.insert(1, {"losses/dpo": 0.5, "round": 1})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        steps = {"curriculum": 60, "sft": 40, "dpo": 7 + seed}  # TeaRAG's toy curriculum counts as SFT steps
        results = {"train_steps": steps, "budget": {"generated_tokens": 50, "cpu_s": 9.5}, "wall_s": 12.0,
                   "before": {"em": 0.5, "generated_tokens": 60.0},
                   "after": {"em": 0.5 + 0.1 * (seed - 0.5), "generated_tokens": 50.0}}  # fmt: skip
        (folder / "results.json").write_text(json.dumps(results))
    curves = {"tearag": {s: c.curve(tmp_path / "tearag" / f"seed{s}") for s in (0, 1)}}
    assert [(u, v["f1"]) for u, v, _ in curves["tearag"][0]] == [(0, 0.5), (1, 0.0), (2, 0.7)]
    [(u0, f0, t0), _, (u2, f2, t2)] = c.curve_stats("tearag", curves["tearag"])
    assert (
        (u0, u2) == (0, 2) and f0 == pytest.approx((0.4, 0.2, 0.3, 0.5)) and f2 == pytest.approx((0.8, 0.2, 0.7, 0.9))
    )
    assert t2 == pytest.approx((25, 30, 10, 40))  # tokens: mean, spread, min, max
    ends = {0: [(0, {"f1": 0.5, "tokens": 9}, {}), (12, {"f1": 0.7, "tokens": 5}, {})],
            1: [(0, {"f1": 0.3, "tokens": 9}, {}), (15, {"f1": 0.5, "tokens": 7}, {})]}  # fmt: skip
    assert [(u, f[0]) for u, f, _ in c.curve_stats("sparcrag", ends)] == [(0, pytest.approx(0.4)), (14, 0.6)]
    assert c.budget(tmp_path / "tearag" / "seed1") == {"sft": 100, "rl": 8, "tokens": 50, "cpu_s": 9.5, "wall_s": 12.0}
    assert "| TeaRAG | 100 ± 0 | 8 ± 1 | 50 ± 0 | 10 ± 0 | 12 ± 0 |" in c.budget_table(
        {"tearag": {s: c.budget(tmp_path / "tearag" / f"seed{s}") for s in (0, 1)}}
    )
    args = SimpleNamespace(runs=str(tmp_path), seeds=[0, 1], methods=["tearag"])
    em, tokens = c.claim_diffs(args, "tearag", c.CLAIMS["tearag"], {})
    assert em == pytest.approx([-0.05, 0.05]) and tokens == pytest.approx([-10, -10])
    assert (c.verdict(em), c.verdict([0.1, 0.2]), c.verdict([-0.1, -0.2])) == ("no", "yes", "no")
    assert (c.verdict([-0.1, 0.3]), c.verdict(tokens, lower=True)) == ("mean only", "yes")
    results = {
        "TeaRAG (dpo)": {0: {"em": 0.7, "generated_tokens": 50.0}, 1: {"em": 0.8, "generated_tokens": 40.0}},
        "iterative RAG, 3 retrievals (IRCoT-style)": {s: {"em": 0.75, "generated_tokens": 20.0} for s in (0, 1)},
    }
    assert c.claim_diffs(args, "tearag", c.CLAIMS["tearag_2"], results) == (pytest.approx([-0.05, 0.05]), [30, 20])
    results["iterative RAG, 2 retrievals (IRCoT-style)"] = {s: {"em": 0.9, "generated_tokens": 9.0} for s in (0, 1)}
    assert c.claim_diffs(args, "tearag", c.CLAIMS["tearag_2"], results)[0] == pytest.approx([-0.2, -0.1])  # strongest
    del results["iterative RAG, 2 retrievals (IRCoT-style)"]
    row = c.claims_table(args, results).splitlines()[-1]
    assert "em +0.000 [-0.050, +0.050]; generated_tokens +25.000 [+20.000, +30.000]" in row
    assert row.endswith("| em: no; generated_tokens: no |")  # the mean difference is 0: not reproduced


def test_compare_evaluates_every_method_with_its_own_code(tmp_path):
    flags = ["--untrained", "--n_eval", "3", "--baselines", "none", "--runs", str(tmp_path), "--out", str(tmp_path)]
    run("compare.py", *flags)
    results = json.loads((tmp_path / "compare.json").read_text())["results"]
    methods = ["SmartRAG", "C-3PO", "SPARKLE", "TeaRAG", "SPARC-RAG"]
    assert list(results) == [f"{m} (untrained)" for m in methods] + ["no retrieval (the frozen LLM alone)"]
    for name, seeds in results.items():
        assert seeds["0"]["llm_calls"] >= 1 and seeds["0"]["generated_tokens"] > 0, name


def test_compare_refuses_bad_flags_in_one_line():
    done = subprocess.run([sys.executable, "bench/compare.py", "--baselines", "iterative"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("error: --baselines: bad item")


def test_one_by_one_generation_writes_what_the_batched_call_writes():
    sys.path.insert(0, str(ROOT / "bench"))
    import throughput

    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM, world=ROOT / "data" / "toy")
    prompts = ["question : who is the director of velbo ?", "what", "in what year did zorvak come out ? answer"]
    batched = throughput.GENERATE(model, tokenizer, prompts, 6, do_sample=False)
    single = throughput.one_by_one(model, tokenizer, prompts, 6, do_sample=False)
    assert single.texts == batched.texts and single.token_ids == batched.token_ids
    counted = throughput.Counted(throughput.one_by_one)
    counted(model, tokenizer, prompts, 6, do_sample=False)
    assert (counted.calls, counted.prompts) == (3, 3)  # one model.generate call per prompt


def test_throughput_runs_every_method_and_finds_the_same_hits(tmp_path):
    flags = ["--questions", "2", "--step_questions", "2", "--synthetic_docs", "500", "--repeat", "1"]
    stdout, _ = run("throughput.py", *flags, "--runs", str(tmp_path / "none"), "--json", str(tmp_path / "t.json"))
    rows = json.loads((tmp_path / "t.json").read_text())
    rollouts = [r for r in rows if r["part"] == "rollouts"]
    assert [r["method"] for r in rollouts] == ["c3po", "sparkle", "sparcrag", "tearag"]
    for r in rollouts:  # node by node: one model.generate call per sequence
        assert r["node_by_node_calls"] == r["node_by_node_sequences"] and r["batched_calls"] < r["batched_sequences"]
    assert [r["same_hits"] for r in rows if r["part"] == "retrieval"] == [True, True]
    steps = [r for r in rows if r["part"] == "train_step"]
    assert [r["method"] for r in steps] == ["smartrag", "c3po", "sparkle", "tearag", "sparcrag"]
    assert all(r["rollout_s"] > 0 for r in steps) and "| train step |" in stdout


def test_replot_reads_the_table_back_as_each_columns_min_and_max(tmp_path, monkeypatch):
    md = tmp_path / "results.md"
    md.write_text(
        "| system | EM | F1 | acc | retrievals | LLM calls | generated tokens | s / question |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| SPARKLE (ppo) | 0.873 ± 0.025 | 0.873 ± 0.025 | 0.883 ± 0.020 | 1.22 ± 0.02 | 9.03 ± 0.21 | 109.7 ± 0.9 "
        "| 0.03 |\n"
        "| no retrieval (the frozen LLM alone) | 0.170 | 0.170 | 0.212 | 0.00 | 1.00 | 2.0 | 0.0002 |\n"
        "| system | trained on | one_hop | two_hop | three_hop | comparison | yes_no |\n"
    )
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import compare

    results = compare.table_results(md)
    assert list(results) == ["SPARKLE (ppo)", "no retrieval (the frozen LLM alone)"]  # the type table is not read
    sparkle = results["SPARKLE (ppo)"]
    assert (sparkle[0]["f1"], sparkle[1]["f1"]) == pytest.approx((0.8605, 0.8855))  # mean -/+ spread / 2
    assert (sparkle[0]["llm_calls"], sparkle[1]["generated_tokens"]) == pytest.approx((8.925, 110.15))
    assert results["no retrieval (the frozen LLM alone)"][1]["llm_calls"] == 1.0  # one seed: no bar
    stdout, _ = run("compare.py", "--replot", str(md), "--out", str(tmp_path / "out"))
    assert (tmp_path / "out" / "results.png").exists() == ("wrote" in stdout)  # matplotlib installed: the picture
    assert not (tmp_path / "out" / "results.md").exists()  # nothing else is written
    md.write_text("no table\n")
    done = subprocess.run([sys.executable, "bench/compare.py", "--replot", str(md)], cwd=ROOT, env=ENV, text=True,
                          capture_output=True)  # fmt: skip
    assert done.returncode != 0 and "no table" in done.stderr.strip().splitlines()[-1]
