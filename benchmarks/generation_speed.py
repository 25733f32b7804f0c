"""Benchmark: tokens/s of our KV-cache generation (tools/generate_text.py's path) vs HF generate, same model, CPU.

    python benchmarks/generation_speed.py [--layers 4 --hidden 256 --heads 8 --vocab 8192 --prompt-len 32
                                           --new-tokens 64 --batch-sizes 1 8 --repeats 3 --threads 2]

Both sides run greedy decoding of the same random BLOOM (weights copied through the HF name table) in fp32,
with eos disabled so every row generates exactly --new-tokens tokens; the best of --repeats alternating runs is reported.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args(argv)


def best_times(fns, repeats):
    """Best wall time of each function; the runs alternate so both sides see the same machine load."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main(argv=None):
    from transformers import BloomConfig, BloomForCausalLM

    from megatron.config import ModelConfig
    from megatron.generation import SamplingParams, generate
    from megatron.model import BloomModel
    from megatron.model.hf_bloom import from_hf_state_dict

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=args.vocab, hidden_size=args.hidden, n_layer=args.layers,
                                      n_head=args.heads)).eval()
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         vocab_size=args.vocab, seq_length=args.prompt_len + args.new_tokens, attention_impl="torch")
    ours = BloomModel(config, parallel_output=False).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    no_eos = -1  # never produced: fixed-length generation on both sides

    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M params), fp32, CPU, "
          f"{torch.get_num_threads()} threads; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens")
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8}")
    for batch in args.batch_sizes:
        prompts = torch.randint(4, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt_lists = prompts.tolist()

        def run_ours():
            with torch.no_grad():
                return generate(ours, prompt_lists, params, eod_id=no_eos, pad_id=3)

        def run_hf():
            with torch.no_grad():
                return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=3,
                                   eos_token_id=None)

        run_ours(), run_hf()  # warm-up
        tokens = batch * args.new_tokens
        ours_s, hf_s = best_times([run_ours, run_hf], args.repeats)
        ours_tps, hf_tps = tokens / ours_s, tokens / hf_s
        print(f"{batch:>5} {ours_tps:>11.1f} {hf_tps:>10.1f} {ours_tps / hf_tps:>8.2f}")


if __name__ == "__main__":
    main()
