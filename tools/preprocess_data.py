"""Tokenizes a corpus (JSON lines, optionally .gz; Parquet; Arrow) into Megatron's mmap .bin/.idx training data.

    python tools/preprocess_data.py --input /data/c4/en --output-prefix c4_en \
        --vocab-file vocab.json --merge-file merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 32

writes c4_en_text_document.bin/.idx (one pair per --json-keys key). Output is byte-identical for any
--workers. Bad records are skipped, counted and named in the summary (--strict: the first is fatal); a run that
would write no document, or skip more than --max-skipped-fraction of the records, stops with one line naming
the cause and the fix. A folder is read at its top level (--recursive for subfolders), and of a C4-style folder
(c4-train.* and c4-validation.*) only the --input-split files (train by default). Outputs are written under
temporary names and renamed only when the run succeeds.
"""
import argparse
import collections
import logging
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.columnar import check_columns, is_columnar  # noqa: E402
from megatron.data.corpus import (  # noqa: E402
    PROBLEM_KINDS, SPLITS, ChunkEncoder, TextNormalizer, build_sentence_splitter, find_input_files, read_chunks)
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer, infer_tokenizer_type  # noqa: E402

logger = logging.getLogger("preprocess_data")
PROG = "preprocess_data.py"
SHOWN_PROBLEMS = 5


class StrictInputError(RuntimeError):
    pass


class EmptyOutputError(RuntimeError):
    """The run would write an empty or mostly-skipped dataset; the message names the cause and the fix."""


# ---------------------------------------------------------------- input selection and the empty-output checks


def _add_input_check_args(parser):
    """Which files of a folder are read, and how many bad records a run may skip before it writes nothing."""
    group = parser.add_argument_group("input selection and checks")
    group.add_argument("--input-split", choices=SPLITS, default="train",
                       help="of a folder whose file names carry a split (C4's c4-train.* / c4-validation.*, "
                            "datasets' train-*.parquet), read only this one (default: train; all: every file)")
    group.add_argument("--recursive", action="store_true", help="also read the subfolders of an --input folder")
    group.add_argument("--max-skipped-fraction", type=float, default=0.5,
                       help="stop without writing when more than this share of the records is skipped as bad "
                            "(default: 0.5); a run that would write no document always stops")


def empty_output_message(args, documents, counts, examples, first_missing, files, blank_lines):
    """The one-line reason not to write the dataset, or None when it may be written."""
    records_skipped = sum(n for kind, n in counts.items() if kind != "unreadable file")
    hint = None
    if first_missing is not None:
        key = next((k for k in args.json_keys if k not in first_missing.keys), args.json_keys[0])
        fix = (f"pass --json-keys {first_missing.suggested_key}" if first_missing.suggested_key not in (None, key)
               else "none of them holds text under another name; check --input")
        hint = (key, f"the first record's keys are {', '.join(first_missing.keys) or '(none)'}: {fix}")
    parts = ", ".join(f"{counts[kind]} {kind}" for kind in PROBLEM_KINDS if counts.get(kind))
    first = f"first: {examples[0]}" if examples else ""
    if documents == 0:
        if hint and counts.get("missing key") == records_skipped:
            if hint[0] in first_missing.keys:  # there, but not text: {"text": 42}, {"text": null}
                return f"no document has text under key {hint[0]!r} (first: {first_missing}); {hint[1]}"
            return f"no document has key {hint[0]!r}; {hint[1]}"
        if counts:
            return (f"no document to write: every record was skipped ({parts}); {first}; fix --input "
                    f"{args.input}; nothing written")
        return (f"--input {args.input} holds no documents ({len(files)} file{'s' if len(files) != 1 else ''}, "
                f"{blank_lines} blank lines); nothing written")
    total = documents + records_skipped
    if records_skipped > args.max_skipped_fraction * total:
        line = (f"skipped {records_skipped} of {total} records ({100 * records_skipped / total:.1f}%, more than "
                f"--max-skipped-fraction {args.max_skipped_fraction:g}: {parts}); {first}")
        if hint and 2 * counts.get("missing key", 0) > records_skipped:
            line += f"; {hint[1]}"
        return line + "; fix the input or raise --max-skipped-fraction; nothing written"
    return None


def log_input_files(args, files, left_out):
    """One line listing the files read (relative to an --input folder), one naming the files left out."""
    base = args.input if os.path.isdir(args.input) else None
    names = [os.path.relpath(p, base) if base else p for p in files]
    logger.info("reading %d input file%s: %s", len(files), "s" if len(files) != 1 else "", ", ".join(names))
    if left_out:
        logger.info("left out %d file%s of other splits (--input-split %s; all reads them): %s", len(left_out),
                    "s" if len(left_out) != 1 else "", args.input_split,
                    ", ".join(os.path.relpath(p, base) if base else p for p in left_out))


def get_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="a .json/.jsonl file (optionally .gz), a folder of them, or a glob")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    group.add_argument("--split-sentences", action="store_true", help="store each sentence as a sequence (nltk Punkt)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep the newlines between sentences")
    group.add_argument("--normalize", choices=["none", "nfc", "nfkc"], default="none",
                       help="Unicode normalisation of the text (default: none)")
    group.add_argument("--remove-control-chars", action="store_true",
                       help="drop control/format/private-use characters and U+FFFD, turn CRLF into LF")
    group.add_argument("--lowercase", action="store_true", help="lowercase the text")
    group.add_argument("--strict", action="store_true", help="stop at the first bad record (exit 1, no output)")

    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                       help="default: GPT2BPETokenizer with --vocab-file/--merge-file, else PretrainedFromHF")
    group.add_argument("--vocab-file", default=None, help="vocab.json of a byte-level BPE")
    group.add_argument("--merge-file", default=None, help="merges.txt of a byte-level BPE")
    group.add_argument("--tokenizer-name-or-path", default=None,
                       help="local folder with tokenizer.json (or the file) for PretrainedFromHF")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")

    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes {prefix}_{key}_document.bin/.idx; its folder must exist")
    group.add_argument("--dataset-impl", default="mmap", help="only mmap (Megatron's MMIDIDX .bin/.idx)")

    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    group.add_argument("--log-interval", type=int, default=10000, help="progress line every N documents")
    _add_input_check_args(parser)
    return parser.parse_args(argv)


def check_args(args):
    """Start-up checks; a ValueError names the flag and the path."""
    if args.dataset_impl != "mmap":
        raise ValueError(f"--dataset-impl {args.dataset_impl}: only mmap (Megatron's MMIDIDX .bin/.idx) is "
                         "supported; pass --dataset-impl mmap")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers} must be >= 1")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval {args.log_interval} must be >= 1")
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-prefix {args.output_prefix}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output-prefix {args.output_prefix}: folder {folder} is not writable")
    if not 0 <= args.max_skipped_fraction <= 1:
        raise ValueError(f"--max-skipped-fraction {args.max_skipped_fraction} must be between 0 and 1")
    files, left_out = find_input_files(args.input, args.input_split, args.recursive)
    for path in files:
        if not os.access(path, os.R_OK):
            raise ValueError(f"--input {path}: file is not readable")
        if is_columnar(path):
            check_columns(path, args.json_keys)
    log_input_files(args, files, left_out)
    args.tokenizer_type = infer_tokenizer_type(args.tokenizer_type, args.vocab_file, args.merge_file,
                                               args.tokenizer_name_or_path)
    if args.keep_newlines and not args.split_sentences:
        logger.warning("--keep-newlines only applies with --split-sentences; ignoring it")
    return files


def make_tokenizer(args):
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_name_or_path=args.tokenizer_name_or_path)


def make_encoder(args, tokenizer):
    normalizer = TextNormalizer(args.normalize, args.remove_control_chars, args.lowercase)
    return ChunkEncoder(tokenizer, args.json_keys, best_fitting_dtype(tokenizer.vocab_size), args.append_eod,
                        normalizer, args.split_sentences, args.keep_newlines)


_WORKER_ENCODER = None


def _init_worker(args, threads):
    global _WORKER_ENCODER
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # tokenizer threads of this worker (read at first encode)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    _WORKER_ENCODER = make_encoder(args, make_tokenizer(args))


def _encode_in_worker(chunk):
    return _WORKER_ENCODER(chunk)


def encode_chunks(args, encoder, chunks):
    """EncodedChunks in input order: in this process for --workers 1, else through a bounded process pool."""
    if args.workers == 1:
        for chunk in chunks:
            yield encoder(chunk)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    pool = context.Pool(args.workers, initializer=_init_worker, initargs=(args, threads))
    try:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * args.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


class Progress:
    """The CLI progress line: documents, docs/s, MB/s, tokens, share of input read and ETA."""

    def __init__(self, total_input_bytes, interval):
        self.total = max(1, total_input_bytes)
        self.interval = interval
        self.start = time.perf_counter()
        self.documents = self.text_bytes = self.input_bytes = self.tokens = 0
        self.next_report = interval

    def update(self, encoded):
        self.documents += encoded.documents
        self.text_bytes += encoded.text_bytes
        self.input_bytes += encoded.input_bytes
        self.tokens += sum(int(t.size) for t in encoded.tokens.values())
        if self.documents >= self.next_report:
            self.next_report = (self.documents // self.interval + 1) * self.interval
            print(self.line(), file=sys.stderr, flush=True)

    def line(self):
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done = min(1.0, self.input_bytes / self.total)
        eta = elapsed * (1 - done) / done if done > 0 else 0.0
        return (f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
                f"{self.text_bytes / elapsed / 1e6:.2f} MB/s, {self.tokens} tokens, {100 * done:.1f}% of input, "
                f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))})")


def summarize_problems(counts, examples, blank_lines):
    if not counts:
        return None
    parts = ", ".join(f"{counts[kind]} {kind}" for kind in PROBLEM_KINDS if counts.get(kind))
    first = "; ".join(str(p) for p in examples)
    line = f"skipped {sum(counts.values())} bad records ({parts}); first: {first}"
    if blank_lines:
        line += f"; also {blank_lines} blank lines"
    return line


def run(args, files, tokenizer):
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    encoder = make_encoder(args, tokenizer)
    if args.split_sentences:
        logger.info("splitting sentences with %s", build_sentence_splitter(keep_newlines=args.keep_newlines)[1])
    logger.info("%d input files, tokenizer %s (%d tokens, eod %d), output dtype %s, %d workers", len(files),
                args.tokenizer_type, tokenizer.vocab_size, tokenizer.eod, dtype.__name__, args.workers)
    outputs = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    suffix = f".tmp{os.getpid()}"
    temporary = [outputs[key] + ext + suffix for key in args.json_keys for ext in (".bin", ".idx")]
    builders = {key: MMapIndexedDatasetBuilder(outputs[key] + ".bin" + suffix, dtype=dtype) for key in args.json_keys}
    reader_problems = []
    counts, examples, blank_lines = collections.Counter(), [], 0
    progress = Progress(sum(os.path.getsize(p) for p in files), args.log_interval)
    success = False
    try:
        first_missing = None
        for encoded in encode_chunks(args, encoder, read_chunks(files, reader_problems, json_keys=args.json_keys)):
            problems = encoded.problems + reader_problems
            reader_problems.clear()
            if problems and args.strict:
                raise StrictInputError(f"--strict: bad input at {problems[0]}; no output written")
            for problem in problems:
                counts[problem.kind] += 1
                if len(examples) < SHOWN_PROBLEMS:
                    examples.append(problem)
                if first_missing is None and problem.kind == "missing key":
                    first_missing = problem
            blank_lines += encoded.blank_lines
            for key, builder in builders.items():
                builder.add_items(encoded.tokens[key], encoded.sizes[key], encoded.doc_ends[key])
            progress.update(encoded)
        if reader_problems and args.strict:
            raise StrictInputError(f"--strict: bad input at {reader_problems[0]}; no output written")
        for problem in reader_problems:
            counts[problem.kind] += 1
            if len(examples) < SHOWN_PROBLEMS:
                examples.append(problem)
        refusal = empty_output_message(args, progress.documents, counts, examples, first_missing, files, blank_lines)
        if refusal:
            raise EmptyOutputError(refusal)
        for key, builder in builders.items():
            builder.finalize(outputs[key] + ".idx" + suffix)
        for key in args.json_keys:
            for ext in (".bin", ".idx"):
                os.replace(outputs[key] + ext + suffix, outputs[key] + ext)
        success = True
    finally:
        if not success:
            for builder in builders.values():
                builder.close()
            for path in temporary:
                if os.path.exists(path):
                    os.remove(path)
    print(progress.line(), file=sys.stderr, flush=True)
    summary = summarize_problems(counts, examples, blank_lines)
    if summary:
        logger.warning(summary)
    for key in args.json_keys:
        logger.info("wrote %s.bin/.idx", outputs[key])
    return {"documents": progress.documents, "tokens": progress.tokens, "problems": dict(counts),
            "outputs": [outputs[key] for key in args.json_keys]}


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = get_args(argv)
    try:
        files = check_args(args)
        tokenizer = make_tokenizer(args)  # fails fast on unreadable vocab/merges or a non-local tokenizer name
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return 0 if run(args, files, tokenizer) is not None else 1
    except (StrictInputError, EmptyOutputError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
