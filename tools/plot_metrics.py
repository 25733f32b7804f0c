"""Draws the loss, learning-rate and throughput curves of a metrics JSONL file (written by training) to a PNG.

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


def plot(train, valid, output):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
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
    print(f"wrote {args.output} ({len(train)} training and {len(valid)} validation points)")


if __name__ == "__main__":
    main()
