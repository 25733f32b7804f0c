"""Merges several Megatron .bin/.idx datasets (same tokenizer) into one, documents kept in the given order.

    python tools/merge_datasets.py --input c4_part0_text_document c4_part1_text_document \
        --output-prefix c4_text_document
    python tools/merge_datasets.py --input-dir shards/ --output-prefix c4_text_document

--input-dir takes every prefix with both .bin and .idx in the folder, sorted by name.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.indexed_dataset import (  # noqa: E402
    MMapIndexedDataset, MMapIndexedDatasetBuilder, data_file_path, dataset_exists, index_file_path)

logger = logging.getLogger("merge_datasets")
PROG = "merge_datasets.py"


def get_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="dataset prefixes (without .bin/.idx), merged in this order")
    source.add_argument("--input-dir", help="folder whose .bin/.idx pairs are merged, sorted by name")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    return parser.parse_args(argv)


def input_prefixes(args):
    if args.input_dir is not None:
        if not os.path.isdir(args.input_dir):
            raise ValueError(f"--input-dir {args.input_dir}: no such folder")
        names = sorted(n[:-4] for n in os.listdir(args.input_dir) if n.endswith(".idx"))
        prefixes = [os.path.join(args.input_dir, n) for n in names
                    if dataset_exists(os.path.join(args.input_dir, n))]
        if not prefixes:
            raise ValueError(f"--input-dir {args.input_dir}: the folder holds no .bin/.idx pairs")
        return prefixes
    for prefix in args.input:
        for path in (index_file_path(prefix), data_file_path(prefix)):
            if not os.path.isfile(path):
                raise ValueError(f"--input {prefix}: {path} does not exist; pass prefixes without .bin/.idx")
    return list(args.input)


def merge_datasets(prefixes, output_prefix):
    """Concatenates the datasets at prefixes into output_prefix (.bin/.idx written, then renamed)."""
    dtype = MMapIndexedDataset(prefixes[0]).dtype
    suffix = f".tmp{os.getpid()}"
    builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix) + suffix, dtype=dtype)
    done = False
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(output_prefix) + suffix)
        os.replace(data_file_path(output_prefix) + suffix, data_file_path(output_prefix))
        os.replace(index_file_path(output_prefix) + suffix, index_file_path(output_prefix))
        done = True
    finally:
        if not done:
            builder.close()
            for path in (data_file_path(output_prefix) + suffix, index_file_path(output_prefix) + suffix):
                if os.path.exists(path):
                    os.remove(path)
    merged = MMapIndexedDataset(output_prefix)
    logger.info("merged %d datasets into %s: %d documents, %d sequences, %d tokens", len(prefixes), output_prefix,
                len(merged.doc_idx) - 1, len(merged), int(merged.sizes.sum(dtype="int64")))
    return merged


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = get_args(argv)
    try:
        prefixes = input_prefixes(args)
        folder = os.path.dirname(os.path.abspath(args.output_prefix))
        if not os.path.isdir(folder):
            raise ValueError(f"--output-prefix {args.output_prefix}: folder {folder} does not exist; create it first")
        merge_datasets(prefixes, args.output_prefix)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
