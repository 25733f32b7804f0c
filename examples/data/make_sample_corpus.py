"""Builds examples/data/sample.jsonl: public-domain books split into paragraph-sized JSON-lines documents.

    python examples/data/make_sample_corpus.py --corpus-dir ../shared/data/corpus --output examples/data/sample.jsonl

Each book is decoded as UTF-8 (BOM dropped), CRLF/CR line ends become LF, the text is split at blank
lines into paragraphs, and consecutive paragraphs are joined (with a blank line) until a document holds
at least --min-chars characters. Lines are {"text": ..., "source": book file name}, in book order.
"""
import argparse
import json
import os
import re

BOOKS = ("alice29.txt", "asyoulik.txt", "plrabn12.txt", "lcet10.txt", "botchan.txt")


def paragraphs(text):
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    for block in re.split(r"\n[ \t]*\n", text):
        block = block.strip("\n")
        if block.strip():
            yield block


def documents(text, min_chars):
    current = []
    for paragraph in paragraphs(text):
        current.append(paragraph)
        if sum(len(p) for p in current) >= min_chars:
            yield "\n\n".join(current)
            current = []
    if current:
        yield "\n\n".join(current)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", required=True, help="folder holding the books (shared/data/corpus)")
    parser.add_argument("--output", default="examples/data/sample.jsonl")
    parser.add_argument("--min-chars", type=int, default=600, help="smallest document, in characters")
    args = parser.parse_args()
    count = 0
    with open(args.output, "w", encoding="utf-8", newline="\n") as out:
        for book in BOOKS:
            with open(os.path.join(args.corpus_dir, book), encoding="utf-8") as f:
                text = f.read()
            for doc in documents(text, args.min_chars):
                out.write(json.dumps({"text": doc, "source": book}, ensure_ascii=False) + "\n")
                count += 1
    print(f"wrote {count} documents, {os.path.getsize(args.output)} bytes to {args.output}")


if __name__ == "__main__":
    main()
