"""Reading a corpus for tools/preprocess_data.py: input discovery, chunks, text cleanup, tokenization.

The main process reads raw JSON lines (plain or .gz) or the record batches of Parquet/Arrow files (columnar.py)
into Chunks; a ChunkEncoder (in the main process or a worker) decodes, parses, cleans, optionally splits
sentences and tokenizes them. Bad records (non-UTF-8 bytes, malformed JSON, a missing key, an empty document)
are skipped and reported as Problems with file and line (row for columnar files).

A folder given as --input is read at its top level only (recursive=True walks it), without the metadata files
`datasets` writes beside its data, and when its file names carry a split (C4's c4-train.* and
c4-validation.*, `datasets`' train-00000-of-00001.parquet) only the files of one split are taken (train by
default; select_split).
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

from megatron.data.columnar import COLUMNAR_SUFFIXES, TEXT_KEY_NAMES, is_columnar, read_columnar_chunks

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
INPUT_SUFFIXES = JSON_SUFFIXES + COLUMNAR_SUFFIXES
# What `datasets` writes beside its data (save_to_disk, to_json exports): not records.
METADATA_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
SPLITS = ("train", "validation", "test", "all")
# A split named in a file name between separators: c4-train.00000-of-01024.json.gz, train-00000-of-00001.parquet,
# c4-validation.00007-of-00008.json.gz, wiki_valid.jsonl, test.parquet.
_SPLIT_IN_NAME = regex.compile(r"(?:^|[._-])(train|training|validation|valid|val|dev|test)(?=[._-]|$)")
_SPLIT_ALIASES = {"training": "train", "valid": "validation", "val": "validation", "dev": "validation"}
PROBLEM_KINDS = ("non-UTF-8 bytes", "malformed JSON", "missing key", "empty document", "unreadable file")
# Control (Cc) except tab/newline, format (Cf) except ZWNJ/ZWJ, surrogates, private use, and U+FFFD.
_CONTROL_CHARS = regex.compile(r"[\p{Cc}\p{Cf}\p{Cs}\p{Co}\uFFFD](?<![\t\n\u200c\u200d])")


def split_of(path, base=None):
    """The split a file's name, or a folder between base and it, says it belongs to (train, validation, test),
    or None: c4-validation.00000-of-00008.json.gz, or validation/data-00000-of-00001.arrow as `datasets`
    saves a DatasetDict."""
    parts = os.path.relpath(path, base).split(os.sep) if base else [os.path.basename(path)]
    for part in reversed(parts):
        match = _SPLIT_IN_NAME.search(part.lower())
        if match:
            return _SPLIT_ALIASES.get(match.group(1), match.group(1))
    return None


def select_split(files, split="train", base=None):
    """(files taken, files left out): the files named for `split`, plus those whose names carry no split;
    everything for split "all" or when no name carries a split."""
    if split == "all" or not any(split_of(path, base) for path in files):
        return list(files), []
    taken = [path for path in files if split_of(path, base) in (split, None)]
    return taken, [path for path in files if path not in taken]


def find_input_files(pattern, split="train", recursive=False):
    """--input as a file, a folder or a glob -> (sorted paths, paths of other splits left out).

    A folder gives its .json/.jsonl[.gz]/.parquet/.arrow files (subfolders only with recursive), less the
    metadata `datasets` writes, then select_split. A file or a glob is taken as given."""
    if os.path.isfile(pattern):
        return [pattern], []
    if os.path.isdir(pattern):
        found = []
        for root, _, names in os.walk(pattern):
            found += [os.path.join(root, n) for n in names
                      if n.endswith(INPUT_SUFFIXES) and n not in METADATA_FILES]
            if not recursive:
                break
        if not found:
            deeper = "" if recursive else " at its top level (pass --recursive to read its subfolders)"
            raise ValueError(f"--input {pattern}: the folder holds no {'/'.join(INPUT_SUFFIXES)} files{deeper}")
        taken, left_out = select_split(sorted(found), split, pattern)
        if not taken:
            splits = sorted({split_of(path, pattern) for path in left_out})
            raise ValueError(f"--input {pattern}: the folder holds no files of split {split} (only "
                             f"{', '.join(splits)}); pass --input-split {splits[0]} or --input-split all")
        return taken, left_out
    matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not matches:
        raise ValueError(f"--input {pattern}: no such file, folder or glob match")
    return matches, []


@dataclasses.dataclass
class Chunk:
    """Consecutive raw lines of one input file; line numbers start at 1."""

    path: str
    first_line: int
    lines: list
    input_bytes: int  # bytes of the input file consumed (compressed bytes for .gz), for progress/ETA
    columns: dict = None  # a Parquet/Arrow chunk: {json key: [value per row]} instead of lines


@dataclasses.dataclass
class Problem:
    kind: str
    path: str
    line: int
    detail: str
    keys: tuple = None  # a missing key: the record's keys (its columns for Parquet/Arrow)
    suggested_key: str = None  # a missing key: the record's key that looks like the text

    def __str__(self):
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.kind} ({self.detail})" if self.detail else f"{where}: {self.kind}"


def read_chunks(paths, problems, chunk_bytes=1 << 20, chunk_lines=4096, json_keys=("text",)):
    """Yields Chunks of every file in order (chunk_lines lines, or rows of a columnar file, at most). A file that
    cannot be read to the end (corrupt gzip, I/O error) adds an "unreadable file" Problem to `problems` after
    yielding what was read."""
    for path in paths:
        if is_columnar(path):
            import pyarrow as pa  # only for Parquet/Arrow inputs
            row = 0
            try:
                for chunk in read_columnar_chunks(path, json_keys, chunk_lines, Chunk):
                    row = chunk.first_line + len(next(iter(chunk.columns.values()), []))
                    yield chunk
            except (OSError, pa.ArrowException) as exc:
                problems.append(Problem("unreadable file", path, row, f"{type(exc).__name__}: {exc}"))
            continue
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


def suggest_text_key(record):
    """The key of a record to suggest for --json-keys: a usual name for text among its string values, else the
    key of its longest string (None without one)."""
    strings = {key: value for key, value in record.items() if isinstance(value, str)}
    usual = [name for name in TEXT_KEY_NAMES if name in strings]
    if usual:
        return usual[0]
    return max(strings, key=lambda key: len(strings[key])) if strings else None


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

    def _records(self, chunk, problems):
        """(line or row number, record dict) of the chunk's parsable records, and the count of blank lines."""
        if chunk.columns is not None:
            rows = len(next(iter(chunk.columns.values()), []))
            records = [(chunk.first_line + i, {key: values[i] for key, values in chunk.columns.items()})
                       for i in range(rows)]
            return records, 0
        records, blank = [], 0
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
            records.append((line_no, record))
        return records, blank

    def _parse(self, chunk, problems):
        """{key: [text]} of the chunk's good records; bad ones become Problems."""
        texts = {key: [] for key in self.json_keys}
        records, blank = self._records(chunk, problems)
        for line_no, record in records:
            values = []
            for key in self.json_keys:
                value = record.get(key)
                if not isinstance(value, str):
                    detail = f"no {key!r}" if key not in record else f"{key!r} is {type(value).__name__}, not text"
                    problems.append(Problem("missing key", chunk.path, line_no, detail, tuple(record),
                                            suggest_text_key(record)))
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
        problems.sort(key=lambda problem: problem.line)  # in input order (parse problems are found first)
        text_bytes = sum(len(line) for line in chunk.lines) if chunk.columns is None else \
            sum(len(t.encode("utf-8")) for docs in texts.values() for t in docs)
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
