"""Trains a BLOOM-style byte-level BPE tokenizer on text files and writes a folder AutoTokenizer loads offline.

    python tools/train_tokenizer.py --input examples/data/sample.jsonl --vocab-size 8000 \
        --output-dir examples/tokenizer

Pipeline as BLOOM's: Split(` ?[^(\\s|[.,!?…。，、।۔،])]+`, isolated) then ByteLevel(use_regex=False),
special tokens <unk> <s> </s> <pad> as ids 0-3, no normalizer. Inputs: .txt (paragraphs split at blank
lines) and .json/.jsonl (--json-keys), optionally .gz; files, folders or globs. CRLF becomes LF first, or
the vocabulary fills with `čĊ` tokens. Writes tokenizer.json, vocab.json, merges.txt,
tokenizer_config.json and special_tokens_map.json.
"""
import argparse
import glob
import gzip
import json
import logging
import os
import re
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from tokenizers import pre_tokenizers, trainers  # noqa: E402

from megatron.tokenizer.hf_files import BLOOM_SPECIAL_TOKENS, new_bloom_tokenizer, save_tokenizer_folder  # noqa: E402

logger = logging.getLogger("train_tokenizer")
PROG = "train_tokenizer.py"
SUFFIXES = (".txt", ".json", ".jsonl", ".txt.gz", ".json.gz", ".jsonl.gz")


def get_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.json/.jsonl files (or .gz), folders or globs")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys holding text in JSON lines")
    parser.add_argument("--vocab-size", type=int, default=8000, help="size including the 4 special tokens")
    parser.add_argument("--min-frequency", type=int, default=2, help="smallest pair count that makes a merge")
    parser.add_argument("--output-dir", required=True, help="folder to write (created if missing)")
    return parser.parse_args(argv)


def input_files(patterns):
    files = []
    for pattern in patterns:
        if os.path.isfile(pattern):
            files.append(pattern)
        elif os.path.isdir(pattern):
            found = [os.path.join(root, n) for root, _, names in os.walk(pattern) for n in names if n.endswith(SUFFIXES)]
            if not found:
                raise ValueError(f"--input {pattern}: the folder holds no {'/'.join(SUFFIXES)} files")
            files += sorted(found)
        else:
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"--input {pattern}: no such file, folder or glob match")
            files += matches
    return files


def _open_text(path):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="replace", newline="")
    return open(path, encoding="utf-8-sig", errors="replace", newline="")


def iter_texts(files, json_keys, stats):
    """Yields training texts with LF line ends: paragraphs of .txt files, the keys' values of JSON lines."""
    for path in files:
        is_json = path.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz"))
        with _open_text(path) as f:
            if not is_json:
                text = f.read().replace("\r\n", "\n").replace("\r", "\n")
                for paragraph in re.split(r"\n[ \t]*\n", text):
                    if paragraph.strip():
                        stats["texts"] += 1
                        stats["chars"] += len(paragraph)
                        yield paragraph
                continue
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    stats["skipped"] += 1
                    if stats["skipped"] <= 3:
                        logger.warning("%s:%d: malformed JSON, skipped", path, line_no)
                    continue
                for key in json_keys:
                    value = record.get(key) if isinstance(record, dict) else None
                    if isinstance(value, str) and value.strip():
                        value = value.replace("\r\n", "\n").replace("\r", "\n")
                        stats["texts"] += 1
                        stats["chars"] += len(value)
                        yield value


def train_tokenizer(files, vocab_size, output_dir, json_keys=("text",), min_frequency=2):
    """Trains the BLOOM-style tokenizer and saves it; returns the tokenizers.Tokenizer."""
    tokenizer = new_bloom_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(BLOOM_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    stats = {"texts": 0, "chars": 0, "skipped": 0}
    start = time.perf_counter()
    tokenizer.train_from_iterator(iter_texts(files, list(json_keys), stats), trainer=trainer)
    for i, token in enumerate(BLOOM_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    save_tokenizer_folder(tokenizer, output_dir, special)
    logger.info("trained on %d texts (%.2f M characters, %d malformed lines skipped) in %.1f s: %d tokens -> %s",
                stats["texts"], stats["chars"] / 1e6, stats["skipped"], time.perf_counter() - start,
                tokenizer.get_vocab_size(), output_dir)
    return tokenizer


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = get_args(argv)
    try:
        if args.vocab_size < 260:
            raise ValueError(f"--vocab-size {args.vocab_size} must be >= 260 (256 bytes + 4 special tokens)")
        files = input_files(args.input)
        parent = os.path.dirname(os.path.abspath(args.output_dir))
        if not os.path.isdir(parent):
            raise ValueError(f"--output-dir {args.output_dir}: parent folder {parent} does not exist")
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    train_tokenizer(files, args.vocab_size, args.output_dir, args.json_keys, args.min_frequency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
