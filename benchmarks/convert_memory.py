"""Peak RSS of merging our checkpoint into a Hugging Face folder, at two depths of the same width: the conversion
streams, so the deeper model's peak stays within 10% of the shallower one's.

    python benchmarks/convert_memory.py                          # 24 and 48 layers, hidden 2048, vocab 250880, bf16
    python benchmarks/convert_memory.py --vocab-size 50304       # less disk (the vocabulary only moves the embedding)
    python benchmarks/convert_memory.py --layers 2 4 --hidden-size 256 --num-attention-heads 4 --vocab-size 1024 --pp 2

For each depth: a source checkpoint (TP --tp x PP --pp, synthetic bf16 weights, written by the same streaming
writer) is made under --workdir, tools/merge_mp_partitions.py converts it in a fresh subprocess whose peak RSS
is reported, and both folders are removed before the next depth. The peak is the child's VmHWM (/proc/self/status:
anonymous and mapped file pages), not getrusage's ru_maxrss, which execve carries over: a vfork()ed child execs
from the parent's memory map and starts at the parent's high-water mark (here, that of writing a shard). A third
subprocess reports the peak RSS of the interpreter with the tool's imports alone. Prints each peak, the ratio of the deepest to the shallowest (exit 1 when it passes --max-ratio) and each peak against the model's
bytes. The default 48-layer run needs ~12 GB free in --workdir at once (source + output), the 24-layer ~7 GB.
"""
import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class SyntheticReader:
    """The reader interface of megatron.checkpoint.convert over generated weights: element (i, j) of tensor k is
    ((31 i + 7 j + 13 k) mod 251) / 251, so any window can be made, and checked, on its own."""

    def __init__(self, config, dtype):
        from megatron.checkpoint.format import expected_shapes
        self.shapes, self.dtype = expected_shapes(config), dtype
        self.keys = {name: k for k, name in enumerate(self.shapes)}

    def read(self, name, rows=None, cols=None, dtype=None):
        import torch
        shape = self.shapes[name]
        rows = rows or (0, shape[0])
        cols = (cols or (0, shape[1])) if len(shape) == 2 else None
        width = cols[1] - cols[0] if cols else 1
        out = torch.empty((rows[1] - rows[0],) + ((width,) if cols else ()), dtype=dtype or self.dtype)
        step = max(1, (1 << 22) // width)  # int64 scratch of at most 32 MB at a time
        for start in range(rows[0], rows[1], step):
            stop = min(start + step, rows[1])
            value = torch.arange(start, stop, dtype=torch.int64) * 31 + 13 * self.keys[name]
            if cols:
                value = value[:, None] + torch.arange(*cols, dtype=torch.int64)[None, :] * 7
            out[start - rows[0]:stop - rows[0]] = (value % 251).to(torch.float32) / 251
        return out

    def close(self):
        pass


def child(argv):
    """In a fresh process: runs the tool's main(argv) (or only its imports with --imports-only) and prints
    {"code", "peak_rss", "seconds"} as the last line."""
    import importlib.util
    start = time.perf_counter()
    spec = importlib.util.spec_from_file_location("merge_mp_partitions",
                                                  os.path.join(ROOT, "tools", "merge_mp_partitions.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    if argv == ["--imports-only"]:
        import safetensors.torch  # noqa: F401  what a conversion imports besides the tool's own modules
        import transformers  # noqa: F401
        from transformers import BloomConfig, GenerationConfig  # noqa: F401
        code = 0
    else:
        code = tool.main(argv)
    peak = peak_rss()
    print(json.dumps({"code": code, "peak_rss": peak, "seconds": time.perf_counter() - start}))
    return code


def peak_rss():
    """This process's peak resident set since its execve, in bytes (VmHWM; ru_maxrss where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def measure(argv):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--"] + argv, cwd=ROOT,
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the conversion failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def gb(nbytes):
    return f"{nbytes / 1e9:.2f} GB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=250880)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the source checkpoints")
    parser.add_argument("--pp", type=int, default=4, help="pipeline-parallel size of the source checkpoints")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--max-ratio", type=float, default=1.10)
    parser.add_argument("--output", help="write the figures as JSON")
    args = parser.parse_args(argv)

    import torch

    from megatron.checkpoint import convert
    from megatron.checkpoint.format import expected_shapes
    from megatron.config import ModelConfig

    baseline = measure(["--imports-only"])
    print(f"interpreter with the tool's imports: peak RSS {gb(baseline['peak_rss'])}", flush=True)
    results = []
    for layers in args.layers:
        config = ModelConfig(num_layers=layers, hidden_size=args.hidden_size,
                             num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                             seq_length=2048)
        model_bytes = sum(math.prod(shape) * 2 for shape in expected_shapes(config).values())
        free = shutil.disk_usage(args.workdir).free
        if free < 2.1 * model_bytes:
            print(f"error: --workdir {args.workdir} has {gb(free)} free; {layers} layers need about "
                  f"{gb(2.1 * model_bytes)} (source + output); free space, pass --workdir or a smaller "
                  "--vocab-size", file=sys.stderr)
            return 2
        work = tempfile.mkdtemp(prefix="convert_memory_", dir=args.workdir)
        try:
            source_reader = SyntheticReader(config, torch.bfloat16)
            start = time.perf_counter()
            source = convert.write_megatron_checkpoint(
                os.path.join(work, "src"), source_reader, config, args.tp, args.pp, precision="bf16",
                dtype=torch.bfloat16)
            written = time.perf_counter() - start
            out = os.path.join(work, "hf")
            figures = measure(["--model-path", source, "--output-path", out])
            spot_check(out, source_reader, layers)
            figures.update(layers=layers, parameters=model_bytes // 2, model_bytes=model_bytes,
                           write_seconds=written)
            results.append(figures)
            print(f"{layers} layers ({figures['parameters'] / 1e9:.2f}B parameters, {gb(model_bytes)} bf16, source "
                  f"TP {args.tp} x PP {args.pp}): peak RSS {gb(figures['peak_rss'])} = "
                  f"{figures['peak_rss'] / model_bytes:.2f}x the weights; conversion {figures['seconds']:.1f} s",
                  flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ratio = results[-1]["peak_rss"] / results[0]["peak_rss"]
    verdict = "within" if ratio <= args.max_ratio else "OVER"
    print(f"peak RSS {results[-1]['layers']} layers / {results[0]['layers']} layers = {ratio:.3f} ({verdict} "
          f"{args.max_ratio:.2f})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"baseline": baseline, "runs": results, "ratio": ratio, "vocab_size": args.vocab_size,
                       "hidden_size": args.hidden_size}, f, indent=2)
    return 0 if ratio <= args.max_ratio else 1


def spot_check(folder, reader, layers):
    """The HF output holds the synthetic values: the embedding's last rows and the last layer's dense weight."""
    import torch
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"] if os.path.isfile(index) else None
    last = layers - 1
    checks = {"transformer.word_embeddings.weight": "embedding.word_embeddings.weight",
              f"transformer.h.{last}.self_attention.dense.weight": f"layers.{last}.self_attention.dense.weight"}
    for hf_name, name in checks.items():
        file = weight_map[hf_name] if weight_map else "model.safetensors"
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            rows = reader.shapes[name][0]
            got = f.get_slice(hf_name)[rows - 64:rows]
        if not torch.equal(got, reader.read(name, rows=(rows - 64, rows))):
            raise RuntimeError(f"{folder}: {hf_name} does not hold the source's values")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[3:]))
    sys.exit(main())
