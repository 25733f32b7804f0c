"""Megatron's mmap indexed dataset (.bin tokens + .idx index, format MMIDIDX v1): a zero-copy reader and a writer.

.idx layout, little-endian, byte-compatible with Megatron-LM / Megatron-DeepSpeed:
    b"MMIDIDX\\x00\\x00"      9-byte magic
    uint64  version = 1
    uint8   dtype code         (see DTYPES: 4 int32, 8 uint16, ...)
    uint64  N = number of sequences (items)
    uint64  D = len(doc_idx)    (number of documents + 1)
    int32   sizes[N]            tokens per sequence
    int64   pointers[N]         byte offset of each sequence in .bin
    int64   doc_idx[D]          index of each document's first sequence, then N
.bin is the sequences' tokens back to back in that dtype. A document is one or more sequences
(sentences with --split-sentences, otherwise exactly one).
"""
import os
import shutil
import struct

import numpy as np

_HDR_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_code(dtype):
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an MMIDIDX index; use one of "
                     f"{sorted(np.dtype(d).name for d in DTYPES.values())}")


def best_fitting_dtype(vocab_size=None):
    """uint16 when every token id fits (vocab < 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix_path):
    return prefix_path + ".idx"


def data_file_path(prefix_path):
    return prefix_path + ".bin"


def dataset_exists(prefix_path):
    return os.path.exists(index_file_path(prefix_path)) and os.path.exists(data_file_path(prefix_path))


def write_index(idx_path, dtype, sizes, doc_idx):
    """Writes an .idx for sequences of the given sizes stored back to back; pointers are derived from sizes."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    with open(idx_path, "wb") as f:
        f.write(_HDR_MAGIC)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(doc_idx.astype("<i8", copy=False).tobytes(order="C"))


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that is missing, truncated or corrupt; the message names the file and the fix."""


_HEADER_BYTES = len(_HDR_MAGIC) + 8 + 1 + 8 + 8


def _rebuild_hint(prefix):
    return f"re-run tools/preprocess_data.py to rebuild {prefix}.bin/.idx"


class _Index:
    """The parsed .idx, its arrays viewed straight from a memory map.

    Opening checks the header and that the file holds exactly the arrays the header describes, so a
    truncated or foreign file fails here with one line naming it, not later deep inside numpy.
    """

    def __init__(self, path):
        prefix = path[:-len(".idx")] if path.endswith(".idx") else path
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(_HEADER_BYTES)
        magic = header[:len(_HDR_MAGIC)]
        if magic != _HDR_MAGIC[:len(magic)]:
            raise IndexedDatasetError(f"{path} is not an MMIDIDX index (it starts with {magic!r}, not "
                                      f"{_HDR_MAGIC!r}); {_rebuild_hint(prefix)}")
        if len(header) < _HEADER_BYTES:
            raise IndexedDatasetError(f"{path} is truncated: {file_size} bytes, shorter than the "
                                      f"{_HEADER_BYTES}-byte MMIDIDX header; {_rebuild_hint(prefix)}")
        version, code, self._len, self._doc_count = struct.unpack("<QBQQ", header[len(_HDR_MAGIC):])
        if version != _VERSION:
            raise IndexedDatasetError(f"{path}: index version {version} is not supported (only {_VERSION}); "
                                      f"{_rebuild_hint(prefix)}")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPES)}); "
                                      f"{_rebuild_hint(prefix)}")
        self.dtype = np.dtype(DTYPES[code])
        expected = _HEADER_BYTES + 12 * self._len + 8 * self._doc_count  # sizes int32, pointers and doc_idx int64
        described = f"its header describes {self._len} sequences in {max(self._doc_count - 1, 0)} documents " \
                    f"({expected} bytes)"
        if file_size < expected:
            raise IndexedDatasetError(f"{path} is truncated: {file_size} bytes, but {described}; "
                                      f"{_rebuild_hint(prefix)}")
        if file_size > expected:
            raise IndexedDatasetError(f"{path} is corrupt: {file_size} bytes, but {described}; "
                                      f"{_rebuild_hint(prefix)}")
        self._mmap = np.memmap(path, mode="r", order="C")
        offset = _HEADER_BYTES
        self.sizes = np.frombuffer(self._mmap, dtype=np.int32, count=self._len, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(self._mmap, dtype=np.int64, count=self._len, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(self._mmap, dtype=np.int64, count=self._doc_count, offset=offset)
        if self._doc_count == 0:
            raise IndexedDatasetError(f"{path} is corrupt: its document index is empty (it holds at least the "
                                      f"offset 0); {_rebuild_hint(prefix)}")
        if self.doc_idx[-1] > self._len:  # reads would run past the sequences
            raise IndexedDatasetError(f"{path} is corrupt: its last document ends at sequence {self.doc_idx[-1]}, "
                                      f"but it holds {self._len} sequences; {_rebuild_hint(prefix)}")

    def __len__(self):
        return self._len

    def data_bytes(self):
        """Size the .bin must have: where the last sequence ends."""
        if self._len == 0:
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


def _open_index(path_prefix, flag="--data-path"):
    """The checked _Index of a .bin/.idx pair, after checking the .bin's size against it."""
    idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{flag} {path_prefix}: {path} does not exist; pass the output prefix of "
                                      "tools/preprocess_data.py without .bin/.idx (e.g. c4_en_text_document)")
    index = _Index(idx_path)
    expected, actual = index.data_bytes(), os.path.getsize(bin_path)
    if actual != expected:
        state = "is truncated" if actual < expected else "does not match its index"
        raise IndexedDatasetError(
            f"{bin_path} {state}: {actual} bytes, but {idx_path} describes {len(index)} sequences of "
            f"{index.dtype.name} ending at byte {expected}; {_rebuild_hint(path_prefix)}")
    return index


class MMapIndexedDataset:
    """Reads a .bin/.idx pair without copying: item i is the i-th sequence as a view into the memory map.

    Raises IndexedDatasetError (a ValueError) when a file is missing, truncated or does not match the other.
    """

    def __init__(self, path_prefix):
        self._path_prefix = path_prefix
        self._index = _open_index(path_prefix)
        self._document_sizes = None
        if os.path.getsize(data_file_path(path_prefix)) == 0:
            self._bin_buffer = np.zeros(0, dtype=np.uint8)
        else:
            self._bin_buffer = np.memmap(data_file_path(path_prefix), mode="r", order="C")

    def __getstate__(self):
        return self._path_prefix

    def __setstate__(self, state):
        self.__init__(state)

    def __len__(self):
        return len(self._index)

    @property
    def dtype(self):
        return self._index.dtype

    @property
    def sizes(self):
        return self._index.sizes

    @property
    def doc_idx(self):
        return self._index.doc_idx

    @property
    def path_prefix(self):
        return self._path_prefix

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        raise TypeError(f"index must be an int or a slice, got {type(idx).__name__}")

    def get(self, idx, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for a dataset of {len(self)} sequences")
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} out of range for sequence {idx} of size {size}")
        pointer = int(self._index.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=pointer)

    @property
    def document_sizes(self):
        """Tokens per document (all its sequences), int64; computed once."""
        if self._document_sizes is None:
            sizes = np.asarray(self.sizes, dtype=np.int64)
            cumulative = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.cumsum(sizes, out=cumulative[1:])
            doc_idx = np.asarray(self.doc_idx, dtype=np.int64)
            self._document_sizes = cumulative[doc_idx[1:]] - cumulative[doc_idx[:-1]]
        return self._document_sizes

    def get_document(self, doc_id, offset=0, length=None):
        """Tokens [offset, offset + length) of document doc_id across its sequences (stored back to back)."""
        size = int(self.document_sizes[doc_id])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} out of range for document {doc_id} of size {size}")
        if length == 0:
            return np.zeros(0, dtype=self.dtype)
        first = int(self._index.doc_idx[doc_id])
        pointer = int(self._index.pointers[first]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=pointer)


class MMapIndexedDatasetBuilder:
    """Appends sequences to a .bin file and writes the matching .idx at finalize()."""

    def __init__(self, out_file, dtype=np.int64):
        self._data_file = open(out_file, "wb")
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)
        self._sizes = []
        self._doc_idx = [0]

    def add_item(self, tokens):
        """Appends one sequence (a list, array or 1-D tensor of token ids)."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        array = np.asarray(tokens, dtype=self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_items(self, tokens, sizes, doc_ends):
        """Fast path: tokens of several sequences back to back, their sizes, and for each document
        the number of sequences it spans (a document ends after each of them)."""
        array = np.asarray(tokens, dtype=self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        start = len(self._sizes)
        self._sizes.extend(np.asarray(sizes, dtype=np.int64).tolist())
        for count in doc_ends:
            start += int(count)
            self._doc_idx.append(start)
        assert start == len(self._sizes), (start, len(self._sizes))

    def end_document(self):
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file):
        """Appends the sequences and documents of the dataset at prefix another_file."""
        index = _open_index(another_file, flag="--input")
        if index.dtype != self._dtype:
            raise ValueError(f"cannot merge {another_file} (dtype {index.dtype}) into a {self._dtype} dataset; "
                             "preprocess both with the same tokenizer")
        offset = len(self._sizes)
        self._sizes.extend(index.sizes.tolist())
        self._doc_idx.extend((offset + index.doc_idx[1:]).tolist())
        with open(data_file_path(another_file), "rb") as f:
            shutil.copyfileobj(f, self._data_file, length=16 * 1024 * 1024)

    def close(self):
        """Closes the .bin without writing an index (an aborted run)."""
        self._data_file.close()

    def finalize(self, index_file):
        self._data_file.close()
        write_index(index_file, self._dtype, np.asarray(self._sizes, dtype=np.int32), self._doc_idx)
