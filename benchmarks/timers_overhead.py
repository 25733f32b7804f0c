"""What the phase timers cost and what they show: the document's 1.72B BLOOM through `deepspeed pretrain_bloom.py` on
one GPU at --timing-log-level 0, 1 and 2 (same flags otherwise), tokens/s per level, the level-1 breakdown and NVML
GPU utilization, checked against nvidia-smi sampled independently during the level-1 run.

    python3 benchmarks/timers_overhead.py --output $OUT/timers.json --metrics-dir $OUT/timers

About 4-5 minutes on one H200 (three launches of ~1 minute start-up each, 24 iterations of ~0.2 s). The sample
corpus (examples/data/sample.jsonl) is preprocessed first with the shipped tokenizer; the vocabulary is padded to
250880 as the document's. The first log window (iterations 1-4) holds start-up work and is left out of the
averages. The metrics files (one per level) go to --metrics-dir for tools/plot_metrics.py.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_MODEL = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--pad-vocab-size-to", "250880"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="results JSON")
    p.add_argument("--metrics-dir", required=True, help="where each level's metrics.jsonl goes")
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train-iters", type=int, default=24)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--timeout", type=int, default=150, help="seconds per launch")
    p.add_argument("--small", action="store_true", help="a tiny model (a smoke test of this script on CPU)")
    return p.parse_args(argv)


def preprocess(work):
    prefix = os.path.join(work, "sample")
    if not os.path.isfile(prefix + "_text_document.idx"):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", os.path.join(ROOT, "examples", "data", "sample.jsonl"), "--output-prefix", prefix,
                        "--vocab-file", os.path.join(ROOT, "examples", "tokenizer", "vocab.json"),
                        "--merge-file", os.path.join(ROOT, "examples", "tokenizer", "merges.txt"),
                        "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                        "--workers", "4"], check=True, cwd=ROOT)
    return prefix + "_text_document"


class SmiSampler:
    """nvidia-smi's utilization.gpu every 200 ms in the background: [(host time, percent)]."""

    def __init__(self):
        self.samples, self.proc = [], None
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip().split(",")[0])))
            except ValueError:
                pass

    def mean(self, start, end):
        values = [v for t, v in self.samples if start <= t <= end]
        return statistics.fmean(values) if values else None

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def launch(level, data, args, metrics):
    model = (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "64"] if args.small else DOC_MODEL)
    argv = model + [
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.train_iters), "--lr", "1e-4", "--clip-grad", "1.0", "--zero-stage",
        str(args.zero_stage), "--data-path", data, "--split", "98,2,0",
        "--vocab-file", os.path.join(ROOT, "examples", "tokenizer", "vocab.json"),
        "--merge-file", os.path.join(ROOT, "examples", "tokenizer", "merges.txt"),
        "--log-interval", str(args.log_interval), "--eval-interval", "100000", "--eval-iters", "0",
        "--timing-log-level", str(level), "--metrics-file", metrics, "--deepspeed"]
    if not args.small:
        argv += ["--bf16", "--loss-chunk-size", "8192"]
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["timeout", str(args.timeout), "deepspeed", "--num_gpus", "1", os.path.join(ROOT, "pretrain_bloom.py")] + argv
    print(f"== level {level}: {' '.join(cmd)}", flush=True)
    first_log, last_log, lines = None, None, []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"iteration +(\d+)/", line)
        if match:
            iteration = int(match.group(1))
            if iteration == args.log_interval:
                first_log = time.time()
            last_log = time.time()
            print("   " + line.split("INFO megatron.training: ")[-1].strip(), flush=True)
    proc.wait()
    if proc.returncode != 0:
        print("".join(lines[-40:]))
        raise RuntimeError(f"level {level} exited {proc.returncode}")
    with open(metrics) as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    return records, (first_log, last_log)


def summarize(level, records):
    timed = [r for r in records if r["iteration"] > records[0]["iteration"]]  # the first window: start-up
    out = {"level": level, "windows": len(timed),
           "tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in timed),
           "tokens_per_second_windows": [round(r["tokens_per_second"], 1) for r in timed],
           "ms_per_iteration": statistics.fmean(r["ms_per_iteration"] for r in timed),
           "mfu": statistics.fmean(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None}
    if level >= 1:
        phases = timed[0]["timers"].keys()
        out["timers_ms"] = {p: statistics.fmean(r["timers"][p] for r in timed) for p in phases}
        utils = [r["gpu_utilization"] for r in timed if r.get("gpu_utilization") is not None]
        out["gpu_utilization"] = statistics.fmean(utils) if utils else None
    return out


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.metrics_dir, exist_ok=True)
    data = preprocess(args.metrics_dir)
    results = {"model": "small" if args.small else "bloom-1b7 (24 x 2048, 16 heads, seq 2048, vocab 250880)",
               "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
               "zero_stage": args.zero_stage, "train_iters": args.train_iters, "log_interval": args.log_interval,
               "levels": {}}
    for level in args.levels:
        smi = SmiSampler() if level == 1 else None
        try:
            records, (start, end) = launch(level, data, args, os.path.join(args.metrics_dir, f"level{level}.jsonl"))
        finally:
            if smi is not None:
                smi.stop()
        summary = summarize(level, records)
        if smi is not None:  # nvidia-smi over the windows the averages use (after the first log line)
            summary["nvidia_smi_utilization"] = smi.mean(start, end)
        results["levels"][level] = summary
    base = results["levels"].get(0, {}).get("tokens_per_second")
    print(f"\n{'level':>5} {'tokens/s':>10} {'vs level 0':>10} {'ms/iter':>9} {'MFU':>6} {'GPU util':>9} "
          f"{'smi util':>9}")
    for level, s in results["levels"].items():
        ratio = s["tokens_per_second"] / base if base else float("nan")
        s["vs_level0"] = ratio
        mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "-"
        util = f"{s['gpu_utilization']:.1f}%" if s.get("gpu_utilization") is not None else "-"
        smi = f"{s['nvidia_smi_utilization']:.1f}%" if s.get("nvidia_smi_utilization") is not None else "-"
        print(f"{level:>5} {s['tokens_per_second']:>10.1f} {ratio:>10.4f} {s['ms_per_iteration']:>9.1f} {mfu:>6} "
              f"{util:>9} {smi:>9}")
    if 1 in results["levels"]:
        one = results["levels"][1]
        print("\nlevel-1 breakdown (ms per iteration, mean over the timed windows; sum "
              f"{sum(v for k, v in one['timers_ms'].items() if k != 'tp-collectives'):.1f} of "
              f"{one['ms_per_iteration']:.1f}):")
        for phase, ms in one["timers_ms"].items():
            print(f"  {phase:<20} {ms:9.2f}  {100 * ms / one['ms_per_iteration']:5.1f}%")
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    for level in results["levels"]:  # the curves and the phase panel (needs matplotlib; skipped without it)
        metrics = os.path.join(args.metrics_dir, f"level{level}.jsonl")
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), metrics, "--output",
                        metrics.replace(".jsonl", ".png")], cwd=ROOT)
    print(f"\nwrote {args.output}; metrics files in {args.metrics_dir}")


if __name__ == "__main__":
    main()
