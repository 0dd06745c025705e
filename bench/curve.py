"""A learning curve over seeds from the runs' metrics.jsonl: a markdown table to paste into docs, and a picture.

    python bench/curve.py runs/c3po-s0 runs/c3po-s1 runs/c3po-s2 --key rollout/leaf_reward --png docs/c3po_curve.png

The x axis is the update: the n-th metrics.jsonl line that holds --key (its iteration, step or round when the line
names one), its value the mean of the --window updates ending there. The table gives the mean over the runs and the
lowest and highest run at --points evenly spaced updates, then each evaluated stage's --eval_key (the lines
{"stage": ..., "eval": {...}}), so training signal and held-out score sit side by side. The picture (matplotlib,
pip install -e ".[plot]") draws the mean and the min-max band.
"""

import argparse
import json
from pathlib import Path

STEP_KEYS = ("iteration", "step", "round", "sft/step")  # what a line calls its update number


def read_run(folder, key, eval_key):
    """(updates as [(x, value)], evaluations as {stage: value}) of one run folder's metrics.jsonl."""
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (a run folder holds metrics.jsonl)")
    updates, evals = [], {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise SystemExit(f"{path}, line {n}: not json") from None
        if key in record:
            x = next((record[k] for k in STEP_KEYS if k in record), len(updates) + 1)
            updates.append((x, float(record[key])))
        if isinstance(record.get("eval"), dict) and eval_key in record["eval"]:
            evals[record["stage"]] = float(record["eval"][eval_key])
    if not updates:
        raise SystemExit(f"{path}: no line holds {key!r}")
    return updates, evals


def smooth(updates, window):
    """Each update's value as the mean of the `window` updates ending at it (fewer at the start)."""
    values = [v for _, v in updates]
    return [(x, sum(values[max(0, i + 1 - window) : i + 1]) / min(i + 1, window)) for i, (x, _) in enumerate(updates)]


def summarize(runs, points):
    """Rows (x, mean, low, high) at `points` evenly spaced updates of the shortest run."""
    n = min(len(u) for u in runs)
    picks = sorted({round(i * (n - 1) / max(points - 1, 1)) for i in range(points)})
    rows = []
    for i in picks:
        values = [u[i][1] for u in runs]
        rows.append((runs[0][i][0], sum(values) / len(values), min(values), max(values)))
    return rows


def table(args, runs, evals):
    lines = [f"| update | {args.key} mean | min | max |", "|---|---|---|---|"]
    lines += [f"| {x} | {m:.3f} | {lo:.3f} | {hi:.3f} |" for x, m, lo, hi in summarize(runs, args.points)]
    stages = [s for s in evals[0] if all(s in e for e in evals)]
    if stages:
        lines += ["", f"| stage | {args.eval_key} mean | min | max |", "|---|---|---|---|"]
        for s in stages:
            values = [e[s] for e in evals]
            lines.append(f"| {s} | {sum(values) / len(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    return "\n".join(lines)


def plot(args, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(runs, min(len(u) for u in runs))
    x = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(x, [r[1] for r in rows], label=f"mean of {len(runs)} runs" if len(runs) > 1 else "one run")
    if len(runs) > 1:
        ax.fill_between(x, [r[2] for r in rows], [r[3] for r in rows], alpha=0.3, label="min-max")
    ax.set_xlabel("update")
    ax.set_ylabel(args.key)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl), one per seed")
    p.add_argument("--key", required=True, help="the training signal, e.g. rollout/leaf_reward or rewards/accuracy")
    p.add_argument("--eval_key", default="f1", help="the held-out score of each evaluated stage")
    p.add_argument("--points", type=int, default=8, help="table rows")
    p.add_argument("--window", type=int, default=1, help="each value the mean of this many updates ending at it")
    p.add_argument("--png", default="", help="also draw the curve here")
    args = p.parse_args(argv)
    read = [read_run(r, args.key, args.eval_key) for r in args.runs]
    runs, evals = [smooth(r[0], args.window) for r in read], [r[1] for r in read]
    print(table(args, runs, evals))
    if args.png:
        plot(args, runs, args.png)
        print(f"curve: {args.png}")


if __name__ == "__main__":
    main()
