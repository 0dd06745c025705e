"""common/runs.py: atomic checkpoints that survive a crash, metrics lines, the results contract's files."""

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import runs
from common.toy.lm import load_toy_lm

ROOT = Path(__file__).resolve().parents[1]

TINY = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


@pytest.fixture(scope="module")
def tiny():
    return load_toy_lm(TINY)


def unbudgeted(state):
    """A checkpoint's state without the budget save_checkpoint adds (this process's tokens and CPU seconds)."""
    assert state["spent"]["cpu_s"] > 0 and state["spent"]["generated_tokens"] >= 0
    return {k: v for k, v in state.items() if k != "spent"}


def test_checkpoint_round_trip_and_replace(tmp_path, tiny):
    model, tokenizer = tiny
    folder = tmp_path / "ppo"
    assert runs.load_state(folder) is None
    runs.save_checkpoint(folder, model, tokenizer, {"iteration": 1}, {"extra.pt": {"w": torch.ones(2)}})
    runs.save_checkpoint(folder, model, tokenizer, {"iteration": 2})
    assert unbudgeted(runs.load_state(folder)) == {"iteration": 2}
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
    assert unbudgeted(runs.load_state(folder)) == {"step": 1}
    monkeypatch.setattr(type(model), "save_pretrained", original)
    runs.save_checkpoint(folder, model, tokenizer, {"step": 3})  # a stale .tmp is cleared
    folder.rename(tmp_path / "sft.old")  # killed between the two renames: only the set-aside copy exists
    assert unbudgeted(runs.load_state(folder)) == {"step": 3} and (folder / runs.STATE).is_file()


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
                original(args[0], args[1][: len(args[1]) // 2])
            elif partial and name == "save":
                Path(args[1]).write_bytes(b"PK\x03")
            elif partial and name == "save_pretrained":
                original(*args, **kwargs)
                for f in Path(args[1]).iterdir():
                    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            raise Crash(f"{name} #{crash_at}")

        m.setattr(owner, name, op)

    operations = [
        (torch, "save"),
        (shutil, "rmtree"),
        (os, "rename"),
        (os, "replace"),
        (Path, "rename"),
        (Path, "replace"),
        (Path, "write_text"),
        (Path, "unlink"),
    ]
    for owner, name in operations + [(type(x), "save_pretrained") for x in savers]:
        wrap(owner, name)
    return calls


def set_weights(model, version):
    with torch.no_grad():
        model.model.norm.weight.fill_(float(version))
    return {"version": version}, {"extra.pt": {"v": torch.tensor(float(version))}, "optimizer.pt": {"step": version}}


def assert_checkpoint(folder, version, reference):
    """folder holds checkpoint `version` whole: its state, weights, other tensors, and the files of a clean save."""
    assert unbudgeted(runs.load_state(folder)) == {"version": version}
    weights, files = load_file(folder / "model.safetensors"), reference["files"]
    assert weights.keys() == reference["weights"].keys()
    assert all(torch.equal(weights[k], reference["weights"][k]) for k in weights)
    extra, optimizer = (torch.load(folder / name, weights_only=True) for name in ("extra.pt", "optimizer.pt"))
    assert extra["v"].item() == version == optimizer["step"]
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
        reference[version] = {
            "weights": load_file(tmp_path / "reference" / "model.safetensors"),
            "files": sorted(p.name for p in (tmp_path / "reference").iterdir()),
        }
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
    assert unbudgeted(runs.load_state(folder)) == {"version": 1}
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
    assert json.loads((tmp_path / "results.json").read_text()) == {"method": "x", "after": {"em": 0.5}}
    head = json.loads(last[len("RESULT ") :])
    assert head["method"] == "x" and head["after"] == {"em": 0.5} and head["results"] == str(tmp_path / "results.json")
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
    program = (
        "import sys\nfrom common.data import load_qa\nfrom common.runs import run_main\n"
        f"print(run_main({main_fn}, sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", program, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b'{"id": "q1", "question": "x ?", "golden_answers": ["a"]}\n{"id": "q2", "question": "y ?"',
            "2: not valid JSON",
        ),
        (b'{"id": "q1", "question": "caf\xe9 ?", "golden_answers": ["a"]}\n', "1: not valid UTF-8"),
    ],
)
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

    for error in (
        DataError("qa.jsonl:3: missing field 'id'"),
        ModelLoadError("cannot load model 'x':\n  not found\n"),
        EncoderLoadError("cannot load encoder 'e5'"),
    ):

        def main(argv, error=error):
            raise error

        with pytest.raises(SystemExit) as exit_:
            runs.run_main(main)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == "error: " + " ".join(str(error).split()) + "\n"


def test_a_refused_flag_combination_exits_2_and_a_dry_runs_missing_file_1(capsys):
    def refuse(argv):
        raise SystemExit("--resume needs --train")

    with pytest.raises(SystemExit) as exit_:
        runs.run_main(refuse)
    assert (exit_.value.code, capsys.readouterr().err) == (2, "error: --resume needs --train\n")

    def missing(argv):
        raise runs.DryRunMissing("dry run: not found: --data_dir d/test.jsonl")

    with pytest.raises(SystemExit) as exit_:
        runs.run_main(missing)
    assert exit_.value.code == "dry run: not found: --data_dir d/test.jsonl"  # printed by Python, exit 1
    for code in (0, 3):  # an exit with a status passes through
        with pytest.raises(SystemExit) as exit_:
            runs.run_main(lambda argv, code=code: sys.exit(code))
        assert exit_.value.code == code


@dataclass
class RunArgs:
    """A run's arguments as start_run reads them."""

    output_dir: str | None = None
    run_name: str | None = None
    resume: bool = False
    seed: int = 0
    lr: float = 0.1
    eval_every: int = 5


def test_a_run_gets_a_name_and_its_own_folder_and_resumes_only_when_asked(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "20260102-030405")
    args = RunArgs(seed=1)
    assert runs.start_run(args, "m") == Path("runs/m__1__20260102-030405")  # <method>__<seed>__<timestamp>
    assert args.run_name == "m__1__20260102-030405" and args.output_dir == "runs/m__1__20260102-030405"
    named = RunArgs(run_name="mine")
    assert runs.start_run(named, "m") == Path("runs/mine") and named.output_dir == "runs/mine"
    assert runs.start_run(RunArgs(output_dir=str(tmp_path / "x")), "m") == tmp_path / "x"  # --output_dir overrides
    model, tokenizer = tiny
    runs.save_checkpoint(tmp_path / "runs/mine/ppo", model, tokenizer, {"args": vars(RunArgs(run_name="mine"))})
    with pytest.raises(SystemExit, match=r"runs/mine holds a checkpoint \(ppo\): pass --resume"):
        runs.start_run(RunArgs(run_name="mine"), "m")
    with pytest.raises(SystemExit, match=r"other arguments \(seed: 0 -> 1; lr: 0.1 -> 0.2\)"):
        runs.start_run(RunArgs(run_name="mine", resume=True, seed=1, lr=0.2), "m")
    resumed = RunArgs(run_name="mine", resume=True, eval_every=1)  # checkpoint frequency does not change the result
    assert runs.start_run(resumed, "m") == Path("runs/mine")
    with pytest.raises(SystemExit, match=r"no checkpoint in runs/other \(name the run to continue: --run_name"):
        runs.start_run(RunArgs(run_name="other", resume=True), "m")
    runs.save_checkpoint(tmp_path / "old/sft", model, tokenizer, {"steps": 3})  # saved before runs kept their args
    with pytest.raises(SystemExit, match="other arguments"):
        runs.start_run(RunArgs(output_dir="old", resume=True), "m")
    before_lr = {k: v for k, v in vars(RunArgs(run_name="pre")).items() if k != "lr"}  # saved before --lr existed
    runs.save_checkpoint(tmp_path / "runs/pre/sft", model, tokenizer, {"args": before_lr})
    with pytest.raises(SystemExit, match=r"other arguments \(lr: None -> 0.2\)"):
        runs.start_run(RunArgs(run_name="pre", resume=True, lr=0.2), "m")
    assert runs.start_run(RunArgs(run_name="pre", resume=True), "m") == Path("runs/pre")  # the new argument's default


def test_a_resumed_run_goes_on_from_the_budget_of_its_last_checkpoint(tmp_path, tiny, monkeypatch):
    """An SFT-only checkpoint (save_checkpoint) records the budget too; --resume takes the last stage's."""
    monkeypatch.setattr(runs.TrainingTokens, "cpu_before", 0.0)
    monkeypatch.setattr(runs.TrainingTokens, "total", 0)
    model, tokenizer = tiny
    for stage, tokens, cpu in (("sft", 0, 300.0), ("ppo", 55, 900.0)):  # what the run had spent at each save
        runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = tokens, cpu
        runs.save_checkpoint(tmp_path / "run" / stage, model, tokenizer, {"args": {"seed": 0}})
        assert runs.load_state(tmp_path / "run" / stage)["spent"]["cpu_s"] >= cpu
        runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = 0, 0.0  # a new process
        runs.start_run(RunArgs(output_dir=str(tmp_path / "run"), resume=True), "m", stages=(stage,))
        assert runs.TrainingTokens.total == tokens and runs.TrainingTokens.cpu_before >= cpu  # that stage's
        runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = 0, 0.0
    runs.start_run(RunArgs(output_dir=str(tmp_path / "run"), resume=True), "m")  # sft and ppo: the later one's
    assert runs.TrainingTokens.total == 55 and 900 <= runs.TrainingTokens.cpu_before < 1200
    recorded = {"args": {"seed": 0}, "spent": {"generated_tokens": 3, "cpu_s": 7.0}}  # save_training's own record
    runs.save_checkpoint(tmp_path / "old" / "sft", model, tokenizer, recorded)
    runs.start_run(RunArgs(output_dir=str(tmp_path / "old"), resume=True), "m")  # a state's own record is kept
    assert (runs.TrainingTokens.total, runs.TrainingTokens.cpu_before) == (3, 7.0)


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


# ---------------------------------------------------------------- sft_step: one optimizer step of next-token CE


def sft_batch(tokenizer, pairs):
    """Right-padded (ids, labels, attention) of (prompt, target) texts: labels -100 on the prompt and the padding."""
    seqs = []
    for prompt, target in pairs:
        p, t = (tokenizer(x, add_special_tokens=False)["input_ids"] for x in (prompt, target))
        seqs.append((p + t, [-100] * len(p) + t))
    width = max(len(ids) for ids, _ in seqs)
    pad = lambda xs, value: torch.tensor([x + [value] * (width - len(x)) for x in xs])
    ids, labels = pad([s[0] for s in seqs], tokenizer.pad_token_id), pad([s[1] for s in seqs], -100)
    return ids, labels, pad([[1] * len(s[0]) for s in seqs], 0)


PAIRS = [
    ("question : who is the director of zorvak ?", "velbo"),
    ("question : what is the birthplace of velbo and of zorvak ?", "tuvia was born"),
    ("question : who ?", "the capital city"),
    ("q ?", "velbo"),
    ("question : what is the release year of zorvak ?", "1931"),
]


def step_once(model, batch, micro_batch_size, lr=0.0, max_grad_norm=float("inf")):
    """runs.sft_step with SGD; returns (loss, gradients, scheduler)."""
    from accelerate import Accelerator

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loss = runs.sft_step(Accelerator(cpu=True), model, optimizer, scheduler, *batch, micro_batch_size, max_grad_norm)
    return loss, [p.grad.clone() for p in model.parameters()], scheduler


def test_sft_step_loss_is_the_cross_entropy_of_the_shifted_labels(tiny):
    """By hand, on each unpadded row: -log_softmax(logits[t])[ids[t + 1]] summed over the target tokens t + 1 (the
    first one predicted at the prompt's last position), divided by the number of target tokens of the batch."""
    import copy

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    batch = sft_batch(tokenizer, PAIRS[:3])
    ids, labels, attention = batch
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(len(ids)):
            n = int(attention[row].sum())
            logits = model(input_ids=ids[row : row + 1, :n]).logits[0]
            for t in range(n - 1):
                if labels[row, t + 1] != -100:
                    total -= torch.log_softmax(logits[t], -1)[ids[row, t + 1]].item()
                    count += 1
        shifted_wrong = -sum(  # the same cross-entropy with the labels not shifted: position t scored on ids[t]
            torch.log_softmax(model(input_ids=ids[r : r + 1]).logits[0, t], -1)[ids[r, t]].item()
            for r in range(len(ids))
            for t in range(ids.shape[1])
            if labels[r, t] != -100
        )
    assert count == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for _, t in PAIRS[:3])
    loss, _, scheduler = step_once(model, batch, micro_batch_size=2)
    assert loss == pytest.approx(total / count, rel=1e-5)
    assert abs(shifted_wrong / count - total / count) > 1e-2  # an off-by-one label shift would show
    assert scheduler.last_epoch == 1  # one optimizer step, one scheduler step


def test_sft_step_on_a_bigram_table_by_hand():
    """A model whose logits at a position depend only on its token: the logits at prompt positions and past the end
    carry no loss, those before each target token do (a 2-token prompt, then the targets 2 and 0)."""
    import math
    import types

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(3, 3))  # uniform over a 3-token vocabulary

        def forward(self, input_ids, attention_mask):
            return types.SimpleNamespace(logits=self.table[input_ids])

    ids, labels, attention = torch.tensor([[0, 1, 2, 0]]), torch.tensor([[-100, -100, 2, 0]]), torch.ones(1, 4).long()
    model = Bigram()
    loss, (grad,), _ = step_once(model, (ids, labels, attention), 1)
    assert loss == pytest.approx(math.log(3))
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() > 0 and grad[2].abs().sum() > 0  # token 0: prompt, end
    with torch.no_grad():
        model.table[0] = torch.tensor([9.0, 9.0, -9.0])  # predicts the prompt's 2nd token and past the end: masked
    assert step_once(model, (ids, labels, attention), 1)[0] == pytest.approx(math.log(3))
    with torch.no_grad():
        model.table[1] = torch.tensor([0.0, 0.0, math.log(2)])  # p(2) = 2 / 4 at the first target
    assert step_once(model, (ids, labels, attention), 1)[0] == pytest.approx((math.log(2) + math.log(3)) / 2)


def test_sft_step_gives_prompt_and_padding_positions_no_gradient(tiny):
    """d loss / d logits is 0 at every position whose next label is -100 (the prompt but its last token, the last
    target token, padding) and not 0 at every position that predicts a target token."""
    import copy

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    batch = sft_batch(tokenizer, PAIRS)
    ids, labels, attention = batch
    seen = []

    def keep(module, inputs, output):
        output.retain_grad()
        seen.append(output)

    hook = model.lm_head.register_forward_hook(keep)
    try:
        step_once(model, batch, micro_batch_size=len(PAIRS))
    finally:
        hook.remove()
    (logits,) = seen
    trained = (logits.grad.abs().sum(-1) > 0)[:, :-1]  # (B, T - 1): position t predicts token t + 1
    assert torch.equal(trained, labels[:, 1:] != -100)
    assert logits.grad[:, -1].abs().sum() == 0


def test_sft_step_gives_the_same_gradient_in_micro_batches(tiny):
    """Micro-batches of 1, 2 or all rows, each cut to its own longest row: the same loss and gradient."""
    import copy

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    batch = sft_batch(tokenizer, PAIRS)
    assert len(set(batch[2].sum(1).tolist())) > 2  # rows of different lengths: the cut changes the padding
    whole, grads, _ = step_once(model, batch, micro_batch_size=len(PAIRS))
    assert any(g.abs().sum() > 0 for g in grads)
    for micro in (1, 2):
        loss, other, _ = step_once(model, batch, micro_batch_size=micro)
        assert loss == pytest.approx(whole, rel=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, other))


def test_sft_step_steps_once_and_clips(tiny):
    import copy

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    batch = sft_batch(tokenizer, PAIRS[:2])
    _, first, _ = step_once(model, batch, 1)
    _, again, _ = step_once(model, batch, 1)  # lr 0: the gradients are zeroed first, not accumulated
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    _, clipped, _ = step_once(model, batch, 1, max_grad_norm=1e-3)
    assert torch.cat([g.flatten() for g in clipped]).norm() == pytest.approx(1e-3, rel=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    _, grads, _ = step_once(model, batch, 2, lr=0.1)
    assert all(torch.allclose(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))


# ---------------------------------------------------------------- save_training / load_training


def training_objects(model, seed):
    """A critic (a module with more weights than are saved), two optimizers with state and their schedulers."""
    torch.manual_seed(seed)
    value = torch.nn.Linear(4, 1)
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.AdamW(value.parameters(), lr=1e-2)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in optimizers]
    return value, optimizers, schedulers


def test_save_and_load_training_round_trip(tmp_path, tiny):
    import copy
    import random

    import numpy as np
    from accelerate import Accelerator

    accelerator, folder = Accelerator(cpu=True), tmp_path / "ppo"
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    value, optimizers, schedulers = training_objects(model, 0)
    for _ in range(2):  # optimizer and scheduler states worth saving
        loss = model(input_ids=torch.tensor([[4, 5, 6]])).logits.sum() + value(torch.ones(4)).sum()
        loss.backward()
        for o, s in zip(optimizers, schedulers):
            o.step()
            s.step()
    rng = random.Random(5)
    rng.random()
    weights_only = {"weight": value.weight.detach().clone()}  # a state dict itself, of part of the critic
    objects = dict(policy=model, value=weights_only, optimizers=optimizers, schedulers=schedulers)
    assert runs.load_training(accelerator, folder, objects, rng) is None  # nothing saved yet
    runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = 1234, 1000.0  # what the run has spent so far
    runs.save_training(accelerator, folder, model, tokenizer, {"iteration": 2}, objects, rng)
    runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = 0, 0.0  # a new process resumes
    saved = torch.load(folder / "training.pt", weights_only=True)
    assert set(saved) == set(objects) and len(saved["optimizers"]) == len(saved["schedulers"]) == 2
    assert set(saved["value"]) == {"weight"} and (folder / "model.safetensors").is_file()
    drawn = [random.random(), np.random.rand(), torch.rand(1).item(), rng.random()]  # what comes next
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    fresh, _ = load_toy_lm(TINY, seed=1)
    fresh_value, fresh_optimizers, fresh_schedulers = training_objects(fresh, 1)
    bias = fresh_value.bias.detach().clone()
    fresh_rng = random.Random(0)
    targets = dict(policy=fresh, value=fresh_value, optimizers=fresh_optimizers, schedulers=fresh_schedulers)
    state = runs.load_training(accelerator, folder, targets, fresh_rng)
    assert state["iteration"] == 2 and len(state["rng"]) == 1  # one process
    assert state["spent"]["generated_tokens"] == 1234 and state["spent"]["cpu_s"] > 1000  # the budget goes on
    assert runs.spent()["generated_tokens"] == 1234 and runs.spent()["cpu_s"] > state["spent"]["cpu_s"]
    runs.TrainingTokens.total, runs.TrainingTokens.cpu_before = 0, 0.0  # the other tests' process
    assert [random.random(), np.random.rand(), torch.rand(1).item(), fresh_rng.random()] == drawn
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert torch.equal(fresh_value.weight, value.weight) and torch.equal(fresh_value.bias, bias)  # bias: not saved
    for got, want in zip(fresh_optimizers, optimizers):
        got_state, want_state = got.state_dict(), want.state_dict()
        assert got_state["param_groups"] == want_state["param_groups"] and got_state["state"].keys()
        for k, s in want_state["state"].items():
            assert all(torch.equal(s[name], got_state["state"][k][name]) for name in s)
    for got, want in zip(fresh_schedulers, schedulers):
        assert got.last_epoch == want.last_epoch == 2 and got.get_last_lr() == want.get_last_lr()


def test_load_training_refuses_weights_the_model_does_not_have(tmp_path, tiny):
    from accelerate import Accelerator

    accelerator, (model, tokenizer) = Accelerator(cpu=True), tiny
    value = torch.nn.Linear(4, 1)
    extra = {"weight": value.weight.detach(), "head.weight": torch.zeros(1, 4)}  # another model's weights
    runs.save_training(accelerator, tmp_path / "ppo", model, tokenizer, {"iteration": 1}, {"value": extra})
    with pytest.raises(SystemExit, match=r"training\.pt does not fit this model \(\['head\.weight'\]"):
        runs.load_training(accelerator, tmp_path / "ppo", {"value": torch.nn.Linear(4, 1)})


def test_load_training_keeps_the_random_states_when_the_process_count_differs(tmp_path, tiny):
    import random

    from accelerate import Accelerator

    accelerator, (model, tokenizer) = Accelerator(cpu=True), tiny
    runs.save_training(accelerator, tmp_path / "ppo", model, tokenizer, {"iteration": 1}, {})
    path = tmp_path / "ppo" / runs.STATE
    state = json.loads(path.read_text())
    path.write_text(json.dumps(state | {"rng": state["rng"] * 2}))  # saved by two processes
    random.seed(3)
    expected = random.Random(3).random()
    assert runs.load_training(accelerator, tmp_path / "ppo", {})["iteration"] == 1
    assert random.random() == expected  # not restored: another process count draws otherwise anyway


# ---------------------------------------------------------------- the command line, logs and the result contract


def test_parse_args_checks_the_mode_and_takes_a_checkpoints_world(tmp_path, capsys):
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = False
        eval: bool = False
        ask: str = ""
        model: str | None = None
        data_dir: str | None = None
        seed: int = 0

    with pytest.raises(SystemExit, match="choose a mode"):
        runs.parse_args(Args, [])
    with pytest.raises(SystemExit) as exit_:
        runs.parse_args(Args, ["--train", "--bogus", "3"])  # one line, not HfArgumentParser's traceback
    assert exit_.value.code == 2 and capsys.readouterr().err == "error: unknown flags ['--bogus', '3'] (see --help)\n"
    with pytest.raises(SystemExit, match="--ask needs --model: .* the raw start knows nothing$"):
        runs.parse_args(Args, ["--ask", "who ?"], "the raw start knows nothing")
    (tmp_path / runs.STATE).write_text(json.dumps({"data_dir": "worlds/w3"}))
    args = runs.parse_args(Args, ["--eval", "--model", str(tmp_path), "--seed", "2"])
    assert args == Args(eval=True, model=str(tmp_path), data_dir="worlds/w3", seed=2)  # the checkpoint's world
    assert runs.parse_args(Args, ["--eval", "--model", str(tmp_path), "--data_dir", "d"]).data_dir == "d"
    assert runs.parse_args(Args, ["--train"]).data_dir is None  # no checkpoint: the preset decides


def test_the_toy_world_comes_from_world_then_the_data_then_the_checkpoint(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = False
        eval: bool = False
        ask: str = ""
        model: str | None = None
        data_dir: str | None = None
        world: str | None = None

    world, mine, ckpt = tmp_path / "world", tmp_path / "mine", tmp_path / "ckpt"
    for folder in (world, mine, ckpt):
        folder.mkdir()
    (world / "world.json").write_text("{}")
    (ckpt / runs.STATE).write_text(json.dumps({"data_dir": str(world), "world": str(world)}))
    assert runs.parse_args(Args, ["--eval", "--data_dir", str(world)]).world == str(world)  # the data holds it
    assert runs.parse_args(Args, ["--eval", "--data_dir", str(mine)]).world is None  # real data: no toy world
    on_mine = runs.parse_args(Args, ["--eval", "--data_dir", str(mine), "--model", str(ckpt)])
    assert (on_mine.data_dir, on_mine.world) == (str(mine), str(world))  # one's own questions, the checkpoint's world
    assert runs.parse_args(Args, ["--eval", "--data_dir", str(mine), "--world", str(world)]).world == str(world)
    with pytest.raises(SystemExit, match=f"^--world {mine}: no world.json there"):
        runs.parse_args(Args, ["--eval", "--world", str(mine)])
    from common import models

    with pytest.raises(models.llm.ModelLoadError, match="pass --world DIR"):
        models.load_model_and_tokenizer("toy-lm")
    assert models.make_llm("toy", world="data/toy").world is models.make_llm("toy:data/toy").world


def test_log_update_and_log_eval(tmp_path, capsys):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    runs.log_update(accelerator, tmp_path, {"iteration": 3, "losses/policy": 0.123456789, "tag": "x"}, step=3)
    assert capsys.readouterr().out == "iteration=3 | losses/policy=0.1235 | tag=x\n"
    runs.log_eval(accelerator, tmp_path, "sft", {"em": 0.5, "n": 4}, step=0)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"iteration": 3, "losses/policy": 0.123456789, "tag": "x"},
        {"stage": "sft", "eval": {"em": 0.5, "n": 4}},
    ]


def test_result_record_is_the_result_contract():
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = True
        preset: str = "toy"
        seed: int = 1
        model: str = "toy-lm"
        data_dir: str = "data/toy"

    before = {"n": 8, "retrievals": 1.5, "llm_calls": 2.0, "policy_calls": 3.0, "generated_tokens": 9.0}
    after = dict(before, retrievals=0.5, llm_calls=1.0, policy_calls=1.0)
    record = runs.result_record("m", Args(), {"n": 8}, before, after, {"sft": 2, "ppo": 3}, 12.345)
    spent = record.pop("budget")  # updates of every stage; this process's training tokens and CPU seconds so far
    assert (
        spent["updates"] == 5
        and spent["generated_tokens"] >= 0
        and 0 < spent["cpu_s"] <= runs.TrainingTokens.cpu_before + time.process_time() + 0.05
    )
    assert record == {"method": "m", "mode": "train", "preset": "toy", "seed": 1, "model": "toy-lm",
                      "dataset": "data/toy", "n_eval": 8, "before_sft": {"n": 8}, "before": before, "after": after,
                      "retrievals_per_question": 0.5, "llm_calls_per_question": 1.0,
                      "generated_tokens_per_question": 9.0, "wall_s": 12.3, "train_steps": {"sft": 2, "ppo": 3},
                      "args": {"train": True, "preset": "toy", "seed": 1, "model": "toy-lm",
                               "data_dir": "data/toy"}}  # fmt: skip
    evaluated = runs.result_record("m", Args(train=False), None, before, None, {"sft": 0}, 1.0, "policy_calls")
    assert evaluated["mode"] == "eval" and evaluated["after"] == before  # --eval: the one evaluation is the final one
    assert evaluated["llm_calls_per_question"] == 3.0 and evaluated["retrievals_per_question"] == 1.5


PAPER_MODELS = {  # each paper preset's models (each paper's experimental setup), as its --dry_run must print them
    "smartrag": ["meta-llama/Llama-2-7b-chat-hf", "intfloat/e5-base-v2"],
    "c3po": ["Qwen/Qwen2-0.5B", "hf:Qwen/Qwen2-72B-Instruct", "facebook/contriever-msmarco"],
    "sparkle": ["Qwen/Qwen2.5-3B-Instruct", "hf:Qwen/Qwen2.5-7B-Instruct", "intfloat/e5-large-v2"],
    "tearag": ["meta-llama/Meta-Llama-3-8B-Instruct", "intfloat/e5-base-v2", "BAAI/bge-reranker-v2-m3"],
    "sparcrag": ["Qwen/Qwen2.5-7B-Instruct", "intfloat/e5-base-v2"],
}


@pytest.mark.parametrize("method", list(PAPER_MODELS))
def test_paper_preset_dry_run_resolves_checks_paths_and_loads_nothing(method, tmp_path, monkeypatch, capsys):
    import importlib

    import common.data
    import common.llm
    import common.models
    import common.retrieval

    module = importlib.import_module(method)

    def work(*args, **kwargs):
        raise AssertionError("a dry run loaded something")

    for owner in (module, common.llm, common.models, common.data, common.retrieval):
        for name in ("load_model_and_tokenizer", "make_llm", "load_split", "load_qa", "open_retriever", "load_world"):
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, work)
    argv = ["--preset", "paper", "--dry_run", "--train", "--data_dir", str(tmp_path)]
    argv += ["--rewriter", "http://127.0.0.1:9/v1"] * (method == "smartrag")  # its paper --train needs one
    with pytest.raises(SystemExit, match=f"dry run: not found: --data_dir {tmp_path / 'test.jsonl'}; --data_dir "):
        module.main(argv)  # an empty folder: each file named, nothing read
    for name in ("train.jsonl", "test.jsonl", "corpus.jsonl", "triples.jsonl"):
        (tmp_path / name).write_text("")
    hubs = [m for m in PAPER_MODELS[method] if "not in the local cache" in runs.where_is(m)]
    with pytest.raises(SystemExit) as exit_:  # offline, a hub model not in the cache cannot be had: each named at once
        module.main(argv)
    assert all(f"{m} (a hub id not in the local cache, and HF_HUB_OFFLINE is set)" in str(exit_.value) for m in hubs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: downloaded on first use (the dry run itself contacts nothing)
    capsys.readouterr()
    module.main(argv)
    out = capsys.readouterr().out
    config = json.loads(out[: out.index("\n}\n") + 2])  # the resolved configuration comes first
    assert config["preset"] == "paper" and config["dry_run"] and config["data_dir"] == str(tmp_path)
    assert [m for m in PAPER_MODELS[method] if m in config.values()] == PAPER_MODELS[method]
    assert f"corpus: {tmp_path / 'corpus.jsonl'}" in out and "model: hub id" in out
    assert out.rstrip().endswith("dry run: configuration resolved, every path found, nothing loaded")
    with pytest.raises(SystemExit, match=r"not found: --model /no/such/folder$"):
        module.main(argv + ["--model", "/no/such/folder"])  # a local path that is not there


def test_where_is_finds_a_spec_without_loading_it(tmp_path):
    from common.runs import where_is

    built_in = "built in (toy world or method role)"
    assert where_is("toy-lm") == where_is("toy:data/toy") == where_is("policy") == built_in
    assert where_is("http://127.0.0.1:9/v1") == "an endpoint (not contacted)"  # nothing contacted: port 9 is closed
    assert where_is(f"hf:{tmp_path}") == where_is(str(tmp_path)) == f"local folder {tmp_path.resolve()}"
    assert where_is("hf:no-such-owner/no-such-model").startswith("hub id, not in the local cache")
    assert where_is(str(tmp_path / "missing" / "ppo")) is None and where_is("runs/x/ppo") is None and not where_is("")


def test_cosine_schedule_warms_up_linearly_then_decays_to_a_tenth():
    factors = [runs.cosine(s, 10, 2) for s in (0, 1, 2, 6, 10)]  # warm-up 2 steps, then cosine over 8 to 0.1
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1])


def test_own_share_gives_every_process_a_row_and_a_short_last_batch_a_stand_in():
    """Item i goes to process i mod N; a process left without an item gets the batch's first at weight 0."""
    from types import SimpleNamespace

    at = lambda rank: SimpleNamespace(process_index=rank, num_processes=3)
    assert [runs.own_share(list("abcde"), at(r)) for r in range(3)] == [(["a", "d"], 1.0), (["b", "e"], 1.0),
                                                                         (["c"], 1.0)]  # fmt: skip
    assert [runs.own_share(["a"], at(r)) for r in range(3)] == [(["a"], 1.0), (["a"], 0.0), (["a"], 0.0)]
    assert runs.own_share([], at(1)) == ([], 1.0)


def test_micro_backward_gives_the_gradient_of_one_pass_for_any_micro_batch_size():
    from accelerate import Accelerator

    accelerator, x = Accelerator(cpu=True), torch.arange(5.0)
    grads = []
    for size in (1, 2, 5):
        w = torch.zeros(1, requires_grad=True)
        total = runs.micro_backward(accelerator, torch.nn.Linear(1, 1), 5, size, lambda r: ((w - x[r]) ** 2).sum())
        grads.append((w.grad.item(), total))
    assert grads == [(-20.0, 30.0)] * 3  # d/dw sum (w - x)^2 at 0 = -2 * 10; the losses sum to 0+1+4+9+16


def test_a_run_ends_with_its_table_its_paths_and_a_short_result_line(tmp_path, capsys):
    """The full record in results.json; on screen the before/after table, the paths, and RESULT (<= 400 characters)
    with the headline metrics, however long the record."""
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / runs.STATE).write_text("{}")
    (tmp_path / "predictions_ppo.jsonl").write_text("{}\n")
    evaluation = {"em": 0.25, "f1": 0.31234567, "retrievals": 1.5, "generated_tokens": 12.0, "per_type": {"x": 1}}
    results = {"method": "m", "mode": "train", "preset": "toy", "seed": 3, "n_eval": 40, "model": "toy-lm",
               "before_sft": evaluation | {"em": 0.1}, "before": evaluation, "after": evaluation | {"em": 0.5},
               "train_steps": {"sft": 2, "ppo": 4}, "trees": ["x" * 100] * 300}  # fmt: skip
    runs.write_results(tmp_path, results)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert lines[-1].startswith("RESULT ") and len(lines[-1]) <= 400
    head = json.loads(lines[-1][len("RESULT ") :])
    assert head == {"method": "m", "preset": "toy", "seed": 3, "n_eval": 40, "before": {"em": 0.25, "f1": 0.3123},
                    "after": {"em": 0.5, "f1": 0.3123}, "results": str(tmp_path / "results.json")}  # fmt: skip
    table = lines[:5]
    assert table[0].split() == ["start", "before", "after"] and table[1].split() == ["em", "0.1", "0.25", "0.5"]
    assert [row.split()[0] for row in table[1:5]] == ["em", "f1", "retrievals", "generated_tokens"]
    assert lines[-4:-1] == [
        f"results: {tmp_path / 'results.json'}",
        f"checkpoint: {tmp_path / 'ppo'}",
        f"predictions: {tmp_path / 'predictions_ppo.jsonl'}",
    ]
    deep = Path("runs/" + "d" * 250 + "/results.json")  # a line that cannot hold every metric: fewer metrics
    head = json.loads(runs.result_line(results, deep)[len("RESULT ") :])
    assert len(runs.result_line(results, deep)) <= 400 and head["results"] == str(deep) and head["seed"] == 3
    assert 0 < len(head["after"]) < 2


def test_a_command_line_mistake_is_one_line_naming_the_flag_and_exit_2(capsys):
    """A wrong type, a value outside the choices or outside a field's range: `error: ...` alone, never the usage."""
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = False
        preset: str = runs.arg("toy", "", choices=["toy", "paper"])
        n_train: int = runs.arg(8, "questions", low=1)
        p: float = runs.arg(0.5, "a probability", low=0.0, high=1.0)

    for argv, message in [
        (["--n_train", "x"], "error: argument --n_train/--n-train: invalid int value: 'x' (see --help)"),
        (
            ["--preset", "nope"],
            "error: argument --preset: invalid choice: 'nope' (choose from 'toy', 'paper') (see --help)",
        ),
        (["--n_train", "-5"], "error: --n_train -5: must be >= 1"),
        (["--p", "1.5"], "error: --p 1.5: must be in [0.0, 1.0]"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            runs.parse_flags(Args, ["--train", *argv])
        assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [message]
    assert runs.parse_flags(Args, ["--n_train", "1", "--p", "0"]).n_train == 1  # the bounds are inclusive


def test_a_progress_bar_writes_to_a_log_at_most_every_30_seconds(monkeypatch):
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, not a terminal
    bar = runs.progress(range(1000), "steps", file=sys.stderr)
    for _ in bar:
        pass
    assert bar.mininterval == 30.0 and sys.stderr.getvalue().count("steps") <= 2  # the first and the final line
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert runs.progress(range(3), "x", file=io.StringIO()).mininterval == 0.1  # tqdm's own, on a terminal


def test_a_checkpoint_of_another_method_is_refused_naming_both(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = False
        eval: bool = False
        ask: str = ""
        model: str | None = None
        data_dir: str | None = None
        rounds: int = 3

    (tmp_path / runs.STATE).write_text(json.dumps({"method": "sparkle", "data_dir": "w"}))
    with pytest.raises(SystemExit, match=f"^--model {tmp_path} is a sparkle checkpoint, not a tearag one$"):
        runs.parse_args(Args, ["--eval", "--model", str(tmp_path)], method="tearag")
    assert runs.parse_args(Args, ["--eval", "--model", str(tmp_path)], method="sparkle").data_dir == "w"
    (tmp_path / runs.STATE).write_text(json.dumps({"args": {"model": "x", "ppo_iterations": 3}}))  # saved unmarked
    with pytest.raises(SystemExit, match="is another method's checkpoint, not a tearag one"):
        runs.parse_args(Args, ["--eval", "--model", str(tmp_path)], method="tearag")
    (tmp_path / runs.STATE).write_text(json.dumps({"args": {"model": "x", "rounds": 1}}))
    assert runs.parse_args(Args, ["--eval", "--model", str(tmp_path)], method="tearag").model == str(tmp_path)


def test_each_evaluation_writes_its_own_folder(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    args = SimpleNamespace(model=str(tmp_path / "ckpt"), data_dir="data/mine")
    first = runs.eval_dir(args, "sparkle")
    Path(first).mkdir(parents=True)
    second = runs.eval_dir(args, "sparkle")
    assert first != second and Path(first).parent == Path(second).parent == tmp_path / "ckpt" / "eval"
    assert Path(first).name.startswith("mine-") and second.startswith(first)  # within the same second: a suffix
    assert Path(runs.eval_dir(SimpleNamespace(model="toy-lm", data_dir=None), "c3po")).parent == Path("runs/c3po-eval")


def test_per_round_lists_follow_the_round_count():
    assert runs.per_round("1,2,3", 3, "--dpo_epochs") == [1.0, 2.0, 3.0]
    assert runs.per_round("1,2,3", 1, "--dpo_epochs") == [1.0]  # a shorter run takes the first values
    with pytest.raises(SystemExit, match=r"^--eta needs 4 comma-separated numbers \(one per round\), got '1,2,3'$"):
        runs.per_round("1,2,3", 4, "--eta")


def test_a_stage_that_trains_on_nothing_warns_once_and_keeps_the_warning(capsys):
    from accelerate import Accelerator

    warnings = []
    runs.nothing_to_train(Accelerator(cpu=True), warnings, "dpo round 1", "0 preference pairs")
    assert warnings == ["dpo round 1: 0 preference pairs"]
    assert capsys.readouterr().out == "warning: dpo round 1 trained on nothing (0 preference pairs)\n"


def test_help_groups_the_flags_and_shows_a_presets_toy_and_paper_values(capsys):
    from dataclasses import dataclass

    @dataclass
    class Args:
        train: bool = runs.arg(False, "train", group="run")
        seed: int = runs.arg(0, "the seed")
        top_k: int | None = runs.arg(None, "documents per search", low=1, group="retrieval")

    with pytest.raises(SystemExit):
        runs.parse_flags(Args, ["--help"], presets={"top_k": (3, 10)})
    text = capsys.readouterr().out
    run, retrieval = text.index("\nrun:\n"), text.index("\nretrieval:\n")
    assert run < text.index("--seed", run) < retrieval < text.index("--top_k", retrieval)  # each under its group
    assert "documents per search (toy: 3, paper: 10)" in " ".join(text.split())  # the presets' values, not None
    assert "(default: None)" not in text and "the seed (default: 0)" in " ".join(text.split())


def test_a_preset_only_field_is_no_flag_and_help_lists_its_values(capsys):
    from dataclasses import dataclass

    @dataclass
    class Args:
        seed: int = runs.arg(0, "the seed")
        rename_p: float | None = runs.arg(None, "entity-renaming probability", flag=False)
        lam: float = runs.arg(0.95, "GAE lambda", flag=False)

    presets = {"rename_p": (0.5, 0.0)}
    assert runs.parse_flags(Args, ["--seed", "3"], presets=presets) == Args(seed=3, rename_p=None)  # the preset fills
    with pytest.raises(SystemExit) as e:
        runs.parse_flags(Args, ["--rename_p", "0.3"], presets=presets)
    assert e.value.code == 2 and "unknown flags ['--rename_p', '0.3']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runs.parse_flags(Args, ["--help"], presets=presets)
    text = capsys.readouterr().out
    assert "--rename_p" not in text and "rename_p: entity-renaming probability (toy: 0.5, paper: 0.0)" in text
    assert "lam: GAE lambda (value: 0.95)" in text  # a fixed value, no preset entry


def test_off_a_terminal_the_libraries_bars_stay_silent(monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's own setting is kept
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    try:
        assert runs.run_main(lambda argv: hf_logging.is_progress_bar_enabled()) is False  # loading/saving weights
    finally:
        hf_logging.enable_progress_bar()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


class CurveAccelerator:
    """What runs.curve_point uses of an Accelerator."""

    is_main_process = True

    def __init__(self):
        self.logged = []

    def autocast(self):
        return contextlib.nullcontext()

    def log(self, values, step):
        self.logged.append((step, values))


def test_curve_point_logs_the_validation_subset_and_leaves_the_training_draws_alone(tmp_path):
    from dataclasses import dataclass

    import numpy as np

    @dataclass
    class Args:
        data_dir: str

    rows = [{"id": str(i), "question": f"q{i}", "golden_answers": ["a"], "metadata": {}} for i in range(150)]
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def evaluate(rows):  # an evaluation that draws from every generator, as sampling and shuffles do
        seen.append([r["id"] for r in rows])
        random.random(), np.random.rand(), torch.rand(1)
        return {"f1": 0.25, "n": len(rows), "ok": True, "groups": {"x": {"f1": 1.0}}, "setting": "greedy"}

    draws = lambda: (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for generator in (random.seed, np.random.seed, torch.manual_seed):
        generator(3)
    expected = draws()
    for generator in (random.seed, np.random.seed, torch.manual_seed):
        generator(3)
    accelerator = CurveAccelerator()
    runs.curve_point(accelerator, tmp_path, Args(str(tmp_path)), 4, evaluate)
    assert draws() == expected  # training goes on drawing what it would have without the curve
    assert seen == [[str(i) for i in range(runs.N_VAL)]]  # the first N_VAL dev questions, in file order
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["stage"] == "val" and line["update"] == 4 and line["val"] == {"f1": 0.25, "n": 100}
    assert set(line["budget"]) == {"generated_tokens", "cpu_s"}
    assert accelerator.logged == [(4, {"val/f1": 0.25, "val/n": 100})]
    runs.curve_point(accelerator, tmp_path / "metrics.jsonl", Args(str(tmp_path / "none")), 5, evaluate)
    assert len(seen) == 1  # no dev split: no point
    short = Args(str(tmp_path))
    short.n_eval = 7  # a run that evaluates 7 test questions validates on 7
    runs.curve_point(accelerator, tmp_path, short, 6, evaluate)
    assert seen[-1] == [str(i) for i in range(7)]
