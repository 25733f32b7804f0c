"""Loss curves of several TP x PP x DP layouts against the single-process run (same model, data, global batch).

    python benchmarks/layout_equivalence.py --data-path DATA --vocab-dir examples/tokenizer        # CPU, tiny model
    python benchmarks/layout_equivalence.py --data-path DATA --gpu --layers 4 --hidden 512 --iters 50 \\
        --layouts tp2:2 pp2:2 dp2:2 tp2pp2:4 tp4pp2:8 zero3offload:2

Prints, per layout, the largest absolute difference of the per-iteration lm loss from the 1-process curve.
Layouts: NAME:PROCS where NAME combines tpN, ppN and dpN (dp is implied by PROCS), zeroN, offload, bf16.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_flags(name):
    flags = []
    tp = re.search(r"tp(\d+)", name)
    pp = re.search(r"pp(\d+)", name)
    zero = re.search(r"zero(\d+)", name)
    if tp:
        flags += ["--tensor-model-parallel-size", tp.group(1)]
    if pp:
        flags += ["--pipe-parallel-size", pp.group(1)]
    if zero:
        flags += ["--zero-stage", zero.group(1)]
    if "offload" in name:
        flags += ["--cpu-offload"] + ([] if zero else ["--zero-stage", "3"])
    if "bf16" in name:
        flags += ["--bf16"]
    return flags


def run(args, name, procs, workdir):
    metrics = os.path.join(workdir, f"{name}.jsonl")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(procs), "--master_port",
           str(port), os.path.join(ROOT, "pretrain_bloom.py"),
           "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
           "--seq-length", str(args.seq), "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch),
           "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
           "--warmup", "2", "--clip-grad", "1.0", "--data-path", args.data_path, "--split", "98,2,0",
           "--vocab-file", os.path.join(args.vocab_dir, "vocab.json"),
           "--merge-file", os.path.join(args.vocab_dir, "merges.txt"), "--pad-vocab-size-to", "8192",
           "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--metrics-file", metrics,
           "--deepspeed"] + layout_flags(name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if not args.gpu:
        env["DS_ACCELERATOR"] = "cpu"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr[-2000:]
    losses = {}
    for line in open(metrics):
        record = json.loads(line)
        if record["kind"] == "train":
            losses[record["iteration"]] = record["lm_loss"]
    return [losses[i] for i in sorted(losses)], None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", required=True)
    p.add_argument("--vocab-dir", default=os.path.join(ROOT, "examples", "tokenizer"))
    p.add_argument("--layouts", nargs="+", default=["tp2:2", "pp2:2", "dp2zero1:2", "tp2pp2:4", "tp4pp2:8"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--gpu", action="store_true")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="layouts_")
    base, err = run(args, "baseline", 1, workdir)
    if base is None:
        raise SystemExit(f"baseline failed:\n{err}")
    print(f"baseline (1 process): first loss {base[0]:.6f}, last loss {base[-1]:.6f}")
    for spec in args.layouts:
        name, procs = spec.split(":")
        losses, err = run(args, name, int(procs), workdir)
        if losses is None:
            print(f"{name:14s} {procs} processes: FAILED\n{err}")
            continue
        diff = max(abs(a - b) for a, b in zip(losses, base))
        print(f"{name:14s} {procs} processes: max |loss - baseline| over {len(losses)} iterations = {diff:.2e}")


if __name__ == "__main__":
    main()
