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
