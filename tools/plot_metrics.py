"""Draws the loss, learning-rate and throughput curves of a metrics JSONL file (written by training) to a PNG, and,
for a run with --timing-log-level >= 1, where each iteration's time went (the phases stacked, max over ranks).

    python tools/plot_metrics.py runs/quickstart/tensorboard/metrics.jsonl --output curves.png
"""
import argparse
import json
import os
import sys


def read_metrics(path):
    train, valid = [], []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not a JSON line; pass the metrics.jsonl written by training")
            (valid if record.get("kind") == "valid" else train).append(record)
    if not train:
        raise ValueError(f"{path}: no training records; was it written with --log-interval?")
    return train, valid


PHASE_ORDER = ("batch-generator", "forward-compute", "backward-compute", "grads-all-reduce", "pipeline-send-recv",
               "optimizer", "loss-sync")


def phase_series(train):
    """(iterations, {phase: [ms per iteration at each]}) of the records that carry phase timers, phases in the
    loop's order (missing from a record: 0); ([], {}) when none does."""
    timed = [r for r in train if r.get("timers_max")]
    phases = [p for p in PHASE_ORDER if any(p in r["timers_max"] for r in timed)]
    return [r["iteration"] for r in timed], {p: [r["timers_max"].get(p, 0.0) for r in timed] for p in phases}


def plot(train, valid, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps_timed, phases = phase_series(train)
    fig, axes = plt.subplots(1, 4 if phases else 3, figsize=(20 if phases else 15, 4))
    steps = [r["iteration"] for r in train]
    axes[0].plot(steps, [r["lm_loss"] for r in train], label="train")
    if valid:
        axes[0].plot([r["iteration"] for r in valid], [r["lm_loss"] for r in valid], "o-", label="validation")
    axes[0].set(title="lm loss", xlabel="iteration")
    axes[0].legend()
    axes[1].plot(steps, [r["lr"] for r in train])
    axes[1].set(title="learning rate", xlabel="iteration")
    axes[2].plot(steps, [r["tokens_per_second"] for r in train])
    axes[2].set(title="tokens per second", xlabel="iteration")
    if phases:
        axes[3].stackplot(steps_timed, list(phases.values()), labels=list(phases))
        axes[3].plot(steps_timed, [r["ms_per_iteration"] for r in train if r.get("timers_max")], "k--",
                     label="iteration time")
        axes[3].set(title="time per iteration by phase (ms, max over ranks)", xlabel="iteration")
        axes[3].legend(fontsize="small", loc="lower left")
    fig.tight_layout()
    tmp = output + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, output)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="metrics.jsonl from a training run")
    parser.add_argument("--output", default="metrics.png")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.metrics):
        sys.exit(f"error: {args.metrics} does not exist; pass the metrics.jsonl of a run (--metrics-file, or "
                 "metrics.jsonl in --tensorboard-dir / --save)")
    try:
        train, valid = read_metrics(args.metrics)
    except ValueError as err:
        sys.exit(f"error: {err}")
    plot(train, valid, args.output)
    timed = len(phase_series(train)[0])
    print(f"wrote {args.output} ({len(train)} training and {len(valid)} validation points"
          + (f", phase timers at {timed})" if timed else ")"))


if __name__ == "__main__":
    main()
