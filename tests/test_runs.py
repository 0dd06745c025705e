"""common/runs.py: atomic checkpoints that survive a crash, metrics lines, the results contract's files."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import runs
from common.toy_lm import load_toy_lm

ROOT = Path(__file__).resolve().parents[1]

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


class Crash(Exception):
    """The process dies here."""


def patch_operations(m, *savers, crash_at=0, partial=False):
    """Count the filesystem operations of save_checkpoint / load_state (nested ones too) in a list of (name, args); the
    crash_at-th one raises Crash, after doing half its work when `partial` (half a file; a folder half deleted, its
    state file kept, so that it looks complete)."""
    calls = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def op(*args, **kwargs):
            calls.append((name, args))
            if len(calls) != crash_at:
                return original(*args, **kwargs)
            if partial and name == "rmtree" and Path(args[0]).is_dir():
                for f in sorted(Path(args[0]).iterdir()):
                    if f.name != runs.STATE:
                        f.unlink()
            elif partial and name == "write_text":
                original(args[0], args[1][:len(args[1]) // 2])
            elif partial and name == "save":
                Path(args[1]).write_bytes(b"PK\x03")
            elif partial and name == "save_pretrained":
                original(*args, **kwargs)
                for f in Path(args[1]).iterdir():
                    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
            raise Crash(f"{name} #{crash_at}")
        m.setattr(owner, name, op)

    operations = [(torch, "save"), (shutil, "rmtree"), (os, "rename"), (os, "replace"), (Path, "rename"),
                  (Path, "replace"), (Path, "write_text"), (Path, "unlink")]
    for owner, name in operations + [(type(x), "save_pretrained") for x in savers]:
        wrap(owner, name)
    return calls


def set_weights(model, version):
    with torch.no_grad():
        model.model.norm.weight.fill_(float(version))
    return {"version": version}, {"extra.pt": {"v": torch.tensor(float(version))}, "optimizer.pt": {"step": version}}


def assert_checkpoint(folder, version, reference):
    """folder holds checkpoint `version` whole: its state, weights, other tensors, and the files of a clean save."""
    assert runs.load_state(folder) == {"version": version}
    weights, files = load_file(folder / "model.safetensors"), reference["files"]
    assert weights.keys() == reference["weights"].keys()
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)
    assert torch.load(folder / "extra.pt")["v"].item() == version == torch.load(folder / "optimizer.pt")["step"]
    assert sorted(p.name for p in folder.iterdir()) == files


def crash_then_resume(tmp_path, model, tokenizer, monkeypatch, previous, crash_at, partial):
    """Save checkpoint 2 over checkpoint 1 (over nothing unless `previous`), crashing at operation crash_at; return
    the folder left behind and the operations a first load_state on it does."""
    folder = tmp_path / "run" / "ckpt"
    shutil.rmtree(folder.parent, ignore_errors=True)
    folder.parent.mkdir()
    if previous:
        runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 1))
    with monkeypatch.context() as m:
        patch_operations(m, model, tokenizer, crash_at=crash_at, partial=partial)
        with pytest.raises(Crash):
            runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 2))
    return folder


def test_a_crash_between_any_two_writes_keeps_the_last_checkpoint_put_in_place(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    saved_norm = model.model.norm.weight.detach().clone()
    reference = {}
    for version in (1, 2, 3):  # the weights each checkpoint must hold
        runs.save_checkpoint(tmp_path / "reference", model, tokenizer, *set_weights(model, version))
        reference[version] = {"weights": load_file(tmp_path / "reference" / "model.safetensors"),
                              "files": sorted(p.name for p in (tmp_path / "reference").iterdir())}
    cases = repairs = 0
    for previous in (True, False):
        with monkeypatch.context() as m:  # a clean save, to count its operations and find the rename that commits
            folder = tmp_path / f"count-{previous}" / "ckpt"
            if previous:
                runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 1))
            calls = patch_operations(m, model, tokenizer)
            runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 2))
        names = [name for name, _ in calls]  # Path.rename calls os.rename: the rename that commits is the inner one
        assert {"save_pretrained", "save", "write_text", "rename", "rmtree"} <= set(names)
        assert names.count("save") == 2 and names.count("save_pretrained") == 2
        commit = max(i for i, (name, args) in enumerate(calls, 1) if name == "rename" and Path(args[1]) == folder)
        for crash_at in range(1, len(calls) + 1):
            for partial in (False, True):
                expected = 2 if crash_at > commit else 1 if previous else None
                folder = crash_then_resume(tmp_path, model, tokenizer, monkeypatch, previous, crash_at, partial)
                with monkeypatch.context() as m:
                    repair = patch_operations(m, model, tokenizer)
                    runs.load_state(folder)
                for load_crash in range(1, len(repair) + 1):  # the repair by load_state may crash too
                    folder = crash_then_resume(tmp_path, model, tokenizer, monkeypatch, previous, crash_at, partial)
                    with monkeypatch.context() as m:
                        patch_operations(m, model, tokenizer, crash_at=load_crash, partial=partial)
                        with pytest.raises(Crash):
                            runs.load_state(folder)
                    repairs += 1
                if expected is None:
                    assert runs.load_state(folder) is None and not (folder / "model.safetensors").exists()
                else:
                    assert_checkpoint(folder, expected, reference[expected])
                runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 3))  # the run goes on
                assert_checkpoint(folder, 3, reference[3])
                assert [p.name for p in folder.parent.iterdir()] == ["ckpt"]  # no .tmp / .old left behind
                cases += 1
    assert cases >= 30 and repairs >= 2
    with torch.no_grad():
        model.model.norm.weight.copy_(saved_norm)


def test_a_save_after_a_crash_between_the_renames_keeps_the_checkpoint_set_aside(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    saved_norm = model.model.norm.weight.detach().clone()
    folder = tmp_path / "ckpt"
    runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, 1))
    expected = load_file(folder / "model.safetensors")
    rename = Path.rename

    def crash_on_commit(self, target):
        if Path(target) == folder:
            raise Crash("killed before the new checkpoint is put in place")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_commit)
    for version in (2, 3):  # the second save comes with no load_state before it (a run that does not resume)
        with pytest.raises(Crash):
            runs.save_checkpoint(folder, model, tokenizer, *set_weights(model, version))
        assert not folder.exists()
    monkeypatch.undo()
    assert runs.load_state(folder) == {"version": 1}
    weights = load_file(folder / "model.safetensors")
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    with torch.no_grad():
        model.model.norm.weight.copy_(saved_norm)


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


def test_a_crash_while_writing_results_keeps_the_previous_results(tmp_path, monkeypatch, capsys):
    runs.write_results(tmp_path, {"method": "x", "n": 1})
    (tmp_path / "count").mkdir()
    with monkeypatch.context() as m:
        calls = patch_operations(m)
        runs.write_results(tmp_path / "count", {"method": "x", "n": 2})
    assert [name for name, _ in calls][-1:] in (["replace"], ["rename"])
    capsys.readouterr()
    for crash_at in range(1, len(calls) + 1):
        for partial in (False, True):
            with monkeypatch.context() as m:
                patch_operations(m, crash_at=crash_at, partial=partial)
                with pytest.raises(Crash):
                    runs.write_results(tmp_path, {"method": "x", "n": 2})
            assert json.loads((tmp_path / "results.json").read_text()) == {"method": "x", "n": 1}
            assert "RESULT" not in capsys.readouterr().out  # the RESULT line comes only once the file is in place


def run_program(main_fn, *args):
    """Run `print(run_main(<main_fn>, sys.argv[1:]))` in a fresh python."""
    program = ("import sys\nfrom common.data import load_qa\nfrom common.runs import run_main\n"
               f"print(run_main({main_fn}, sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", program, *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("content, message", [
    (b'{"id": "q1", "question": "x ?", "golden_answers": ["a"]}\n{"id": "q2", "question": "y ?"', "2: not valid JSON"),
    (b'{"id": "q1", "question": "caf\xe9 ?", "golden_answers": ["a"]}\n', "1: not valid UTF-8"),
])
def test_run_main_reports_a_user_error_as_one_line(tmp_path, content, message):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(content)
    proc = run_program("lambda argv: load_qa(argv[0])", str(path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {path}:{message}")


def test_run_main_passes_results_through_and_keeps_the_traceback_of_a_bug(tmp_path):
    assert runs.run_main(lambda argv: argv + ["ok"], ["a"]) == ["a", "ok"]
    with pytest.raises(ZeroDivisionError):
        runs.run_main(lambda argv: 1 / 0)
    with pytest.raises(KeyError):
        runs.run_main(lambda argv: {}["missing"])
    proc = run_program("lambda argv: 1 / 0")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ZeroDivisionError" in proc.stderr


def test_run_main_turns_each_user_error_into_one_line(capsys):
    from common.data import DataError
    from common.llm import ModelLoadError
    from common.retrieval import EncoderLoadError

    for error in (DataError("qa.jsonl:3: missing field 'id'"), ModelLoadError("cannot load model 'x':\n  not found\n"),
                  EncoderLoadError("cannot load encoder 'e5'")):
        def main(argv, error=error):
            raise error

        with pytest.raises(SystemExit) as exit_:
            runs.run_main(main)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == "error: " + " ".join(str(error).split()) + "\n"


def test_a_run_gets_a_name_and_its_own_folder_and_resumes_only_when_asked(tmp_path, tiny, monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Args:
        output_dir: str | None = None
        run_name: str | None = None
        resume: bool = False
        seed: int = 0
        lr: float = 0.1
        eval_every: int = 5

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "20260102-030405")
    args = Args(seed=1)
    assert runs.start_run(args, "m") == Path("runs/m__1__20260102-030405")  # <method>__<seed>__<timestamp>
    assert args.run_name == "m__1__20260102-030405" and args.output_dir == "runs/m__1__20260102-030405"
    named = Args(run_name="mine")
    assert runs.start_run(named, "m") == Path("runs/mine") and named.output_dir == "runs/mine"
    assert runs.start_run(Args(output_dir=str(tmp_path / "x")), "m") == tmp_path / "x"  # --output_dir overrides
    model, tokenizer = tiny
    runs.save_checkpoint(tmp_path / "runs/mine/ppo", model, tokenizer, {"args": vars(Args(run_name="mine"))})
    with pytest.raises(SystemExit, match=r"runs/mine holds a checkpoint \(ppo\): pass --resume"):
        runs.start_run(Args(run_name="mine"), "m")
    with pytest.raises(SystemExit, match=r"other arguments \(seed: 0 -> 1; lr: 0.1 -> 0.2\)"):
        runs.start_run(Args(run_name="mine", resume=True, seed=1, lr=0.2), "m")
    resumed = Args(run_name="mine", resume=True, eval_every=1)  # checkpoint frequency does not change the result
    assert runs.start_run(resumed, "m") == Path("runs/mine")
    with pytest.raises(SystemExit, match=r"no checkpoint in runs/other \(name the run to continue: --run_name"):
        runs.start_run(Args(run_name="other", resume=True), "m")
    runs.save_checkpoint(tmp_path / "old/sft", model, tokenizer, {"steps": 3})  # saved before runs kept their args
    with pytest.raises(SystemExit, match="other arguments"):
        runs.start_run(Args(output_dir="old", resume=True), "m")


def test_random_states_round_trip_through_json():
    import random

    import numpy as np

    own = random.Random(7)
    own.random()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(runs.rng_states(own)))  # a checkpoint's run_state.json
    drawn = [random.random(), np.random.rand(), torch.rand(1).item(), own.random()]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    own = random.Random(9)
    runs.set_rng_states(state, own)
    assert [random.random(), np.random.rand(), torch.rand(1).item(), own.random()] == drawn
