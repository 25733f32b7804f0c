"""Generate text from a checkpoint of any TP x PP layout or a Hugging Face BLOOM folder (each rank reads its slices).

    python tools/generate_text.py --load checkpoints --prompt "The cat" --prompt "Once upon a time" \
        --max-new-tokens 32 --top-p 0.9 --temperature 0.8 --batch-size 2
    torchrun --nproc_per_node 2 tools/generate_text.py --load checkpoints --greedy --prompt "The cat"

Generation runs on megatron.inference.InferenceEngine: a static KV cache, CUDA-graph decode steps on a GPU, and
continuous batching (up to --batch-size prompts decode together; a finished one's slot goes to the next prompt).
One process runs the whole model; under torchrun (WORLD_SIZE > 1) the model runs tensor-parallel over all
processes (TP = WORLD_SIZE = --tensor-model-parallel-size if given, PP = 1; each rank reads only its slices of a
checkpoint of any layout, megatron/inference/loading.py), with CUDA graphs on a GPU; rank 0's token choices are
broadcast each step and only rank 0 prints.
"""
import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    from megatron.inference.loading import add_decode_flags, add_model_flags

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_flags(parser)
    add_decode_flags(parser)
    parser.add_argument("--prompt", action="append", default=[], help="repeatable")
    parser.add_argument("--prompts-file", default=None, help="one prompt per line (blank lines skipped)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (cache slots)")
    parser.add_argument("--output-file", default=None, help="also write JSON lines: prompt, ids, continuation")
    return parser.parse_args(argv)


def read_prompts(args):
    prompts = list(args.prompt)
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise ValueError(f"--prompts-file {args.prompts_file}: no such file")
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def main(argv=None):
    from megatron.checkpoint import convert
    from megatron.inference import InferenceEngine, SamplingParams
    from megatron.inference.checks import check_prompt_length
    from megatron.inference.loading import decode_options, load_model, setup_tensor_parallel, tp_token_sync

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tp, rank = 1, 0
    try:
        params = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, max_new_tokens=args.max_new_tokens)
        if args.batch_size < 1:
            raise ValueError(f"--batch-size {args.batch_size} must be at least 1")
        prompts = read_prompts(args)
        state = setup_tensor_parallel(args.tensor_model_parallel_size)
        tp, rank = state.tensor_model_parallel_size, state.tp_rank
        model, tokenizer, device, dtype = load_model(args.load, state, args.num_partitions,
                                                     args.tokenizer_name_or_path, args.dtype)
        prompt_ids = [tokenizer.tokenize(p) for p in prompts]
        if any(not ids for ids in prompt_ids):
            raise ValueError("a prompt tokenizes to no tokens; drop empty prompts")
        for i, ids in enumerate(prompt_ids):  # the same check and words as the server's HTTP 400
            check_prompt_length(len(ids), params.max_new_tokens, model.config.seq_length,
                                "prompt" if len(prompt_ids) == 1 else f"prompt {i}", "--max-new-tokens", "--prompt")
        cuda_graphs = device == "cuda" and not args.no_cuda_graphs
        engine = InferenceEngine(model, max_batch_size=min(args.batch_size, len(prompt_ids)),
                                 max_seq_len=max(len(ids) for ids in prompt_ids) + params.max_new_tokens,
                                 eod_id=tokenizer.eod, vocab_limit=tokenizer.vocab_size, cuda_graphs=cuda_graphs,
                                 sync_tokens=tp_token_sync(state) if tp > 1 else None,
                                 **decode_options(args, device, tp, cuda_graphs))
    except (ValueError, RuntimeError) as err:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails the same check: one line
            print(f"error: {err}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    outputs = engine.generate(prompt_ids, params, seed=args.seed)
    seconds = time.perf_counter() - start
    count = sum(len(o) for o in outputs)
    if rank == 0:
        records = []
        for i, (prompt, ids, out) in enumerate(zip(prompts, prompt_ids, outputs)):
            text = tokenizer.detokenize([t for t in out if t != tokenizer.eod])
            print(f"--- prompt {i + 1} ---\n{prompt}\n--- continuation ({len(out)} tokens"
                  f"{', stopped at eod' if out and out[-1] == tokenizer.eod else ''}) ---\n{text}")
            records.append({"prompt": prompt, "prompt_ids": ids, "generated_ids": out, "continuation": text})
        print(f"generated {count} tokens in {seconds:.2f} s: {count / max(seconds, 1e-9):.1f} tokens/s "
              f"(batch size {args.batch_size}, TP {tp}, {device}, {convert.DTYPE_NAMES[dtype]})")
        if args.output_file:
            with open(args.output_file, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    if tp > 1:
        from megatron.initialize import shutdown_distributed
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
