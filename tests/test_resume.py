"""A training run killed mid-way (SIGKILL, nothing flushed) and started again with --resume continues from its last
checkpoint, not from the start, and ends with the result contract; for every method."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import check_contract

ROOT = Path(__file__).resolve().parents[1]
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"
PPO = ["--n_train", "32", "--n_eval", "8", "--sft_steps", "8", "--ppo_iterations", "6", "--rollout_batch", "4",
       "--sft_batch_size", "16", "--ppo_batch_size", "64", "--eval_every", "1"]  # fmt: skip
CASES = {  # method: (flags, the checkpoint whose appearance triggers the kill, a line only a fresh run prints, steps)
    "smartrag": (["--n_train", "16", "--n_eval", "4", "--sft_steps", "2", "--sft_batch_size", "8",
                  "--ppo_iterations", "6", "--rollout_batch", "4", "--ppo_batch_size", "8", "--eval_every", "1"],
                 "ppo", "raw |", {"sft": 2, "ppo": 6}),  # the toy base pretraining (300 steps) included
    "c3po": (PPO, "ppo", "sft/step=8", {"sft": 8, "ppo": 6}),
    "sparkle": (PPO, "ppo", "sft/step=8", {"sft": 8, "ppo": 6}),
    "tearag": (["--sft_steps", "4", "--n_dpo", "6", "--n_rollouts", "2", "--n_eval", "12", "--rounds", "3", "--eta",
                "1,1,1", "--dpo_epochs", "1,1,1", "--rollout_batch", "6", "--max_new_tokens", "32"], "dpo", "SFT: ",
               {"curriculum": 3, "sft": 4, "dpo": 0}),  # the toy curriculum: 2/3 of --sft_steps, rounded
    "sparcrag": (["--n_train", "12", "--n_eval", "6", "--sft_steps", "6", "--dpo_epochs", "1",
                  "--untuned_depth", "2", "--depth", "2", "--max_new_tokens", "96", "--seed", "0"], "sft", "warm-up: ",
                 {"sft": 6, "dpo": 2}),  # the toy preset's two adapters
}  # fmt: skip


@pytest.mark.parametrize("method", list(CASES))
def test_a_killed_run_resumes_from_its_last_checkpoint(method, tmp_path):
    flags, stage, fresh_only, steps = CASES[method]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / f"{method}.py"), "--train", "--output_dir", str(out), "--model", TINY_LM]
    command += ["--data_dir", str(ROOT / "data" / "toy"), *flags]
    log = open(tmp_path / "first.log", "w")  # a file, not a pipe that could fill and stall the run
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.DEVNULL)
    while first.poll() is None and not (out / stage / "run_state.json").is_file():
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)  # mid-way: the checkpoint exists, the run is not done
    assert first.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    log.close()
    assert fresh_only in (tmp_path / "first.log").read_text()  # what the fresh run printed before its checkpoint
    assert not (out / "results.json").exists()
    spent = json.loads((out / stage / "run_state.json").read_text())["spent"]  # the budget at the checkpoint
    again = subprocess.run([*command, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert fresh_only not in again.stdout  # continued from the checkpoint: the warm-up did not run again
    results = check_contract(out, again.stdout)
    assert results["method"] == method and results["train_steps"] == steps
    budget = results["budget"]  # it goes on from the checkpoint's
    assert budget["cpu_s"] > spent["cpu_s"] and budget["generated_tokens"] >= spent["generated_tokens"]
