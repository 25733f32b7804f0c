"""Benchmark: lm-eval requests per second of our backend ("megatron") against lm-eval's "hf" backend, same weights.

    python benchmarks/eval_speed.py --device cuda --output eval_speed.json     # the 1.72B model in bf16 on a GPU
    python benchmarks/eval_speed.py                                           # a small fp32 model on the CPU

The task is examples/eval/alice_choice (300 four-way multiple-choice questions = 1,200 loglikelihood requests; with
--repeat-docs N each question appears N times). One random BLOOM (seeded: the same weights every run) is built as our
BloomModel and copied into transformers' BloomForCausalLM, which lm-eval's HFLM wraps (its own loglikelihood code,
logits cache and batching); both run in this process with the same --batch-size (contexts per forward: hf batches
its context groups of one-token answers, ours a context with all its answers). Each backend runs the task twice:
the first run (warm-up: kernels, allocator, the shapes' first calls) and the measured run are both reported; time is
taken around each backend's loglikelihood call only (task building excluded, CUDA synchronised). For ours the
measured run is split into tokenization, the model (Scorer.score_continuations) and the rest; for hf into its
model calls and the rest (its per-request loop).

Agreement: the chosen answer (the argmax of the four log-likelihoods, lm-eval's acc) per question, ours against hf,
and the largest log-likelihood difference. The hf backend's softmax runs over the model's whole padded vocabulary
(250880 rows; the shipped tokenizer has 8000 tokens), ours by default over the tokenizer's tokens only (padding rows
never enter a softmax), so the comparison of the same function is "ours, full vocabulary" (vocab_limit = the padded
size); "ours" (the default, padding masked) is timed and compared too. On CUDA the agreement is also measured in
fp32 (--agreement-dtype), where bf16 near-ties of a random model cannot explain a difference.
"""
import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENT_MODEL = dict(layers=24, hidden=2048, heads=16, vocab=250880)
SMALL_MODEL = dict(layers=2, hidden=128, heads=4, vocab=8064)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--batch-size", type=int, default=128, help="contexts per forward, both backends")
    parser.add_argument("--repeat-docs", type=int, default=1, help="each question this many times")
    parser.add_argument("--limit", type=int, default=None, help="questions (default: all 300)")
    parser.add_argument("--agreement-dtype", choices=["none", "fp32"], default=None,
                        help="also compare ours and hf in this dtype after the timed runs (default: fp32 on cuda)")
    parser.add_argument("--output", default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for key, value in (DOCUMENT_MODEL if args.device == "cuda" else SMALL_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.agreement_dtype = args.agreement_dtype or ("fp32" if args.device == "cuda" else "none")
    return args


def build_models(args, device, dtype):
    """(our BloomModel, HF BloomForCausalLM) holding the same seeded random weights."""
    from transformers import BloomForCausalLM

    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    from megatron.model.hf_bloom import to_hf_config, to_hf_state_dict

    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         vocab_size=args.vocab, seq_length=2048, attention_impl="sdpa", hidden_dropout=0.0,
                         attention_dropout=0.0, seed=1234)
    with torch.device(device):
        ours = BloomModel(config, parallel_output=False).to(dtype).eval()
        hf = BloomForCausalLM(to_hf_config(config, dtype=dtype)).to(dtype).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict()), strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.tie_weights()
    return ours, hf


class Timed:
    """Wraps obj.name: seconds and calls summed (CUDA synchronised before and after each call)."""

    def __init__(self, obj, name, device):
        self.seconds, self.calls, self.items = 0.0, 0, 0
        inner = getattr(obj, name)

        def timed(*a, **k):
            sync(device)
            start = time.perf_counter()
            out = inner(*a, **k)
            sync(device)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.items += len(a[0]) if a and hasattr(a[0], "__len__") else 0
            return out
        setattr(obj, name, timed)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def task_dict(args, limit):
    """alice_choice as a task config dict (its data repeated --repeat-docs times)."""
    import yaml
    with open(os.path.join(ROOT, "examples", "eval", "alice_choice.yaml")) as f:
        config = yaml.safe_load(f)
    path = os.path.join(ROOT, "examples", "eval", "data", "alice_choice.jsonl")
    if args.repeat_docs > 1:
        import tempfile
        with open(path) as f:
            lines = f.readlines()
        path = os.path.join(tempfile.mkdtemp(), "alice_choice_repeated.jsonl")
        with open(path, "w") as f:
            f.writelines(lines * args.repeat_docs)
    config["dataset_kwargs"] = {"data_files": {"test": path}}
    return config, limit


def evaluate(lm, config, limit):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=lm, tasks=[config], limit=limit, bootstrap_iters=0, log_samples=True,
                              task_manager=TaskManager(include_defaults=False))
    samples = sorted(results["samples"]["alice_choice"], key=lambda s: s["doc_id"])
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    return results["results"]["alice_choice"], lls


def make_sides(ours, hf, tokenizer, tokenizer_dir, vocab, batch_size, labels):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from megatron.evaluation.harness import MegatronLM
    from megatron.inference.scoring import Scorer

    def megatron_lm(vocab_limit):
        return MegatronLM(Scorer.for_bloom_model(ours, vocab_limit=vocab_limit), tokenizer, 2048, batch_size,
                          model=ours)

    makers = {"ours, full vocabulary": lambda: megatron_lm(vocab),
              "hf": lambda: HFLM(pretrained=hf, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                                 batch_size=batch_size, max_length=2048),
              "ours": lambda: megatron_lm(tokenizer.vocab_size)}
    return {label: makers[label]() for label in labels}


def agreement(lls, reference):
    same = sum(max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
               for a, b in zip(lls, reference))
    diff = max(abs(x - y) for a, b in zip(lls, reference) for x, y in zip(a, b))
    return same, diff


def main(argv=None):
    from megatron.tokenizer import build_tokenizer

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here; run it on a GPU machine")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    start = time.perf_counter()
    ours, hf = build_models(args, device, dtypes[args.dtype])
    tokenizer_dir = os.path.join(ROOT, "examples", "tokenizer")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    config, _ = task_dict(args, None)
    n_docs = (args.limit or 300 * args.repeat_docs)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab} "
          f"({sum(p.numel() for p in ours.parameters()) / 1e9:.2f}B params), {args.dtype}, {name}, torch "
          f"{torch.__version__}; alice_choice: {n_docs} questions x 4 choices, batch size {args.batch_size} "
          f"(built in {time.perf_counter() - start:.1f} s)", flush=True)

    sides = make_sides(ours, hf, tokenizer, tokenizer_dir, args.vocab, args.batch_size,
                       ["ours, full vocabulary", "hf", "ours"])
    figures = {}
    for label, lm in sides.items():
        first = Timed(lm, "loglikelihood", device)
        evaluate(lm, config, args.limit)  # the first run: warm-up, reported
        timer = Timed(lm, "loglikelihood", device)  # wraps the first timer's wrapper: the measured run
        if label.startswith("ours"):
            parts = {"model": Timed(lm.scorer, "score_continuations", device),
                     "after tokenization": Timed(lm, "_loglikelihood_tokens", device)}
        else:
            parts = {"model": Timed(lm, "_model_call", device)}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        metrics, lls = evaluate(lm, config, args.limit)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
        split = {key: part.seconds for key, part in parts.items()}
        split["model calls"] = parts["model"].calls
        figures[label] = {"requests": timer.items, "seconds": timer.seconds,
                          "requests_per_s": timer.items / timer.seconds,
                          "first_run_seconds": first.seconds - timer.seconds,
                          "acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "peak_gib": peak,
                          "split": split, "lls": lls}
        detail = ", ".join(f"{k} {v:.3f} s" if isinstance(v, float) else f"{k} {v}" for k, v in split.items())
        print(f"{label:>22}: {timer.items} requests in {timer.seconds:.3f} s = "
              f"{timer.items / timer.seconds:,.1f} requests/s (first run {first.seconds - timer.seconds:.2f} s); "
              f"{detail}; acc {metrics['acc,none']:.4f}, peak {peak:.1f} GiB", flush=True)

    hf_lls = figures["hf"]["lls"]
    print(f"\n{'backend':>22} {'requests/s':>11} {'vs hf':>7} {'same choice as hf':>18} {'max |d ll|':>11}")
    rows = []
    for label, fig in figures.items():
        lls = fig.pop("lls")
        same, diff = agreement(lls, hf_lls)
        fig.update(label=label, speedup_vs_hf=fig["requests_per_s"] / figures["hf"]["requests_per_s"],
                   same_choice_as_hf=same, questions=len(lls), max_abs_ll_diff=diff)
        rows.append(fig)
        print(f"{label:>22} {fig['requests_per_s']:>11,.1f} {fig['speedup_vs_hf']:>6.2f}x "
              f"{same:>11}/{len(lls):<6} {diff:>11.4f}")

    check = None
    if args.agreement_dtype != "none":  # the same comparison in fp32: numerics, not bf16 near-ties
        del sides, ours, hf
        import gc
        gc.collect()  # the timers' closures hold the backends in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ours, hf = build_models(args, device, dtypes[args.agreement_dtype])
        sides = make_sides(ours, hf, tokenizer, tokenizer_dir, args.vocab, args.batch_size,
                           ["ours, full vocabulary", "hf"])
        lls = {label: evaluate(lm, config, args.limit)[1] for label, lm in sides.items()}
        same, diff = agreement(lls["ours, full vocabulary"], lls["hf"])
        check = {"dtype": args.agreement_dtype, "same_choice_as_hf": same, "questions": len(lls["hf"]),
                 "max_abs_ll_diff": diff}
        print(f"{args.agreement_dtype}: ours (full vocabulary) chooses as hf on {same}/{len(lls['hf'])} questions, "
              f"max |d ll| {diff:.2e}")
    print(f"total {time.perf_counter() - start:.1f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "args": vars(args), "rows": rows, "agreement_check": check}, f, indent=2)


if __name__ == "__main__":
    main()
