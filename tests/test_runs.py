"""common/runs.py: atomic checkpoints that survive a crash, metrics lines, the results contract's files."""
import json

import pytest
import torch

from common import runs
from common.toy import load_toy_lm

TINY = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


@pytest.fixture(scope="module")
def tiny():
    return load_toy_lm(TINY)


def test_checkpoint_round_trip_and_replace(tmp_path, tiny):
    model, tokenizer = tiny
    folder = tmp_path / "ppo"
    assert runs.load_state(folder) is None
    runs.save_checkpoint(folder, model, tokenizer, {"iteration": 1}, {"extra.pt": {"w": torch.ones(2)}})
    runs.save_checkpoint(folder, model, tokenizer, {"iteration": 2})
    assert runs.load_state(folder) == {"iteration": 2}
    assert not (folder / "extra.pt").exists()  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ppo"]  # no .tmp / .old left behind
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def test_a_crash_never_loses_the_last_complete_checkpoint(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    folder = tmp_path / "sft"
    runs.save_checkpoint(folder, model, tokenizer, {"step": 1})
    original = type(model).save_pretrained

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed while writing the new checkpoint

    monkeypatch.setattr(type(model), "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        runs.save_checkpoint(folder, model, tokenizer, {"step": 2})
    assert runs.load_state(folder) == {"step": 1}
    monkeypatch.setattr(type(model), "save_pretrained", original)
    runs.save_checkpoint(folder, model, tokenizer, {"step": 3})  # a stale .tmp is cleared
    folder.rename(tmp_path / "sft.old")  # killed between the two renames: only the set-aside copy exists
    assert runs.load_state(folder) == {"step": 3} and (folder / runs.STATE).is_file()


def test_metrics_and_results_files(tmp_path, capsys):
    runs.append_metrics(tmp_path / "metrics.jsonl", {"iteration": 1, "loss": 0.5})
    runs.append_metrics(tmp_path / "metrics.jsonl", {"iteration": 2, "loss": 0.25})
    runs.append_metrics(tmp_path / "metrics.jsonl", {"iteration": 3}, main_process=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2]
    runs.write_results(tmp_path, {"method": "x", "after": {"em": 0.5}})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last[len("RESULT "):]) == json.loads((tmp_path / "results.json").read_text()) == {
        "method": "x", "after": {"em": 0.5}}
    runs.write_results(tmp_path / "nothing", {"method": "y"}, main_process=False)  # other ranks write nothing
    assert capsys.readouterr().out == "" and not (tmp_path / "nothing").exists()
