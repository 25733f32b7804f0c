"""Benchmark: generation tokens/s of our engine's decode paths side by side with HF generate, same weights.

    python benchmarks/generation_speed.py --device cuda            # the document's 1.72B model in bf16 on a GPU
    python benchmarks/generation_speed.py                          # a small fp32 model on the CPU
        [--batch-sizes 1 8 32 64 --paths unfused fused compiled step step_gemm ... --hf static|default|none
         --prompt-len 32 --new-tokens 256 --prefill-len 2048 --repeats 3 --output FILE.json]

Paths (InferenceEngine.generate, tools/generate_text.py's path): unfused = the model's own forward over the cache
(the engine before issue 25); fused = megatron/inference/decode.py eager (Triton attention over each row's own
length, packed rows) in CUDA graphs; compiled = the same with torch.compile (mode default); autotune = mode
max-autotune-no-cudagraphs; round 2's changes on top of compiled, each switchable: step = the whole step (state
update included) in the CUDA graph (graph_step=True), gemm = the skinny Triton GEMMs where timed faster
(gemm="auto"), step_gemm = both. --profile: the top CUDA kernels of 32 decode steps and the wall ms per decode
step (one engine.step of 32 steps after the prefill, without the profiler) for --profile-paths at
--profile-batches, into the log and the JSON. --breakdown: one more generate() per path and batch size, its wall
time split into prefill, decode steps and the host's time between them (events around each), with the decode
step's time over the first and last tenth of the generation (what grows with the context). HF: `static` = generate with a static cache and torch.compile (--hf-compile-mode)
at --hf-static-batch-sizes, HF's default generate at the others; if static raises, HF's default generate from
then on, and the row says so (mode and note in the JSON); `default` = HF's default generate everywhere.

Every side runs greedy decoding of the same random BLOOM, eos disabled, so each row generates exactly
--new-tokens tokens; the first run of each is a warm-up (compilation, graph capture: its time is reported as
warmup_s), then the best of --repeats. The bandwidth bound is batch x --bandwidth-tbps (default: the card's
nominal figure) / bytes read per step (every weight once + the keys/values of each row's average context); the
fraction is measured / bound.
Ours runs at every batch size first, then HF (a row per side as it is measured; at --equality-batches our
rows again with the count of rows equal to HF's). Rows equal to HF: per row, with each divergence measured on HF's own logits (a bf16
near-tie or not: megatron/inference/parity.py). Prefill: the time to the first token of one --prefill-len
prompt. The JSON is rewritten after every batch size, so a run cut short keeps what it measured.
"""
import argparse
import gc
import json
import logging
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DOCUMENT_MODEL = dict(layers=24, hidden=2048, heads=16, vocab=250880)
SMALL_MODEL = dict(layers=4, hidden=256, heads=8, vocab=8192)
PATHS = {"unfused": dict(decode="unfused"), "fused": dict(decode="fused"),
         "compiled": dict(decode="fused", compile_mode="default"),
         "autotune": dict(decode="fused", compile_mode="max-autotune-no-cudagraphs"),
         "step": dict(decode="fused", compile_mode="default", graph_step=True),
         "gemm": dict(decode="fused", compile_mode="default", gemm="auto"),
         "step_gemm": dict(decode="fused", compile_mode="default", graph_step=True, gemm="auto"),
         "fused_step_gemm": dict(decode="fused", graph_step=True, gemm="auto")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 256 on cuda, 64 on cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="default: 1 8 32 64 on cuda, 1 8 on cpu")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=None,
                        help="our decode paths (default: unfused fused compiled on cuda, unfused fused on cpu)")
    parser.add_argument("--hf", choices=["static", "default", "none"], default=None,
                        help="HF generate: static cache + torch.compile (falls back to default on an error), "
                             "default, or none (default: static on cuda, default on cpu)")
    parser.add_argument("--hf-compile-mode", default="default", help="torch.compile mode of HF's static path")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None, help="default: every batch size")
    parser.add_argument("--hf-static-batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="with --hf static: the batch sizes that try it (others: HF default generate)")
    parser.add_argument("--equality-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bandwidth-tbps", type=float, default=None,
                        help="memory bandwidth of the bound (default: the card's nominal figure, NOMINAL_TBPS; "
                             "4.8, the H200's, for any other device)")
    parser.add_argument("--prefill-len", type=int, default=None, help="default: 2048 on cuda, 0 (skip) on cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=None, help="HF's timed runs (default: --repeats)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip-hf", action="store_true", help="ours only (= --hf none)")
    parser.add_argument("--profile", action="store_true", help="top CUDA kernels of the decode steps (cuda)")
    parser.add_argument("--profile-paths", nargs="+", choices=list(PATHS), default=None,
                        help="the paths --profile profiles (default: every path run)")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=None,
                        help="the batch sizes --profile profiles (default: every batch size)")
    parser.add_argument("--breakdown", action="store_true",
                        help="one more generate() per path and batch size, its wall time split into prefill, decode "
                             "steps and host time between them (CUDA events), with the decode step's time along "
                             "the generation")
    parser.add_argument("--output", default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, value in (DOCUMENT_MODEL if cuda else SMALL_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.new_tokens = args.new_tokens or (256 if cuda else 64)
    args.batch_sizes = args.batch_sizes or ([1, 8, 32, 64] if cuda else [1, 8])
    args.paths = args.paths or (["unfused", "fused", "compiled"] if cuda else ["unfused", "fused"])
    args.hf = "none" if args.skip_hf else (args.hf or ("static" if cuda else "default"))
    args.hf_batch_sizes = args.hf_batch_sizes or args.batch_sizes
    args.profile_paths = args.profile_paths or args.paths
    args.profile_batches = args.profile_batches or args.batch_sizes
    args.hf_repeats = args.hf_repeats or args.repeats
    args.prefill_len = (2048 if cuda else 0) if args.prefill_len is None else args.prefill_len
    return args


# The vendors' nominal HBM bandwidths (TB/s) by a part of the device name, most specific first: the bound is the
# card's own (an H100 SXM's 3.35, not the H200's 4.8 the issue's bars are set against).
NOMINAL_TBPS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.039),
                ("A100 80GB PCIe", 1.935), ("A100", 1.555))


def nominal_tbps(device_name):
    """The bound's bandwidth for a device name: its NOMINAL_TBPS entry, else the H200's 4.8."""
    return next((tbps for part, tbps in NOMINAL_TBPS if part in device_name), 4.8)


def bandwidth_bound_tokens_per_s(batch, weight_bytes, kv_bytes_per_position, mean_context, bandwidth_bytes_per_s):
    """Tokens/s if a decode step only streamed every weight once and each row's keys/values over its context."""
    step_bytes = weight_bytes + batch * kv_bytes_per_position * mean_context
    return batch * bandwidth_bytes_per_s / step_bytes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def build_models(args, device, dtype):
    from transformers import BloomConfig, BloomForCausalLM

    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    from megatron.model.hf_bloom import from_hf_state_dict

    torch.manual_seed(0)
    hf_config = BloomConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layer=args.layers, n_head=args.heads)
    with torch.device(device):
        hf = BloomForCausalLM(hf_config).to(dtype).eval()
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         vocab_size=args.vocab, seq_length=max(args.prompt_len + args.new_tokens, args.prefill_len + 1),
                         attention_impl="auto", hidden_dropout=0.0, attention_dropout=0.0)
    with torch.device(device):  # initialised where it runs (fast on a GPU), then overwritten with HF's weights
        ours = BloomModel(config, parallel_output=False).to(dtype)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    return hf, ours.eval()


def measure(fn, device, repeats):
    """(warm-up seconds, best seconds of `repeats`, peak GiB) of fn()."""
    reset_peak(device)
    warm = timed(fn, device)
    best = min(timed(fn, device) for _ in range(repeats))
    return warm, best, peak_gib(device)


def hf_runner(hf, ids, new_tokens, mode, compile_mode, result):
    def run():  # result["out"]: the latest run's new tokens
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=3, eos_token_id=None)
        if mode == "static":
            from transformers import CompileConfig
            kwargs.update(cache_implementation="static", compile_config=CompileConfig(mode=compile_mode))
        result["out"] = hf.generate(ids, **kwargs)[:, ids.shape[1]:].tolist()
    return run


def main(argv=None):
    from megatron.inference import InferenceEngine, SamplingParams
    from megatron.inference.parity import compare_rows, describe

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron.inference.skinny_gemm").setLevel(logging.INFO)  # the GEMM choices, timed
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here; run it on a GPU machine")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    hf, ours = build_models(args, device, dtype)
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    max_seq = max(args.prompt_len + args.new_tokens, args.prefill_len + 1)

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    args.bandwidth_tbps = args.bandwidth_tbps or nominal_tbps(name)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    kv_per_position = 2 * args.layers * args.hidden * torch.finfo(dtype).bits // 8  # keys + values, every layer
    mean_context = args.prompt_len + (args.new_tokens - 1) / 2  # keys a decode step reads, averaged over the steps
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({sum(p.numel() for p in ours.parameters()) / 1e9:.2f}B params, {weight_bytes / 1e9:.2f} GB), "
          f"{args.dtype}, {name}, torch {torch.__version__}; prompt {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens, greedy; bound: {args.bandwidth_tbps} TB/s over the weights + each row's keys/values", flush=True)
    report = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "args": vars(args),
              "weight_bytes": weight_bytes, "rows": [], "prefill": None, "profiles": [],
              "breakdowns": []}

    def save():
        if args.output:
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2)

    print(f"{'batch':>5} {'side':>9} {'tokens/s':>10} {'of bound':>8} {'warmup s':>9} {'peak GiB':>9} "
          f"{'rows = HF':>9}  notes", flush=True)
    def show(batch, name, side):
        same = f"{side['rows_equal_to_hf']}/{batch}" if "rows_equal_to_hf" in side else "-"
        unfused = side.get("rows_equal_to_unfused")
        print(f"{batch:>5} {name:>9} {side['tokens_per_s']:>10.1f} {side['of_bound']:>8.1%} {side['warmup_s']:>9.1f} "
              f"{side['peak_gib']:>9.2f} {same:>9}  {side.get('mode', '')}"
              + ("" if unfused is None else f" rows = unfused: {unfused}/{batch}")
              + f" {side.get('note', '')}".rstrip(), flush=True)

    # ours at every batch size first (a slow HF compilation cannot cost our figures), then HF and the parity
    runs = []
    for batch in args.batch_sizes:
        prompts = torch.randint(4, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt_lists = prompts.tolist()
        tokens = batch * args.new_tokens
        bound = bandwidth_bound_tokens_per_s(batch, weight_bytes, kv_per_position, mean_context,
                                             args.bandwidth_tbps * 1e12)
        row = {"batch": batch, "bound_tokens_per_s": bound, "sides": {}}
        report["rows"].append(row)
        outputs = {}
        runs.append((batch, prompts, row, outputs))
        print(f"{batch:>5} {'bound':>9} {bound:>10.1f}", flush=True)
        with torch.no_grad():
            for path in args.paths:
                engine, result = None, {}

                def run_ours():
                    result["out"] = engine.generate(prompt_lists, params)
                try:
                    engine = InferenceEngine(ours, max_batch_size=batch, max_seq_len=max_seq, eod_id=None,
                                             **PATHS[path])
                    warm, best, peak = measure(run_ours, device, args.repeats)
                except Exception as err:  # noqa: BLE001  one path failing (a compiler error) costs only its row
                    error = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err) else ''}"
                    row["sides"][path] = {"error": error}
                    print(f"{batch:>5} {path:>9} failed: {error}", flush=True)
                    engine = None
                    save()
                    continue
                outputs[path] = result["out"]
                side = {"tokens_per_s": tokens / best, "of_bound": tokens / best / bound, "warmup_s": warm,
                        "peak_gib": peak}
                decoder = engine.decoder
                if decoder is not None and decoder.gemm != "torch":  # the GEMM choices and their timings
                    side["gemm_plans"] = {str(b): list(p) for b, p in decoder.plans.items()}
                    side["gemm_us"] = {f"{b} {label}": {k: v * 1e6 for k, v in times.items()}
                                       for (b, label), times in decoder.gemm_times.items()}
                    side["attention_launch"] = {str(b): launch for b, launch in decoder.launches.items()}
                    side["attention_us"] = {str(b): {k: v * 1e6 for k, v in times.items()}
                                            for b, times in decoder.attention_times.items()}
                if path != "unfused" and "unfused" in outputs:
                    side["rows_equal_to_unfused"] = sum(a == b for a, b in zip(outputs[path], outputs["unfused"]))
                row["sides"][path] = side
                show(batch, path, side)
                if args.breakdown:
                    report["breakdowns"].append(breakdown(engine, prompt_lists, params, path))
                if args.profile and device.type == "cuda" and path in args.profile_paths \
                        and batch in args.profile_batches:
                    report["profiles"].append(profile_decode(engine, prompt_lists, path))
                engine = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                save()

    hf_static_failed = None
    for batch, prompts, row, outputs in runs:
        if args.hf == "none" or batch not in args.hf_batch_sizes:
            continue
        tokens, bound = batch * args.new_tokens, row["bound_tokens_per_s"]
        ids, hf_result = prompts.to(device), {}
        static = args.hf == "static" and batch in args.hf_static_batch_sizes
        mode, note = ("static" if static and hf_static_failed is None else "default"), ""
        if static and hf_static_failed is not None:
            note = f"static+compile failed before ({hf_static_failed}); HF default generate"
        with torch.no_grad():
            try:
                warm, best, peak = measure(hf_runner(hf, ids, args.new_tokens, mode, args.hf_compile_mode, hf_result),
                                           device, args.hf_repeats)
            except Exception as err:  # noqa: BLE001  reported, then HF's default generate instead
                if mode != "static":
                    raise
                hf_static_failed = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                note = f"static+compile failed ({hf_static_failed}); HF default generate"
                mode = "default"
                torch._dynamo.reset()
                warm, best, peak = measure(hf_runner(hf, ids, args.new_tokens, mode, None, hf_result), device,
                                           args.hf_repeats)
        outputs["hf"] = hf_result["out"]
        if mode == "static":  # transformers compiles only where its criteria hold (else it warns, skips)
            compiled = getattr(hf, "_compiled_call", None) is not None
            mode = f"static+compile({args.hf_compile_mode})" if compiled else "static, not compiled"
        row["sides"]["hf"] = {"mode": mode, "tokens_per_s": tokens / best, "of_bound": tokens / best / bound,
                              "warmup_s": warm, "peak_gib": peak, "note": note}
        show(batch, "hf", row["sides"]["hf"])
        if batch in args.equality_batches:
            for name in args.paths:
                side = row["sides"][name]
                if name not in outputs:
                    continue
                equal, diffs = compare_rows(hf, prompts.tolist(), outputs[name], outputs["hf"])
                side.update(rows_equal_to_hf=equal, divergences=diffs, note=describe(diffs))
                show(batch, name, side)
        save()

    if args.prefill_len:
        prompt = torch.randint(4, args.vocab, (1, args.prefill_len), generator=torch.Generator().manual_seed(2))
        one = SamplingParams(greedy=True, max_new_tokens=1)
        engine = InferenceEngine(ours, max_batch_size=1, max_seq_len=max_seq, eod_id=None)
        hf_ids = prompt.to(device)
        sides = {"ours": lambda: engine.generate(prompt.tolist(), one)}
        if args.hf != "none":
            sides["hf"] = lambda: hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=1,
                                              do_sample=False, pad_token_id=3, eos_token_id=None)
        with torch.no_grad():
            best = {k: measure(fn, device, args.repeats)[1] for k, fn in sides.items()}
        report["prefill"] = {"tokens": args.prefill_len, **{f"{k}_ms": v * 1e3 for k, v in best.items()}}
        print(f"prefill of {args.prefill_len} tokens (time to the first token): "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()), flush=True)
        save()


class _HostEvent:
    """torch.cuda.Event's record() and elapsed_time() (ms) on the host clock, for CPU runs (work done on return)."""

    def record(self):
        self.seconds = time.perf_counter()

    def elapsed_time(self, end):
        return (end.seconds - self.seconds) * 1e3


def breakdown(engine, prompts, params, label):
    """One engine.generate(prompts, params) with an event recorded around each admission (prefill) and each decode
    step (one graph replay with graph_step), its wall time split into prefill, decode and the rest: the host's
    time between them (request bookkeeping, the syncs' copies, Python) while the device waits. The decode steps'
    own times along the generation show what grows with the context (the attention over each row's keys)."""
    device = engine.device
    new_event = (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else _HostEvent
    spans = {"prefill": [], "decode": []}

    def timed_method(name, kind):
        method = getattr(engine, name)

        def wrapper(*args, **kwargs):
            start, end = new_event(), new_event()
            start.record()
            out = method(*args, **kwargs)
            end.record()
            spans[kind].append((start, end))
            return out
        setattr(engine, name, wrapper)  # an instance attribute: shadows the method for this engine only
    timed_method("_admit", "prefill")
    timed_method("_decode_step", "decode")
    syncs = []
    finish = engine._finish  # a round's one host synchronisation
    engine._finish = lambda launched: syncs.append(1) or finish(launched)
    try:
        sync(device)
        first, last = new_event(), new_event()
        first.record()
        engine.generate(prompts, params)
        last.record()
        sync(device)
    finally:
        for name in ("_admit", "_decode_step", "_finish"):
            delattr(engine, name)
    wall = first.elapsed_time(last)
    prefill = sum(s.elapsed_time(e) for s, e in spans["prefill"])
    steps = [s.elapsed_time(e) for s, e in spans["decode"]]
    decode = sum(steps)
    tenth = max(1, len(steps) // 10)
    result = {"path": label, "batch": len(prompts), "wall_ms": wall, "prefill_ms": prefill, "decode_ms": decode,
              "host_ms": wall - prefill - decode, "syncs": len(syncs), "decode_steps": len(steps),
              "decode_step_ms_first_tenth": sum(steps[:tenth]) / tenth,
              "decode_step_ms_last_tenth": sum(steps[-tenth:]) / tenth,
              "tokens_per_s": len(prompts) * params.max_new_tokens / wall * 1e3,
              "decode_tokens_per_s": len(prompts) * len(steps) / decode * 1e3 if decode else float("nan")}
    print(f"-- {label}, batch {len(prompts)}: generate {wall:.1f} ms ({result['tokens_per_s']:.1f} tokens/s) = "
          f"prefill {prefill:.1f} ms + {len(steps)} decode steps {decode:.1f} ms ({result['decode_tokens_per_s']:.1f} "
          f"tokens/s; {result['decode_step_ms_first_tenth']:.3f} ms per step over the first tenth, "
          f"{result['decode_step_ms_last_tenth']:.3f} over the last) + host {result['host_ms']:.1f} ms "
          f"({len(syncs)} syncs)", flush=True)
    return result


def profile_decode(engine, prompts, label, steps=32, top=15):
    """Top CUDA kernels over `steps` decode steps (after a warm-up generation), printed and returned with the
    wall time per decode step measured without the profiler (one engine.step(steps) after the prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron.inference import SamplingParams

    params, device = SamplingParams(greedy=True, max_new_tokens=steps + 1), engine.device
    engine.generate(prompts, params)

    def decode(run):  # admits and prefills (a step of no decode steps), then `steps` decode steps in one call
        for p in prompts:
            engine.add_request(p, params)
        engine.step(num_steps=0)
        sync(device)
        seconds = run(lambda: engine.step(num_steps=steps))
        assert not engine.has_work(), "every row finishes at the last of the steps"
        return seconds
    wall = min(decode(lambda fn: timed(fn, device)) for _ in range(3))
    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])

    def profiled(fn):  # the decode steps only, not the prefill
        with prof:
            fn()
            sync(device)
    decode(profiled)
    averages = prof.key_averages()

    def device_us(event):  # the kernels' own time (torch renamed cuda_* to device_*)
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(event, name):
                return float(getattr(event, name))
        return 0.0
    from torch.autograd import DeviceType
    # the kernels themselves, not the ops that launch them (whose device time would count them twice)
    kernels = [e for e in averages if getattr(e, "device_type", None) == DeviceType.CUDA and device_us(e) > 0]
    kernels = sorted(kernels or [e for e in averages if device_us(e) > 0], key=device_us, reverse=True)
    total_us = sum(device_us(e) for e in kernels)
    result = {"path": label, "batch": len(prompts), "steps": steps, "decode_wall_ms_per_step": wall * 1e3 / steps,
              "device_ms_per_step": total_us / 1e3 / steps,
              "top": [{"name": e.key[:120], "calls": e.count, "total_us": device_us(e)} for e in kernels[:top]]}
    print(f"-- {label}, batch {len(prompts)}: {steps} decode steps: wall {result['decode_wall_ms_per_step']:.3f} ms "
          f"per step (no profiler); kernels {result['device_ms_per_step']:.3f} ms per step (profiled)")
    for k in result["top"]:
        print(f"   {k['total_us'] / 1e3:9.3f} ms {k['calls']:6d} calls {k['total_us'] / max(k['calls'], 1):8.1f} us  "
              f"{k['name']}")
    return result


if __name__ == "__main__":
    main()
