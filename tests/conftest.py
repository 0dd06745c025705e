"""Test setup: no network, ever. The hub flags must be set before transformers is imported."""

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def free_port():
    """A TCP port free on this host now, for an `accelerate launch --main_process_port` (runs side by side never share
    one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def check_contract(out_dir, stdout):
    """The result contract every --train / --eval run honours: results.json with the required keys, and the same json
    as the last printed line `RESULT {...}`. Returns the results."""
    results = json.loads((Path(out_dir) / "results.json").read_text())
    for key in (
        "method",
        "preset",
        "seed",
        "model",
        "dataset",
        "n_eval",
        "before",
        "after",
        "retrievals_per_question",
        "llm_calls_per_question",
        "generated_tokens_per_question",
        "wall_s",
        "train_steps",
    ):
        assert key in results, key
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and len(last) <= 400, last[:500]
    head = json.loads(last[len("RESULT ") :])
    assert {k: head[k] for k in ("method", "preset", "seed", "n_eval")} == {
        k: results[k] for k in ("method", "preset", "seed", "n_eval")
    }
    for side in ("before", "after"):
        assert all(round(results[side][k], 4) == v for k, v in head.get(side, {}).items()), (side, head)
    written = (Path(out_dir) / "results.json").resolve()  # the path as given: relative to the run's working folder
    assert written == Path(head["results"]).resolve() or written.as_posix().endswith("/" + head["results"]), head
    if results["mode"] == "train":  # the budget, and the learning curve where the data has a dev split
        assert results["budget"]["updates"] == sum(results["train_steps"].values()) and results["budget"]["cpu_s"] > 0
        dev = Path(results["args"]["data_dir"]) / "dev.jsonl"
        lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if dev.is_file() else []
        updates = [record["update"] for record in map(json.loads, lines) if record.get("stage") == "val"]
        assert not dev.is_file() or (0 in updates and len(updates) >= 2), updates  # the SFT start and later
    return results


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate's state is a process-wide singleton: on a GPU, a test's `Accelerator(cpu=True)` would make a later
    test's run (make_accelerator: CUDA, bf16) fail to start. Each test leaves none behind."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
