"""Turns a GPT-2-format vocab.json + merges.txt into a folder that AutoTokenizer.from_pretrained loads offline.

    python tools/convert_tokenizer.py --vocab-file bloom_tokenizer/vocab.json \
        --merge-file bloom_tokenizer/merges.txt --output-dir bloom_tokenizer_hf

transformers 5 has no BloomTokenizerFast, and `AutoTokenizer.from_pretrained(folder)` fails on a folder holding
only those two files ("Couldn't instantiate the backend tokenizer ..."). This writes
tokenizer.json (the `tokenizers` library's format), tokenizer_config.json (tokenizer_class
PreTrainedTokenizerFast) and special_tokens_map.json beside copies of the two input files. The tokenizer is
the one tools/preprocess_data.py and pretrain_bloom.py build from the same files (GPT2BPETokenizer), so it gives
the same ids: BLOOM's split-regex pre-tokenizer for a vocabulary with <unk> <s> </s> <pad> as ids 0-3, GPT-2's
ByteLevel one otherwise; a vocabulary without a pad token gets <pad> added after its last id, as in training.
The output folder may be the input folder (the two inputs are then left as they are).
"""
import argparse
import logging
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.hf_files import save_tokenizer_folder  # noqa: E402

PROG = "convert_tokenizer.py"
WRITTEN = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def get_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-file", required=True, help="GPT-2-format vocab.json (token -> id)")
    parser.add_argument("--merge-file", required=True, help="the merges.txt that goes with it")
    parser.add_argument("--output-dir", required=True, help="folder to write (created if missing; may be the "
                                                            "folder of the inputs)")
    parser.add_argument("--force", action="store_true", help="replace a tokenizer.json already in --output-dir")
    return parser.parse_args(argv)


def convert(vocab_file, merge_file, output_dir):
    """Writes the AutoTokenizer folder; returns the GPT2BPETokenizer it holds."""
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    os.makedirs(output_dir, exist_ok=True)
    for source, name in ((vocab_file, "vocab.json"), (merge_file, "merges.txt")):
        target = os.path.join(output_dir, name)
        if not (os.path.exists(target) and os.path.samefile(source, target)):
            shutil.copyfile(source, target)
    save_tokenizer_folder(tokenizer.backend_tokenizer, output_dir, tokenizer.special_tokens,
                          write_vocab_merges=False)
    return tokenizer


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = get_args(argv)
    try:
        parent = os.path.dirname(os.path.abspath(args.output_dir))
        if not os.path.isdir(parent):
            raise ValueError(f"--output-dir {args.output_dir}: parent folder {parent} does not exist; create it "
                             "first")
        existing = os.path.join(args.output_dir, "tokenizer.json")
        if os.path.exists(existing) and not args.force:
            raise ValueError(f"--output-dir {args.output_dir} already holds tokenizer.json; pass --force to "
                             "replace it or choose another folder")
        tokenizer = convert(args.vocab_file, args.merge_file, args.output_dir)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    special = ", ".join(f"{role.split('_')[0]} {token}" for role, token in tokenizer.special_tokens.items())
    print(f"wrote {', '.join(WRITTEN)} to {args.output_dir} ({tokenizer.vocab_size} tokens; {special}); "
          f'load it with AutoTokenizer.from_pretrained("{args.output_dir}")')
    return 0


if __name__ == "__main__":
    sys.exit(main())
