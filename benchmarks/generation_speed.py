"""Benchmark: generation tokens/s of our engine (tools/generate_text.py's path) against HF generate, same weights.

    python benchmarks/generation_speed.py --device cuda            # the document's 1.72B model in bf16 on a GPU
    python benchmarks/generation_speed.py                          # a small fp32 model on the CPU
        [--batch-sizes 1 8 32 --prompt-len 32 --new-tokens 256 --prefill-len 2048 --repeats 3 --output FILE.json]

Both sides run greedy decoding of the same random BLOOM, eos disabled so every row generates exactly --new-tokens
tokens, in the same process; the runs alternate and the best of --repeats is reported (the first run of each
shape is a warm-up: CUDA-graph capture on our side). Prefill: the time to the first token of one --prefill-len
prompt (ours: prefill with the LM head on the last position; HF: generate with max_new_tokens=1). Peak memory
is the GPU's peak allocated during each side's runs, weights included. --profile prints the top CUDA kernels of
one decode step of ours at each batch size.
"""
import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DOCUMENT_MODEL = dict(layers=24, hidden=2048, heads=16, vocab=250880)
SMALL_MODEL = dict(layers=4, hidden=256, heads=8, vocab=8192)


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
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 1 8 32 on cuda, 1 8 on cpu")
    parser.add_argument("--prefill-len", type=int, default=None, help="default: 2048 on cuda, 0 (skip) on cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip-hf", action="store_true", help="ours only")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--output", default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for key, value in (DOCUMENT_MODEL if cuda else SMALL_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.new_tokens = args.new_tokens or (256 if cuda else 64)
    args.batch_sizes = args.batch_sizes or ([1, 8, 32] if cuda else [1, 8])
    args.prefill_len = (2048 if cuda else 0) if args.prefill_len is None else args.prefill_len
    return args


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


def main(argv=None):
    from megatron.inference import InferenceEngine, SamplingParams

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here; run it on a GPU machine")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    hf, ours = build_models(args, device, dtype)
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    max_seq = max(args.prompt_len + args.new_tokens, args.prefill_len + 1)
    engines = {}

    def engine_for(batch):
        if batch not in engines:
            engines.clear()  # one cache at a time
            engines[batch] = InferenceEngine(ours, max_batch_size=batch, max_seq_len=max_seq, eod_id=None)
        return engines[batch]

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    weights_gb = sum(p.numel() * p.element_size() for p in ours.parameters()) / 1e9
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({sum(p.numel() for p in ours.parameters()) / 1e9:.2f}B params, {weights_gb:.2f} GB), {args.dtype}, "
          f"{name}, torch {torch.__version__}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy")
    rows = []
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'ours GiB':>9} {'HF GiB':>8} {'same':>5}")
    for batch in args.batch_sizes:
        prompts = torch.randint(4, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt_lists = prompts.tolist()
        hf_ids = prompts.to(device)
        engine = engine_for(batch)
        result = {}

        def run_ours():
            result["ours"] = engine.generate(prompt_lists, params)

        def run_hf():
            out = hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=3, eos_token_id=None)
            result["hf"] = out[:, args.prompt_len:].tolist()

        sides = [run_ours] + ([] if args.skip_hf else [run_hf])
        with torch.no_grad():
            for fn in sides:  # warm-up (graph capture)
                fn()
            best, peaks = [float("inf")] * len(sides), [0.0] * len(sides)
            for _ in range(args.repeats):
                for i, fn in enumerate(sides):
                    reset_peak(device)
                    best[i] = min(best[i], timed(fn, device))
                    peaks[i] = max(peaks[i], peak_gib(device))
        tokens = batch * args.new_tokens
        row = {"batch": batch, "ours_tokens_per_s": tokens / best[0], "ours_peak_gib": peaks[0]}
        if not args.skip_hf:
            same = sum(a == b for a, b in zip(result["ours"], result["hf"]))
            row.update(hf_tokens_per_s=tokens / best[1], hf_peak_gib=peaks[1], ratio=best[1] / best[0],
                       rows_equal_to_hf=f"{same}/{batch}")
            print(f"{batch:>5} {row['ours_tokens_per_s']:>11.1f} {row['hf_tokens_per_s']:>10.1f} "
                  f"{row['ratio']:>8.2f} {peaks[0]:>9.2f} {peaks[1]:>8.2f} {same:>2}/{batch}")
        else:
            print(f"{batch:>5} {row['ours_tokens_per_s']:>11.1f} {'-':>10} {'-':>8} {peaks[0]:>9.2f}")
        rows.append(row)
        if args.profile and device.type == "cuda":
            profile_decode(engine, prompt_lists)

    prefill = None
    if args.prefill_len:
        prompt = torch.randint(4, args.vocab, (1, args.prefill_len), generator=torch.Generator().manual_seed(2))
        one = SamplingParams(greedy=True, max_new_tokens=1)
        engine = engine_for(1)
        hf_ids = prompt.to(device)

        def prefill_ours():
            engine.generate(prompt.tolist(), one)

        def prefill_hf():
            hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=1, do_sample=False,
                        pad_token_id=3, eos_token_id=None)

        sides = [prefill_ours] + ([] if args.skip_hf else [prefill_hf])
        with torch.no_grad():
            for fn in sides:
                fn()
            best = [min(timed(fn, device) for _ in range(args.repeats)) for fn in sides]
        prefill = {"tokens": args.prefill_len, "ours_ms": best[0] * 1e3}
        if not args.skip_hf:
            prefill.update(hf_ms=best[1] * 1e3, ratio=best[1] / best[0])
        print(f"prefill of {args.prefill_len} tokens (time to the first token): ours {best[0] * 1e3:.1f} ms"
              + ("" if args.skip_hf else f", HF {best[1] * 1e3:.1f} ms ({best[1] / best[0]:.2f}x)"))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "args": vars(args), "rows": rows, "prefill": prefill}, f, indent=2)


def profile_decode(engine, prompts, steps=32):
    """Top CUDA kernels over `steps` decode steps of ours (after a warm-up generation)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron.inference import SamplingParams

    params = SamplingParams(greedy=True, max_new_tokens=steps + 1)
    with torch.no_grad():
        engine.generate(prompts, params)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, params, steps_per_sync=steps)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
