"""The GPU bench of the paper presets' shapes (bench/paper_shapes.py) runs the method files' own code: run its tiny
shape on CPU so that a change of a method file's signatures cannot leave it broken, and on a GPU when there is one."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "smartrag": ["--batch", "2", "--passage_tokens", "12"],
    "c3po": ["--nodes", "2", "--samples", "3", "--new_tokens", "4", "--passage_tokens", "12"],
    "sparkle": ["--nodes", "2", "--samples", "3", "--new_tokens", "4", "--passage_tokens", "12"],
    "tearag": ["--batch", "1", "--new_tokens", "4", "--passage_tokens", "12", "--path_steps", "1"],
    "sparcrag": ["--batch", "1", "--new_tokens", "4", "--passage_tokens", "12"],
}
METHODS = list(SMALL)


def bench(method, device_env):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **device_env)
    out = subprocess.run(
        [
            sys.executable,
            "bench/paper_shapes.py",
            "--method",
            method,
            "--shape",
            "tiny",
            "--steps",
            "1",
            *SMALL[method],
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return lines[0], lines[-1]  # the timed step, the summary


@pytest.mark.parametrize("method", METHODS)
def test_paper_shape_bench_runs_the_method_code_on_cpu(method):
    step, summary = bench(method, {"CUDA_VISIBLE_DEVICES": ""})
    assert summary["method"] == method and summary["device"] == "cpu"
    # the decode figures of every method: its generate calls, their tokens and the weight-read bound
    assert 0 < step["generated_tokens"] <= sum(step["generate_batches"]) * (50 if method == "smartrag" else 4)
    assert step["bound_tok_s"] > 0 and step["generate_tok_s"] > 0 and step["decode_weight_gb"] > 0
    if method == "smartrag":  # threshold -1: every episode retrieves, then answers at the quota
        assert step["turns_per_episode"] == 2.0 and step["sequences"] == 4 and step["ppo_s"] > 0
        assert summary["lora_r"] == 16 and summary["gradient_checkpointing"] is True  # the paper preset's settings
        assert step["generate_batches"] == [2, 2]  # one call per turn
    elif method in ("c3po", "sparkle"):
        assert step["generate_s"] > 0 and step["ppo_s"] > 0 and step["generate_batches"] == [2]
        assert summary["prompt_tokens"] > (10 * 12 if method == "c3po" else 20 * 5)  # top-10 passages; 20 triples
    if method == "sparkle":  # full fine-tuning in fp32 master weights, and a separate critic
        assert summary["weight_dtype"] == "torch.float32" and summary["critic_params"] > 0
    elif method == "tearag":  # R = 8 sampled paths of the question in one call, then one IP-DPO step on 16 pairs
        assert step["generate_batches"] == [8] and summary["lora_r"] == 8 and summary["dpo_batch_size"] == 16
        assert step["dpo_s"] > 0 and step["mean_path_tokens"] > step["prompt_tokens"]
    elif method == "sparcrag":  # one call per role: rewrite, then update, answer, evaluate per branch, select, merge
        assert step["generate_batches"] == [1, 2, 2, 2, 1, 1] and summary["width"] == 2
        assert summary["lora_r"] == 16 and step["dpo_s"] > 0 and summary["trainable_params"] > 0


def test_decode_bound_is_batch_times_bandwidth_over_weight_bytes():
    sys.path.insert(0, str(ROOT / "bench"))
    import paper_shapes

    log = paper_shapes.GenerateLog(SimpleNamespace(generate=None))
    log.calls = [dict(batch=4, steps=10, tokens=40, seconds=2.0, weight_bytes=2e9)]
    figures = log.take(hbm_tb_s=1.0)  # 10 steps x 2 GB / 1 TB/s = 0.02 s for 40 tokens: 2000 tokens/s = 4 x 1e12 / 2e9
    assert figures["bound_tok_s"] == 2000.0 and figures["generate_tok_s"] == 20.0 and log.calls == []
    tokenizer = paper_shapes.build_tokenizer(paper_shapes.load_world(paper_shapes.DEFAULT_WORLD))
    model = paper_shapes.random_model("tiny", tokenizer, "cpu", torch.bfloat16)
    embedding = model.get_input_embeddings().weight.numel()  # untied: a decode step reads only its rows
    total = sum(p.numel() for p in model.parameters())
    assert paper_shapes.decode_weight_bytes(model) == 2 * (total - embedding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", METHODS)
def test_paper_shape_bench_on_a_gpu(method):
    step, summary = bench(method, {})
    assert step["peak_gib"] > 0 and step["bound_tok_s"] > 0
    if method in ("smartrag", "c3po"):
        assert summary["dtype"] == "torch.bfloat16"
    else:  # fp32 master weights (sparkle) or a frozen bf16 base under fp32 LoRA, with bf16 autocast
        assert summary["mixed_precision"] == "bf16"
        assert summary["weight_dtype"] == ("torch.float32" if method == "sparkle" else "torch.bfloat16")


def test_index_types_bench_prints_a_row_per_index_with_exact_search_at_recall_one():
    command = [sys.executable, "bench/index_types.py", "--n", "1000", "--dim", "16", "--queries", "20"]
    command += ["--lists", "8"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0].lstrip("| ") for r in rows] == ["Flat", "HNSW32", "HNSW32", "IVF8,Flat", "IVF8,Flat", "IVF8,PQ1",
                                                 "OPQ1,IVF8,PQ1"]  # fmt: skip
    recall = {(r[0].lstrip("| "), r[1]): float(r[2]) for r in rows}
    assert recall[("Flat", "-")] == 1.0 and recall[("IVF8,Flat", "nprobe=16")] == 1.0  # every list probed: exact
    assert 0 < recall[("IVF8,PQ1", "nprobe=64")] < 1  # compressed codes lose some neighbours


def index_scale(tmp_path, device_env):
    """bench/index_scale.py on 2,000 passages with a tiny encoder; returns its records by stage, and the workdir."""
    workdir, record_file = tmp_path / "work", tmp_path / "records.jsonl"
    command = [sys.executable, "bench/index_scale.py", "--passages", "2000", "--encoder_shape", "tiny"]
    command += ["--vocab_words", "20000", "--queries", "256", "--search_batches", "64,256", "--ivf_factory"]
    command += ["IVF16,Flat", "--search_params", "nprobe=16", "--workdir", str(workdir), "--json", str(record_file)]
    env = dict(os.environ, **device_env)
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]  # stdout holds only the records
    assert [json.loads(line) for line in record_file.read_text().splitlines()] == records
    return records, workdir


def test_index_scale_bench_builds_both_indexes_through_the_cli_and_measures_them(tmp_path):
    records, workdir = index_scale(tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert list(workdir.iterdir()) == []  # corpus, encoder, indexes deleted (no --keep)
    stages = [r["stage"] for r in records]
    assert stages == ["machine", "corpus", "encoder", "build", "build", "load"] + ["search"] * 4 + [
        "recall",
        "summary",
    ]
    by_stage = {r["stage"]: r for r in records}
    assert by_stage["corpus"]["passages"] == 2000 and by_stage["corpus"]["words_per_passage"] == 100
    tokens = by_stage["encoder"]["tokens_per_passage"]
    assert 100 < tokens < 200  # 100 words, a title, "passage:", [CLS], [SEP]; a rare word splits into pieces
    flat, ivf = [r for r in records if r["stage"] == "build"]
    assert flat["index"] == "Flat" and ivf["index"] == "IVF16,Flat" and "--search_params nprobe=16" in ivf["command"]
    assert flat["encode_s"] > 0 and flat["passages_per_s"] > 0 and flat["index_s"] >= 0 and ivf["index_s"] > 0
    assert flat["tokens_per_s"] == pytest.approx(flat["passages_per_s"] * tokens, rel=0.01)
    assert flat["index_bytes"] == pytest.approx(2000 * 32 * 4, rel=0.01)  # float32 vectors of the tiny width
    assert flat["peak_gpu_gib"] is None and "encode_s" not in ivf  # the IVF build reuses the Flat build's shards
    assert by_stage["load"]["device"] == "cpu" and by_stage["load"]["encoder_dtype"] == "float32"
    searches = [r for r in records if r["stage"] == "search"]
    assert [(r["index"], r["batch"]) for r in searches] == [("Flat", 64), ("Flat", 256), ("IVF16,Flat", 64),
                                                            ("IVF16,Flat", 256)]  # fmt: skip
    assert all(r["queries_per_s"] > 0 and r["faiss_queries_per_s"] > 0 and r["queries"] == 256 for r in searches)
    assert searches[2]["search_params"] == "nprobe=16"  # stored with the folder, applied when it is loaded
    assert by_stage["recall"]["recall_at_k"] >= 0.99  # every list probed: IVF is exact search


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_index_scale_bench_encodes_in_bfloat16_on_a_gpu(tmp_path):
    records, _ = index_scale(tmp_path, {})
    by_stage = {r["stage"]: r for r in records}
    assert by_stage["load"]["encoder_dtype"] == "bfloat16" and by_stage["load"]["device"].startswith("cuda")
    assert all(r["peak_gpu_gib"] > 0 for r in records if r["stage"] == "build")  # a CUDA context at least
    assert all(r["peak_gpu_gib"] is not None for r in records if r["stage"] == "search")


def test_the_learning_curve_is_the_mean_and_range_over_runs_of_a_smoothed_signal(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import curve

    for seed, values in enumerate([[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]):
        lines = [{"iteration": i + 1, "rollout/reward": v} for i, v in enumerate(values)]
        lines += [{"stage": "sft", "eval": {"f1": 0.5 + seed}}, {"stage": "ppo", "eval": {"f1": 0.7}}]
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    runs = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    curve.main([*runs, "--key", "rollout/reward", "--points", "2", "--window", "2"])
    out = capsys.readouterr().out
    assert "| 1 | 1.000 | 0.000 | 2.000 |" in out  # update 1: the window holds one update
    assert "| 4 | 3.500 | 2.500 | 4.500 |" in out  # update 4: (2+3)/2 and (4+5)/2
    assert "| sft | 1.000 | 0.500 | 1.500 |" in out and "| ppo | 0.700 | 0.700 | 0.700 |" in out
    with pytest.raises(SystemExit, match="no line holds 'missing'"):
        curve.main([*runs, "--key", "missing"])
