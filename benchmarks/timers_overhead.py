"""What the phase timers cost and what they show: the document's 1.72B BLOOM through `deepspeed pretrain_bloom.py` on
one GPU, with --timing-log-level switched between log windows of ONE run (0, 1, 2, 0, 1, 2, ...: interleaved, so
the device's drift and run-to-run noise cancel), tokens/s per level, the level-1 breakdown and NVML GPU
utilization, checked against nvidia-smi sampled independently over the same windows.

    python3 benchmarks/timers_overhead.py --output $OUT/timers.json --metrics-dir $OUT/timers

About 3 minutes on one H200: one launch (~1 minute of start-up), micro batch 4 x accumulation 8 (global batch 32,
the document's), 2 iterations per log window, a warm-up window, then --rounds rounds of one window per level.
The sample corpus (examples/data/sample.jsonl) is preprocessed first with the shipped tokenizer; the vocabulary is
padded to 250880 as the document's. The run's metrics.jsonl goes to --metrics-dir for tools/plot_metrics.py.

The training process is this file under the deepspeed launcher (`--worker`): pretrain_bloom.main with a callback
that sets the next window's level after each log line (Trainer.set_timing_level) and records each window.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DOC_MODEL = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--pad-vocab-size-to", "250880", "--bf16", "--loss-chunk-size",
             "8192"]
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--max-position-embeddings", "64"]
WINDOWS_ENV = "TIMERS_OVERHEAD_WINDOWS"  # the worker writes its windows here
LEVELS_ENV = "TIMERS_OVERHEAD_LEVELS"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="results JSON")
    p.add_argument("--metrics-dir", required=True, help="where the run's metrics.jsonl (and its plot) go")
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=8, help="windows per level (one per round)")
    p.add_argument("--log-interval", type=int, default=2, help="iterations per window")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--timeout", type=int, default=420, help="seconds for the launch")
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


def worker(argv):
    """Inside the deepspeed launcher: pretrain_bloom.main with the level-rotating callback."""
    import pretrain_bloom
    from megatron.training import Callback

    levels = [int(x) for x in os.environ[LEVELS_ENV].split(",")]

    class RotateLevels(Callback):
        def __init__(self):
            self.windows, self.count, self.start = [], 0, None

        def on_train_start(self, trainer):
            self.start = time.time()

        def on_log(self, trainer, iteration, metrics):
            now = time.time()
            keep = ("iteration", "timing_log_level", "tokens_per_second", "ms_per_iteration", "mfu", "timers",
                    "gpu_utilization", "window_iterations")
            self.windows.append({**{k: metrics.get(k) for k in keep}, "start": self.start, "end": now})
            trainer.set_timing_level(levels[self.count % len(levels)])  # the first window (warm-up) ran at 0
            self.count += 1

        def on_train_end(self, trainer, summary):
            if trainer.state.rank == 0:
                with open(os.environ[WINDOWS_ENV], "w") as f:
                    json.dump(self.windows, f)

    rotate = RotateLevels()

    class WindowStart(Callback):  # the window's host time starts after the previous log line's work
        def on_iteration_start(self, trainer, iteration):
            if (iteration - 1) % trainer.config.logging.log_interval == 0:
                rotate.start = time.time()

    pretrain_bloom.main(argv, callbacks=[rotate, WindowStart()])


def run(args, data):
    windows_file = os.path.join(args.metrics_dir, "windows.json")
    metrics = os.path.join(args.metrics_dir, "metrics.jsonl")
    for path in (windows_file, metrics):
        if os.path.exists(path):
            os.remove(path)
    iters = args.log_interval * (1 + args.rounds * len(args.levels))
    argv = (SMALL_MODEL if args.small else DOC_MODEL) + [
        "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(iters), "--lr", "1e-4", "--clip-grad", "1.0", "--zero-stage", str(args.zero_stage),
        "--data-path", data, "--split", "98,2,0",
        "--vocab-file", os.path.join(ROOT, "examples", "tokenizer", "vocab.json"),
        "--merge-file", os.path.join(ROOT, "examples", "tokenizer", "merges.txt"),
        "--log-interval", str(args.log_interval), "--eval-interval", "100000", "--eval-iters", "0",
        "--timing-log-level", "0", "--metrics-file", metrics, "--deepspeed"]
    cmd = ["timeout", str(args.timeout), "deepspeed", "--num_gpus", "1", os.path.abspath(__file__), "--worker"] + argv
    print("== " + " ".join(cmd), flush=True)
    env = {**os.environ, WINDOWS_ENV: windows_file, LEVELS_ENV: ",".join(map(str, args.levels))}
    smi = SmiSampler()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = []
        for line in proc.stdout:
            tail = (tail + [line])[-60:]
            if "megatron.training:" in line:
                print("   " + line.split("INFO megatron.training: ")[-1].rstrip(), flush=True)
        proc.wait()
    finally:
        smi.stop()
    if proc.returncode != 0 or not os.path.isfile(windows_file):
        print("".join(tail))
        raise RuntimeError(f"the training run exited {proc.returncode}")
    with open(windows_file) as f:
        windows = json.load(f)
    for window in windows:
        window["nvidia_smi_utilization"] = smi.mean(window["start"], window["end"])
    return windows[1:], iters  # the first window: start-up


def summarize(windows, levels):
    by_level = {level: [w for w in windows if w["timing_log_level"] == level] for level in levels}
    out = {}
    for level, ws in by_level.items():
        s = {"windows": len(ws), "tokens_per_second": statistics.fmean(w["tokens_per_second"] for w in ws),
             "tokens_per_second_windows": [round(w["tokens_per_second"], 1) for w in ws],
             "ms_per_iteration": statistics.fmean(w["ms_per_iteration"] for w in ws),
             "mfu": statistics.fmean(w["mfu"] for w in ws) if ws[0].get("mfu") is not None else None}
        if level >= 1:
            s["timers_ms"] = {p: statistics.fmean(w["timers"][p] for w in ws) for p in ws[0]["timers"]}
            for key in ("gpu_utilization", "nvidia_smi_utilization"):
                values = [w[key] for w in ws if w.get(key) is not None]
                s[key] = statistics.fmean(values) if values else None
        out[level] = s
    if 0 in by_level:  # each round's level-L window against the same round's level-0 window
        for level in levels:
            ratios = [w["tokens_per_second"] / z["tokens_per_second"] for w, z in zip(by_level[level], by_level[0])]
            out[level]["vs_level0"] = statistics.fmean(ratios)
            out[level]["vs_level0_stdev"] = statistics.stdev(ratios) if len(ratios) > 1 else None
            out[level]["vs_level0_rounds"] = [round(r, 4) for r in ratios]
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # the launcher puts --local_rank=N first
        return worker([a for a in argv if a != "--worker"])
    args = parse_args(argv)
    os.makedirs(args.metrics_dir, exist_ok=True)
    data = preprocess(args.metrics_dir)
    started = time.time()
    windows, iters = run(args, data)
    levels = summarize(windows, args.levels)
    results = {"model": "small" if args.small else "bloom-1b7 (24 x 2048, 16 heads, seq 2048, vocab 250880, bf16)",
               "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
               "zero_stage": args.zero_stage, "train_iters": iters, "log_interval": args.log_interval,
               "rounds": args.rounds, "wall_seconds": round(time.time() - started, 1), "levels": levels,
               "windows": windows}
    print(f"\n{'level':>5} {'tokens/s':>10} {'vs level 0':>17} {'ms/iter':>9} {'MFU':>6} {'GPU util':>9} "
          f"{'smi util':>9}")
    for level, s in levels.items():
        ratio = (f"{s['vs_level0']:.4f} +- {s['vs_level0_stdev'] or 0:.4f}" if "vs_level0" in s else "-")
        mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "-"
        util = f"{s['gpu_utilization']:.1f}%" if s.get("gpu_utilization") is not None else "-"
        smi = f"{s['nvidia_smi_utilization']:.1f}%" if s.get("nvidia_smi_utilization") is not None else "-"
        print(f"{level:>5} {s['tokens_per_second']:>10.1f} {ratio:>17} {s['ms_per_iteration']:>9.1f} {mfu:>6} "
              f"{util:>9} {smi:>9}")
    print("(vs level 0: mean +- stdev over rounds of the ratio to the same round's level-0 window)")
    if 1 in levels:
        one = levels[1]
        print("\nlevel-1 breakdown (ms per iteration, mean over its windows; phases sum to "
              f"{sum(v for k, v in one['timers_ms'].items() if k != 'tp-collectives'):.1f} of "
              f"{one['ms_per_iteration']:.1f}):")
        for phase, ms in one["timers_ms"].items():
            print(f"  {phase:<20} {ms:9.2f}  {100 * ms / one['ms_per_iteration']:5.1f}%")
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    metrics = os.path.join(args.metrics_dir, "metrics.jsonl")  # curves + phase panel (needs matplotlib)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), metrics, "--output",
                    os.path.join(args.metrics_dir, "metrics.png")], cwd=ROOT)
    print(f"\nwrote {args.output}; metrics in {args.metrics_dir}")


if __name__ == "__main__":
    main()
