"""Evaluate a checkpoint of any TP x PP layout, or a Hugging Face BLOOM folder, with lm-evaluation-harness.

    python tools/evaluate.py --load checkpoints --tasks lambada_openai,hellaswag --batch-size 32 --output-path evals
    python tools/evaluate.py --load bloom_final --tasks alice_cloze,alice_choice,alice_perplexity \
        --include-path examples/eval
    torchrun --nproc_per_node 4 tools/evaluate.py --load checkpoints --tasks ...   # the checkpoint's TP x PP

No merge: each process reads its tensor-parallel slice of its pipeline stage (megatron/evaluation/loading.py).
Under torchrun the layout is the checkpoint's own (--tensor-model-parallel-size / --pipeline-model-parallel-size
choose another; processes beyond TP x PP split the requests as data parallelism). The model runs as lm-eval's
"megatron" backend (megatron/evaluation/harness.py); rank 0 prints lm-eval's table and, with --output-path,
writes lm-eval's results JSON (and the per-sample files with --log-samples) there.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True,
                        help="checkpoint folder (iter_XXXXXXX), its --save root, or a Hugging Face BLOOM folder")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    parser.add_argument("--include-path", default=None, help="a folder of extra lm-eval task YAML files")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16,
                        help="contexts per forward pass (each with its continuations)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192,
                        help="padded positions per forward pass (long requests run in smaller batches)")
    parser.add_argument("--limit", type=float, default=None,
                        help="at most this many documents per task (a fraction below 1.0)")
    parser.add_argument("--output-path", default=None, help="folder for lm-eval's results JSON")
    parser.add_argument("--log-samples", action="store_true", help="also write every request's inputs and outputs")
    parser.add_argument("--tokenizer-name-or-path", default=None,
                        help="tokenizer folder (default: the checkpoint's tokenizer/ or the HF folder)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto: the stored dtype on GPU, fp32 on the CPU")
    parser.add_argument("--max-length", type=int, default=None,
                        help="the longest input in tokens (default: the model's --seq-length)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--bootstrap-iters", type=int, default=100000,
                        help="lm-eval's bootstrap resamples for the stderr of non-mean metrics (0: none)")
    parser.add_argument("--gen-kwargs", default=None, help="lm-eval's generation overrides, e.g. temperature=0")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def check_args(args):
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty; name at least one lm-eval task, e.g. --tasks lambada_openai")
    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length),
                        ("--max-batch-tokens", args.max_batch_tokens),
                        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot} must be >= 0")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit {args.limit} must be positive")
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path {args.include_path}: no such folder")
    if not os.path.exists(args.load):
        raise ValueError(f"--load {args.load}: no such file or folder")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    return tasks


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        tasks = check_args(args)
        from megatron.evaluation.harness import task_manager
        task_manager(tasks, args.include_path)  # unknown tasks fail before the model loads
        from megatron.evaluation.loading import build_lm
        lm, state = build_lm(args.load, world, args.batch_size, args.tokenizer_name_or_path, args.dtype,
                             args.max_length, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                             args.seed, args.max_batch_tokens)
    except (ValueError, RuntimeError) as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2

    from lm_eval.utils import make_table
    from megatron.evaluation.harness import run_tasks

    tracker = None
    if args.output_path and rank == 0:
        from lm_eval.loggers import EvaluationTracker
        tracker = EvaluationTracker(output_path=args.output_path)
    results = run_tasks(lm, tasks, args.include_path, args.num_fewshot, args.limit, args.bootstrap_iters,
                        args.log_samples, tracker, args.gen_kwargs, args.seed)
    if rank == 0 and results is not None:
        samples = results.pop("samples", None)
        if tracker is not None:
            tracker.save_results_aggregated(results=results, samples=samples)
            if args.log_samples:
                for task_name in results["configs"]:
                    tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
        print(f"megatron ({args.load}, TP {state.tensor_model_parallel_size} x PP "
              f"{state.pipeline_model_parallel_size} x DP {state.data_parallel_size}), limit: {args.limit}, "
              f"num_fewshot: {args.num_fewshot}, batch_size: {args.batch_size}")
        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
    if world > 1:
        from megatron.initialize import shutdown_distributed
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
