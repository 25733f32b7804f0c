"""Benchmarks tools/preprocess_data.py (1 and 2 workers) against raw `tokenizers` encode_batch on the same corpus.

    python benchmarks/preprocess_throughput.py [--repeat 4] [--tokenizer examples/tokenizer]

The corpus is examples/data/sample.jsonl repeated --repeat times (with a counter in each text so the
BPE word cache is not simply reused). Raw: Tokenizer.from_file + encode_batch (and encode_batch_fast, no offsets) of the texts, in this
process, JSON parsing excluded. Preprocess: the CLI in a subprocess, end to end (start-up, JSON parsing,
tokenization, .bin/.idx writing). Goal: preprocess time within 1.5x of the raw encode time.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))


def build_corpus(path, repeat):
    with open(os.path.join(ROOT, "examples", "data", "sample.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    corpus = [f"{r} {text}" for r in range(repeat) for text in texts]
    with open(path, "w", encoding="utf-8") as f:
        for text in corpus:
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "https://example.com"})
                    + "\n")
    return corpus


def raw_encode(tokenizer_json, texts, method="encode_batch"):
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_json)
    start = time.perf_counter()
    encodings = getattr(tokenizer, method)(texts, add_special_tokens=False)
    return time.perf_counter() - start, sum(len(e.ids) for e in encodings)


def run_preprocess(corpus_path, prefix, tokenizer_dir, workers):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus_path,
           "--output-prefix", prefix, "--vocab-file", os.path.join(tokenizer_dir, "vocab.json"),
           "--merge-file", os.path.join(tokenizer_dir, "merges.txt"), "--dataset-impl", "mmap",
           "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", str(workers),
           "--log-interval", "1000000"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="copies of the sample corpus")
    parser.add_argument("--tokenizer", default=os.path.join(ROOT, "examples", "tokenizer"),
                        help="folder with tokenizer.json, vocab.json, merges.txt (e.g. tests/fixtures/gpt2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus_path = os.path.join(folder, "corpus.jsonl")
        texts = build_corpus(corpus_path, args.repeat)
        megabytes = os.path.getsize(corpus_path) / 1e6
        raw_time, tokens = raw_encode(os.path.join(args.tokenizer, "tokenizer.json"), texts)
        print(f"corpus: {len(texts):,} documents, {megabytes:.2f} MB of JSON lines, {tokens:,} tokens; "
              f"tokenizer {os.path.relpath(args.tokenizer, ROOT)}; {os.cpu_count()} CPUs")
        print(f"{'run':<28}{'seconds':>9}{'MB/s':>9}{'tokens/s':>12}{'x raw':>8}")
        print(f"{'raw tokenizers encode_batch':<28}{raw_time:9.2f}{megabytes / raw_time:9.2f}"
              f"{tokens / raw_time:12,.0f}{1.0:8.2f}")
        fast_time, _ = raw_encode(os.path.join(args.tokenizer, "tokenizer.json"), texts, "encode_batch_fast")
        print(f"{'raw encode_batch_fast':<28}{fast_time:9.2f}{megabytes / fast_time:9.2f}"
              f"{tokens / fast_time:12,.0f}{fast_time / raw_time:8.2f}")
        for workers in (1, 2):
            seconds = run_preprocess(corpus_path, os.path.join(folder, f"w{workers}"), args.tokenizer, workers)
            print(f"{f'preprocess_data --workers {workers}':<28}{seconds:9.2f}{megabytes / seconds:9.2f}"
                  f"{tokens / seconds:12,.0f}{seconds / raw_time:8.2f}")
        same = all(open(os.path.join(folder, f"w1_text_document{e}"), "rb").read()
                   == open(os.path.join(folder, f"w2_text_document{e}"), "rb").read() for e in (".bin", ".idx"))
        print(f"outputs of 1 and 2 workers byte-identical: {same}")


if __name__ == "__main__":
    main()
