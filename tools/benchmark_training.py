"""Training throughput of our BLOOM (the real pretrain path on DeepSpeed) against HF BloomForCausalLM.

    python tools/benchmark_training.py                       # the document's 1.72B model, micro 4, accumulation 8
    python tools/benchmark_training.py --ab --hf-compile --profile
                                  # ours eager, with --compile-blocks, with --fused-elementwise; HF eager and compiled
    python tools/benchmark_training.py --skip-hf --attention-variants flex,flex-safe,sdpa-cudnn
    python tools/benchmark_training.py --small --iters 2     # tiny model for a CPU smoke test

Each side runs in its own subprocess (so memory is measured cleanly) with the same shapes, micro batch, gradient
accumulation, bf16 and fused AdamW. Printed for each: tokens/s, model TFLOP/s (Megatron's formula), MFU against
the GEMM rate measured on this device, peak memory, and the ratios to HF eager and HF + torch.compile. With
--profile, one more step is profiled per side: kernel time by category, the step's wall time and its idle share.
A side that fails is reported and the others still run.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DOC_MODEL = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=250880)
SMALL_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1024)

# --attention-variants: name -> (--attention-impl, FlexAttention kernel_options, SDPA backends[, FlexAttention's
# torch.compile mode]); all exact ALiBi.
# "safe": every causal row keeps its diagonal key and the causal blocks are contiguous (both true for this mask).
_SAFE = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}
ATTENTION_VARIANTS = {
    "cudnn": ("cudnn", None, None),
    "flex": ("flex", None, None),
    "flex-safe": ("flex", _SAFE, None),
    "flex-tma": ("flex", {**_SAFE, "USE_TMA": True}, None),
    "flex-128x64": ("flex", {**_SAFE, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8,
                             "fwd_num_stages": 3}, None),
    "flex-flash": ("flex", {"BACKEND": "FLASH"}, None),  # needs flash-attn's CuTe DSL package
    "flex-autotune": ("flex", _SAFE, None, "max-autotune-no-cudagraphs"),  # block sizes tuned at compile time
    "sdpa": ("sdpa", None, None),
    "sdpa-cudnn": ("sdpa", None, ["CUDNN_ATTENTION"]),
    "sdpa-efficient": ("sdpa", None, ["EFFICIENT_ATTENTION"]),
    "fused": ("fused", None, None),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8, help="micro batches per optimizer step")
    p.add_argument("--iters", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--warmup-iters", type=int, default=1)
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--attention-impl", default="auto", choices=["auto", "cudnn", "flex", "sdpa", "fused", "torch"])
    p.add_argument("--loss-chunk-size", type=int, default=8192)
    p.add_argument("--fused-layernorm", action="store_true")
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--only", choices=["ours", "hf"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip-hf", action="store_true", help="no HF eager side")
    p.add_argument("--hf-compile", action="store_true",
                   help="also run HF BloomForCausalLM wrapped in torch.compile (same shapes, bf16 autocast, "
                        "fused AdamW)")
    p.add_argument("--ab", action="store_true",
                   help="also run ours with --compile-blocks (ours-block: one compiled region per block) and with "
                        "--fused-elementwise (ours-regions: three compiled regions per block)")
    p.add_argument("--fused-elementwise", action="store_true", help="ours: the three fused elementwise regions")
    p.add_argument("--compile-blocks", action="store_true", help="ours: each block as one compiled region")
    p.add_argument("--no-gemm-epilogues", action="store_true",
                   help="ours: the MLP's GeLU gradient in a kernel of its own, not the dgrad GEMM's epilogue (A/B)")
    p.add_argument("--inductor-config", default=None, metavar="KEY=VALUE,...",
                   help="ours: torch._inductor.config settings for the compiled blocks (A/B), e.g. "
                        "coordinate_descent_tuning=True")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="ours: weight gradients summed into .grad by autograd's add, not by their GEMM (A/B)")
    p.add_argument("--attention-variants", default=None, metavar="A,B,...",
                   help="also run ours once per attention variant: " + ", ".join(ATTENTION_VARIANTS))
    p.add_argument("--attention-variant", choices=list(ATTENTION_VARIANTS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the HF side: torch.compile
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one more step and print GPU time by category")
    p.add_argument("--profile-top", type=int, default=15, metavar="N",
                   help="with --profile, also print the N kernels with the most GPU time")
    p.add_argument("--gaps", action="store_true",
                   help="after timing (CUDA), trace one more step and say where the GPU sat idle (each gap > 10 us "
                        "by the Python frames the host was in, and the synchronizing calls with their callers)")
    p.add_argument("--origins", default=None, metavar="TEXT,...",
                   help="with --gaps: for the kernels whose names contain one of these texts, the host op and "
                        "Python frames that launched them")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("communication", ("nccl", "allreduce", "all_reduce", "gloo")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_adam")),
    ("loss", ("log_softmax", "logsoftmax", "nll_loss", "cross_entropy")),
    ("attention", ("flash", "flex", "attention", "softmax", "fmha", "sdpa", "triton_tem", "alibi")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "sm90", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
]


def categorize(name):
    lower = name.lower()
    for category, keys in CATEGORIES:
        if any(key in lower for key in keys):
            return category
    return "elementwise/other"


def _profile(step, device, top):
    """GPU (or CPU) self time of one step by category, in ms, the `top` kernels [(ms, calls, name)], and the
    step's wall time in ms (its idle share is 1 - kernel time / wall time: one stream, kernels do not overlap)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        _sync(device)
        PROFILE_WALL_MS.append(1000 * (time.perf_counter() - start))
    totals, kernels = {}, []
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0:
            totals[categorize(event.key)] = totals.get(categorize(event.key), 0.0) + us / 1000
            kernels.append((us / 1000, event.count, event.key[:110]))
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), sorted(kernels, reverse=True)[:top]


PROFILE = {}
TOP_KERNELS = []
GAPS = {}
GAP_US = 10  # a kernel-free interval longer than this counts as idle


def _own_frames(names, depth=3):
    """The innermost `depth` frames of this repo or DeepSpeed in a list of Python frame names (innermost first)."""
    keep = [n for n in names if ("megatron" in n or "deepspeed" in n or "benchmark" in n or "pretrain" in n)
            and "torch/" not in n]
    return " < ".join(keep[:depth]) or (names[0] if names else "?")


def _kernel_origins(events, patterns, top=8):
    """{pattern: [[ms, count, "op < op < frames"]]}: which host ops (innermost first) and Python frames of this repo
    or DeepSpeed launched the traced kernels whose names contain pattern, matched through the launch's correlation
    id; one sweep per host thread over its nested intervals."""
    wanted = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            pattern = next((p for p in patterns if p in e["name"]), None)
            if pattern is not None and "correlation" in e.get("args", {}):
                wanted[e["args"]["correlation"]] = (pattern, e.get("dur", 0) / 1000)
    by_thread = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("cpu_op", "python_function"):
            by_thread.setdefault(e.get("tid"), []).append((e["ts"], 0, e["ts"] + e.get("dur", 0), e["name"], e["cat"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("args", {}).get("correlation") in wanted:
            by_thread.setdefault(e.get("tid"), []).append((e["ts"], 1, e["ts"], e["args"]["correlation"], "launch"))
    found = {pattern: {} for pattern in patterns}
    for items in by_thread.values():
        stack = []  # the host intervals open at the current time, outermost first
        for ts, _, finish, name, cat in sorted(items, key=lambda i: (i[0], i[1], -i[2])):
            stack = [s for s in stack if s[0] >= ts]  # not only the top: a profiler's intervals may overlap
            if cat != "launch":
                stack.append((finish, name, cat))
                continue
            pattern, ms = wanted[name]
            ops = [n for _, n, c in reversed(stack) if c == "cpu_op"]
            key = " < ".join(ops[:2] + [_own_frames([n for _, n, c in reversed(stack) if c == "python_function"])])
            total, n = found[pattern].get(key, (0.0, 0))
            found[pattern][key] = (total + ms, n + 1)
    return {p: sorted(([ms, n, key] for key, (ms, n) in keys.items()), reverse=True)[:top]
            for p, keys in found.items()}


def _idle_gaps(step, device, top=20, origins=()):
    """Traces one step (CPU + CUDA, Python stacks) and attributes the device's idle time: each interval with no
    kernel, copy or memset running that is longer than GAP_US, grouped by the Python frames the host thread was in
    when the interval began. Then runs one more step under torch.cuda.set_sync_debug_mode("warn") and groups the
    synchronizing calls by their caller. Returns {"idle_ms", "gaps", "by_frames": [[ms, count, frames]],
    "syncs": [[count, caller]], "origins": _kernel_origins(..., origins)}."""
    import tempfile
    import traceback
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize(device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    found = _kernel_origins(events, origins) if origins else {}
    device_ops = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    frames = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "python_function")
    groups, idle, count, end = {}, 0.0, 0, device_ops[0][1] if device_ops else 0
    for begin, finish in device_ops[1:]:
        if begin - end > GAP_US:
            inside = sorted((f for f in frames if f[0] <= end <= f[1]), key=lambda f: f[1] - f[0])
            key = _own_frames([f[2] for f in inside])
            ms, n = groups.get(key, (0.0, 0))
            groups[key] = (ms + (begin - end) / 1000, n + 1)
            idle += (begin - end) / 1000
            count += 1
        end = max(end, finish)
    syncs = {}

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            names = [f"{fr.filename}({fr.lineno}): {fr.name}" for fr in reversed(traceback.extract_stack()[:-1])]
            key = _own_frames(names)
            syncs[key] = syncs.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    by_frames = sorted(([ms, n, key] for key, (ms, n) in groups.items()), reverse=True)[:top]
    return {"idle_ms": idle, "gaps": count, "by_frames": by_frames,
            "syncs": sorted(([n, key] for key, n in syncs.items()), reverse=True)[:top], "origins": found}
PROFILE_WALL_MS = []


def _timed(step, args, device):
    import torch
    for _ in range(args.warmup_iters):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / args.iters
    if args.profile:
        by_category, top = _profile(step, device, args.profile_top)
        PROFILE.update(by_category)
        TOP_KERNELS.extend(top)
    if args.gaps and device.type == "cuda":
        GAPS.update(_idle_gaps(step, device, origins=args.origins.split(",") if args.origins else ()))
    return seconds


def run_ours(args, shape):
    import torch
    from megatron.arguments import load_and_resolve
    from megatron.initialize import initialize_distributed, set_random_seeds, shutdown_distributed
    from megatron.training import setup_engine, train_step
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.data.samplers import build_pretraining_data_loader

    global_batch = args.micro_batch_size * args.grad_accum
    argv = ["--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
            "--num-attention-heads", str(shape["num_attention_heads"]), "--seq-length", str(shape["seq_length"]),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(global_batch),
            "--train-iters", str(args.iters + args.warmup_iters + 1), "--lr", "1e-4", "--mock-data",
            "--mock-vocab-size", str(shape["vocab_size"]), "--pad-vocab-size-to", str(shape["vocab_size"]),
            "--attention-impl", args.attention_impl, "--loss-chunk-size", str(args.loss_chunk_size),
            "--zero-stage", str(args.zero_stage), "--deepspeed"]
    if torch.cuda.is_available():
        argv.append("--bf16")
    if args.checkpoint_activations:
        argv.append("--checkpoint-activations")
    if args.fused_layernorm:
        argv.append("--fused-layernorm")
    if args.fused_elementwise:
        argv.append("--fused-elementwise")
    if args.compile_blocks:
        argv.append("--compile-blocks")
    if args.no_gemm_epilogues:
        argv.append("--no-gemm-epilogues")
    if args.inductor_config:
        import ast

        import torch._inductor.config as inductor_config
        for item in args.inductor_config.split(","):
            key, value = item.split("=", 1)
            setattr(inductor_config, key, ast.literal_eval(value))
    if args.no_gradient_accumulation_fusion:
        argv.append("--no-gradient-accumulation-fusion")
    if args.attention_variant:
        from megatron.model import attention
        variant = ATTENTION_VARIANTS[args.attention_variant]
        impl, attention.FLEX_KERNEL_OPTIONS, attention.SDPA_BACKENDS, *mode = variant
        attention.FLEX_COMPILE_MODE = mode[0] if mode else None
        argv[argv.index("--attention-impl") + 1] = impl
    config, ds_config, _ = load_and_resolve(argv)
    state = initialize_distributed(config.parallel)
    set_random_seeds(config.model.seed, state)
    engine, _ = setup_engine(config, ds_config, state)
    total = (args.iters + args.warmup_iters + int(args.profile) + 2 * int(args.gaps)) * global_batch
    loader = build_pretraining_data_loader(MockGPTDataset(total, shape["seq_length"], shape["vocab_size"]), 0,
                                           args.micro_batch_size, 0, 1, num_workers=2 if torch.cuda.is_available()
                                           else 0)
    it = iter(loader)
    losses = []
    seconds = _timed(lambda: losses.append(train_step(engine, it, args.grad_accum, False)), args, engine.device)
    shutdown_distributed()
    return seconds, engine.device, losses


def run_hf(args, shape):
    import torch
    from transformers import BloomConfig, BloomForCausalLM
    from megatron.data.mock_dataset import MockGPTDataset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = BloomConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         n_layer=shape["num_layers"], n_head=shape["num_attention_heads"])
    model = BloomForCausalLM(config).to(device)
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if args.compile else model  # compiled at the warm-up step
    data = MockGPTDataset(10 ** 6, shape["seq_length"] - 1, shape["vocab_size"])
    cursor = [0]
    losses = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        total = 0.0
        for _ in range(args.grad_accum):
            rows = [data[cursor[0] + i]["text"] for i in range(args.micro_batch_size)]
            cursor[0] += args.micro_batch_size
            ids = torch.tensor(rows, device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = forward(ids, labels=ids).loss / args.grad_accum
            loss.backward()
            total += loss.detach()  # one host sync per step, as ours
        total = total.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)

    return _timed(step, args, device), device, losses


def measure(args):
    """Runs one side in this process and returns its figures."""
    import torch
    from megatron.training.metrics import measure_matmul_tflops, model_flops_per_iteration

    shape = SMALL_MODEL if args.small else DOC_MODEL
    seconds, device, losses = (run_ours if args.only == "ours" else run_hf)(args, shape)
    global_batch = args.micro_batch_size * args.grad_accum
    tokens = global_batch * shape["seq_length"]
    flops = model_flops_per_iteration(global_batch, shape["seq_length"], shape["num_layers"], shape["hidden_size"],
                                      shape["vocab_size"], args.checkpoint_activations)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    gc.collect()
    gemm = measure_matmul_tflops(device)
    tflops = flops / seconds / 1e12
    return {"side": args.only, "profile_wall_ms": PROFILE_WALL_MS[-1] if PROFILE_WALL_MS else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "seconds_per_iteration": seconds, "tokens_per_second": tokens / seconds, "model_tflops": tflops,
            "gemm_tflops": gemm, "mfu": tflops / gemm, "peak_memory_gib": peak_mem, "losses": losses,
            "profile_ms": dict(PROFILE), "top_kernels": list(TOP_KERNELS), "gaps": dict(GAPS)}


def plan_sides(args):
    """[(label, child flags)]: ours, then its A/B and attention variants, then HF eager and HF + torch.compile."""
    sides = [("ours", [])]
    if args.ab:  # the new path first: a run cut short by a time limit still has it
        sides += [("ours-block", ["--compile-blocks"]), ("ours-regions", ["--fused-elementwise"])]
    for name in (args.attention_variants.split(",") if args.attention_variants else []):
        if name not in ATTENTION_VARIANTS:
            raise SystemExit(f"--attention-variants: unknown variant {name!r}; choose from "
                             f"{', '.join(ATTENTION_VARIANTS)}")
        sides.append((f"ours[{name}]", ["--attention-variant", name]))
    if not args.skip_hf:
        sides.append(("hf", []))
    if args.hf_compile:
        sides.append(("hf-compile", ["--compile"]))
    return sides


def _run_side(label, child_flags, base):
    """One side in its own process: its result dict, or None (the failure is printed)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    only = "hf" if label.startswith("hf") else "ours"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *base, *child_flags, "--only", only], env=env,
                          capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        print(f"benchmark side {label!r} failed (exit {proc.returncode}); see the output above", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    args = parse_args(argv)
    if args.only:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    base, given = [], list(argv if argv is not None else sys.argv[1:])
    while given:  # the children get the shared flags, not the parent's list of sides
        arg = given.pop(0)
        if arg == "--attention-variants":
            given.pop(0)
        elif arg not in ("--skip-hf", "--hf-compile", "--ab") and not arg.startswith("--attention-variants="):
            base.append(str(arg))
    results = {}
    for label, child_flags in plan_sides(args):
        result = _run_side(label, child_flags, base)
        if result is not None:  # printed as it lands, so a run cut short keeps what it measured
            results[label] = result
            mem = result["peak_memory_gib"]
            print(f"side {label}: {result['tokens_per_second']:.1f} tokens/s, {result['model_tflops']:.2f} TFLOP/s"
                  + (f", peak {mem:.1f} GiB" if mem is not None else "")
                  + ", losses " + " ".join(f"{loss:.4f}" for loss in result["losses"]), flush=True)
    shape = SMALL_MODEL if args.small else DOC_MODEL
    print(f"model {shape}, micro batch {args.micro_batch_size}, accumulation {args.grad_accum}, "
          f"checkpoint activations {args.checkpoint_activations}, attention {args.attention_impl}")
    width = max([6] + [len(label) for label in results])
    print(f"{'':{width}s} {'tokens/s':>10s} {'TFLOP/s':>9s} {'MFU':>7s} {'GEMM TFLOP/s':>13s} {'peak GiB':>9s}"
          f" {'vs hf':>6s} {'vs hf-compile':>13s}")
    for side, r in results.items():
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
        ratios = [f"{r['tokens_per_second'] / results[ref]['tokens_per_second']:.2f}x" if ref in results else "n/a"
                  for ref in ("hf", "hf-compile")]
        print(f"{side:{width}s} {r['tokens_per_second']:10.1f} {r['model_tflops']:9.2f} {100 * r['mfu']:6.1f}% "
              f"{r['gemm_tflops']:13.1f} {mem:>9s} {ratios[0]:>6s} {ratios[1]:>13s}")
    for side, r in results.items():
        if r.get("profile_ms"):
            total = sum(r["profile_ms"].values())
            wall = r.get("profile_wall_ms")
            idle = f", step wall {wall:.1f} ms, idle {wall - total:.1f} ms" if wall else ""
            print(f"{side} profile of one step ({total:.1f} ms of kernel time{idle}): " + ", ".join(
                f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in r["profile_ms"].items()))
            for ms, calls, name in r.get("top_kernels", []):
                print(f"  {ms:8.1f} ms {calls:5d}x [{categorize(name)}] {name}")
    for side, r in results.items():
        gaps = r.get("gaps")
        if gaps:
            print(f"{side} idle intervals > {GAP_US} us in one traced step: {gaps['gaps']}, {gaps['idle_ms']:.1f} ms; "
                  "by the host's frames when each began:")
            for ms, n, key in gaps["by_frames"]:
                print(f"  {ms:8.2f} ms {n:5d}x {key}")
            print(f"{side} synchronizing calls in one step, by caller:")
            for n, key in gaps["syncs"]:
                print(f"  {n:5d}x {key}")
            for pattern, rows in gaps.get("origins", {}).items():
                print(f"{side} kernels named *{pattern}*, by the host op and frames that launched them:")
                for ms, n, key in rows:
                    print(f"  {ms:8.2f} ms {n:5d}x {key}")
    for ref in ("hf", "hf-compile"):
        if "ours" in results and ref in results:
            ours, other = results["ours"], results[ref]
            ratio = ours["tokens_per_second"] / other["tokens_per_second"]
            line = f"ratio ours/{ref}: throughput {ratio:.2f}x"
            if ours["peak_memory_gib"] and other["peak_memory_gib"]:
                line += f", peak memory {ours['peak_memory_gib'] / other['peak_memory_gib']:.2f}x"
            print(line)
            results["ratio" if ref == "hf" else "ratio_hf_compile"] = ratio
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    if len(results) < len(plan_sides(args)):
        raise SystemExit("some benchmark sides failed (see above)")
    return results


if __name__ == "__main__":
    main()
