"""Builds the offline lm-eval tasks' data (examples/eval/data/*.jsonl) from Alice's Adventures in Wonderland.

    python examples/eval/make_tasks.py --corpus-dir ../shared/data/corpus --output-dir examples/eval/data

alice29.txt (Canterbury corpus; Project Gutenberg text, public domain) is decoded, its CRLF line ends turned into
LF, and split into paragraphs at blank lines; paragraph line breaks become spaces.
- alice_cloze.jsonl: {"context", "target"}: a sentence of at least 8 words and its last word (letters only) split
  off, LAMBADA-style; the first 400 such sentences.
- alice_choice.jsonl: {"context", "choices", "label"}: the same sentences, the true last word among 4 choices (3
  last words of other sentences, drawn with a fixed seed), 300 documents = 1,200 loglikelihood requests.
- alice_paragraphs.jsonl: {"text"}: paragraphs of at least 200 characters, for rolling perplexity.
The output is the same on every run (fixed seed, sorted choices).
"""
import argparse
import json
import os
import random
import re

SENTENCE_END = re.compile(r"(?<=[.!?])['`]?\s+")


def paragraphs(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(line.strip() for line in block.split("\n") if line.strip())
        if block:
            out.append(block)
    return out


def cloze_items(paras, count):
    items = []
    for para in paras:
        for sentence in SENTENCE_END.split(para):
            words = sentence.split()
            if len(words) < 8:
                continue
            last = words[-1].rstrip(".!?,;:'`\"")
            if not last.isalpha() or not last.islower():
                continue
            items.append({"context": " ".join(words[:-1]), "target": last})
            if len(items) == count:
                return items
    return items


def choice_items(cloze, count, seed=1234):
    rng = random.Random(seed)
    words = sorted({item["target"] for item in cloze})
    out = []
    for item in cloze[:count]:
        others = rng.sample([w for w in words if w != item["target"]], 3)
        choices = sorted(others + [item["target"]])
        out.append({"context": item["context"], "choices": choices, "label": choices.index(item["target"])})
    return out


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus-dir", required=True, help="the folder holding alice29.txt")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    args = parser.parse_args(argv)
    source = os.path.join(args.corpus_dir, "alice29.txt")
    if not os.path.isfile(source):
        raise SystemExit(f"error: --corpus-dir {args.corpus_dir} has no alice29.txt")
    with open(source, encoding="utf-8") as f:
        paras = paragraphs(f.read())
    story = paras[paras.index("CHAPTER I") + 2:]  # after the title page and the first chapter's heading
    cloze = cloze_items(story, 400)
    os.makedirs(args.output_dir, exist_ok=True)
    write_jsonl(os.path.join(args.output_dir, "alice_cloze.jsonl"), cloze)
    write_jsonl(os.path.join(args.output_dir, "alice_choice.jsonl"), choice_items(cloze, 300))
    long_paras = [{"text": p} for p in story if len(p) >= 200 and not p.startswith("CHAPTER")]
    write_jsonl(os.path.join(args.output_dir, "alice_paragraphs.jsonl"), long_paras)
    print(f"{len(cloze)} cloze, {min(300, len(cloze))} multiple-choice, {len(long_paras)} perplexity documents "
          f"in {args.output_dir}")


if __name__ == "__main__":
    main()
