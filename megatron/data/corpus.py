"""Reading a JSON-lines corpus for tools/preprocess_data.py: input discovery, chunks, text cleanup, tokenization.

The main process reads raw lines (plain or .gz) into Chunks; encode_chunk (in the main process or a worker)
decodes, parses, cleans, optionally splits sentences and tokenizes them. Bad records (non-UTF-8 bytes,
malformed JSON, a missing key, an empty document) are skipped and reported as Problems with file and line.
"""
import dataclasses
import glob
import gzip
import itertools
import json
import logging
import os
import unicodedata

import numpy as np
import regex

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
PROBLEM_KINDS = ("non-UTF-8 bytes", "malformed JSON", "missing key", "empty document", "unreadable file")
# Control (Cc) except tab/newline, format (Cf) except ZWNJ/ZWJ, surrogates, private use, and U+FFFD.
_CONTROL_CHARS = regex.compile(r"[\p{Cc}\p{Cf}\p{Cs}\p{Co}\uFFFD](?<![\t\n\u200c\u200d])")


def find_input_files(pattern):
    """--input as a file, a folder (its .json/.jsonl[.gz] files, recursively) or a glob; sorted paths."""
    if os.path.isfile(pattern):
        return [pattern]
    if os.path.isdir(pattern):
        found = []
        for root, _, names in os.walk(pattern):
            found += [os.path.join(root, n) for n in names if n.endswith(INPUT_SUFFIXES)]
        if not found:
            raise ValueError(f"--input {pattern}: the folder holds no {'/'.join(INPUT_SUFFIXES)} files")
        return sorted(found)
    matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matches:
        raise ValueError(f"--input {pattern}: no such file, folder or glob match")
    return matches


@dataclasses.dataclass
class Chunk:
    """Consecutive raw lines of one input file; line numbers start at 1."""

    path: str
    first_line: int
    lines: list
    input_bytes: int  # bytes of the input file consumed (compressed bytes for .gz), for progress/ETA


@dataclasses.dataclass
class Problem:
    kind: str
    path: str
    line: int
    detail: str

    def __str__(self):
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.kind} ({self.detail})" if self.detail else f"{where}: {self.kind}"


def read_chunks(paths, problems, chunk_bytes=1 << 20, chunk_lines=4096):
    """Yields Chunks of every file in order. A file that cannot be read to the end (corrupt gzip, I/O error)
    adds an "unreadable file" Problem to `problems` after yielding what was read."""
    for path in paths:
        raw = open(path, "rb")
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
        lines, size, first, consumed = [], 0, 1, 0
        line_no = 0
        try:
            with raw, stream:
                for line_no, line in enumerate(stream, 1):
                    lines.append(line)
                    size += len(line)
                    if size >= chunk_bytes or len(lines) >= chunk_lines:
                        position = raw.tell()
                        yield Chunk(path, first, lines, position - consumed)
                        lines, size, first, consumed = [], 0, line_no + 1, position
                position = os.path.getsize(path)
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            problems.append(Problem("unreadable file", path, line_no + 1, f"{type(exc).__name__}: {exc}"))
            position = os.path.getsize(path)
        if lines or position > consumed:
            yield Chunk(path, first, lines, position - consumed)


class TextNormalizer:
    """Optional cleanup, off by default: Unicode normalisation, control characters and CRLF, lowercasing."""

    def __init__(self, unicode_form=None, remove_control_chars=False, lowercase=False):
        self.unicode_form = None if unicode_form in (None, "none") else unicode_form.upper()
        self.remove_control_chars = remove_control_chars
        self.lowercase = lowercase

    @property
    def active(self):
        return bool(self.unicode_form or self.remove_control_chars or self.lowercase)

    def __call__(self, text):
        if self.unicode_form:
            text = unicodedata.normalize(self.unicode_form, text)
        if self.remove_control_chars:
            text = _CONTROL_CHARS.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
        if self.lowercase:
            text = text.lower()
        return text


def build_sentence_splitter(language="english", keep_newlines=False):
    """(split function, description): nltk's trained Punkt model when its data is installed, else an
    untrained PunktSentenceTokenizer. keep_newlines keeps the whitespace after each sentence in it."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer

    try:
        splitter = PunktTokenizer(language)
        description = f"nltk Punkt model punkt_tab/{language}"
    except LookupError:
        splitter = PunktSentenceTokenizer()
        description = (f"untrained nltk PunktSentenceTokenizer (punkt_tab/{language} not installed; "
                       "`python -m nltk.downloader punkt_tab` gives better splits)")
    if not keep_newlines:
        return splitter.tokenize, description

    def split_keeping_newlines(text):
        starts = [start for start, _ in splitter.span_tokenize(text)]
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]

    return split_keeping_newlines, description


@dataclasses.dataclass
class EncodedChunk:
    """Per json key: tokens back to back, sizes per sequence, sequences per document."""

    tokens: dict
    sizes: dict
    doc_ends: dict
    documents: int
    text_bytes: int  # raw JSON-lines bytes (uncompressed)
    input_bytes: int  # bytes of the input file (compressed for .gz)
    problems: list
    blank_lines: int


class ChunkEncoder:
    """Turns a Chunk into token arrays; one per process (built in each worker by the pool initializer)."""

    def __init__(self, tokenizer, json_keys, dtype, append_eod=False, normalizer=None, split_sentences=False,
                 keep_newlines=False):
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.dtype = np.dtype(dtype)
        self.append_eod = append_eod
        self.normalizer = normalizer if normalizer is not None and normalizer.active else None
        self.split = build_sentence_splitter(keep_newlines=keep_newlines)[0] if split_sentences else None

    def _parse(self, chunk, problems):
        """[(key, text)] of the chunk's good records; bad ones become Problems."""
        texts = {key: [] for key in self.json_keys}
        blank = 0
        for line_no, raw in enumerate(chunk.lines, chunk.first_line):
            if not raw.strip():
                blank += 1
                continue
            try:
                line = raw.rstrip(b"\r\n").decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append(Problem("non-UTF-8 bytes", chunk.path, line_no,
                                        f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"))
                continue
            if line_no == 1:
                line = line.lstrip("\ufeff")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(Problem("malformed JSON", chunk.path, line_no, f"{exc.msg}: column {exc.colno}"))
                continue
            if not isinstance(record, dict):
                problems.append(Problem("malformed JSON", chunk.path, line_no,
                                        f"expected an object, got {type(record).__name__}"))
                continue
            values = []
            for key in self.json_keys:
                value = record.get(key)
                if not isinstance(value, str):
                    detail = f"no {key!r}" if key not in record else f"{key!r} is {type(value).__name__}, not text"
                    problems.append(Problem("missing key", chunk.path, line_no, detail))
                    break
                values.append(value)
            else:
                for key, text in zip(self.json_keys, values):
                    if self.normalizer is not None:
                        text = self.normalizer(text)
                    if not text.strip():
                        problems.append(Problem("empty document", chunk.path, line_no, f"key {key!r}"))
                        continue
                    texts[key].append(text)
        return texts, blank

    def __call__(self, chunk):
        problems = []
        texts, blank = self._parse(chunk, problems)
        text_bytes = sum(len(line) for line in chunk.lines)
        result = EncodedChunk({}, {}, {}, 0, text_bytes, chunk.input_bytes, problems, blank)
        for key, docs in texts.items():
            result.documents = max(result.documents, len(docs))
            if self.split is not None:
                sentences = [self.split(doc) or [doc] for doc in docs]
                doc_ends = [len(s) for s in sentences]
                flat = list(itertools.chain.from_iterable(sentences))
            else:
                doc_ends, flat = [1] * len(docs), docs
            ids = self.tokenizer.tokenize_batch(flat) if flat else []
            if self.append_eod:
                end = 0
                for count in doc_ends:
                    end += count
                    ids[end - 1].append(self.tokenizer.eod)
            sizes = np.fromiter((len(seq) for seq in ids), dtype=np.int32, count=len(ids))
            tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(sizes.sum()))
            result.tokens[key], result.sizes[key] = tokens, sizes
            result.doc_ends[key] = np.asarray(doc_ends, dtype=np.int64)
        return result
