"""The GPU bench of the paper presets' shapes (bench/paper_shapes.py) runs the method files' own code: run its tiny
shape on CPU so that a change of a method file's signatures cannot leave it broken, and on a GPU when there is one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "smartrag": ["--batch", "2", "--passage_tokens", "12"],
    "c3po": ["--nodes", "2", "--samples", "3", "--new_tokens", "4", "--passage_tokens", "12"],
}


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


@pytest.mark.parametrize("method", ["smartrag", "c3po"])
def test_paper_shape_bench_runs_the_method_code_on_cpu(method):
    step, summary = bench(method, {"CUDA_VISIBLE_DEVICES": ""})
    assert summary["method"] == method and summary["device"] == "cpu"
    if method == "smartrag":  # threshold -1: every episode retrieves, then answers at the quota
        assert step["turns_per_episode"] == 2.0 and step["sequences"] == 4 and step["ppo_s"] > 0
        assert summary["lora_r"] == 16 and summary["gradient_checkpointing"] is True  # the paper preset's settings
    else:
        assert step["generate_s"] > 0 and step["ppo_s"] > 0 and summary["prompt_tokens"] > 10 * 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["smartrag", "c3po"])
def test_paper_shape_bench_on_a_gpu(method):
    step, summary = bench(method, {})
    assert summary["dtype"] == "torch.bfloat16" and step["peak_gib"] > 0


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
