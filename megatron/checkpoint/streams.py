"""Tensor streams: windows of tensors read from mapped files with bounded memory, safetensors written a block at a time.

The pieces megatron/checkpoint/convert.py and hf.py stream conversions with: a window (rows x cols of a tensor
that is stored as several TP slices) is assembled from views of the mapped files and copied out; OpenFiles drops
the mappings after READ_BLOCK_BYTES have been read through them, since pages read through a mapping count in the
process's RSS until it is unmapped; SafetensorsWriter writes the published format from its header on, one block
of rows at a time.
"""
import json
import math
import struct
import sys

import torch

# The most a conversion reads at once for a Hugging Face output (one block of rows of a tensor), and the bytes read
# through a file mapping before it is dropped (mapped pages count in the process's RSS until then).
READ_BLOCK_BYTES = 1 << 27


def narrow(tensor, ranges):
    """The view tensor[ranges[0][0]:ranges[0][1], ranges[1][0]:...]; a None range keeps the whole dim."""
    for dim, bounds in enumerate(ranges):
        if bounds is not None and tuple(bounds) != (0, tensor.shape[dim]):
            tensor = tensor.narrow(dim, bounds[0], bounds[1] - bounds[0])
    return tensor


def window(pieces, dim, ranges):
    """Views of `pieces` (one tensor's TP slices, concatenated along dim) that make up its window `ranges`
    (per dim, (start, stop) in the full tensor's coordinates, or None for all of it), in order along dim."""
    views, offset = [], 0
    for piece in pieces:
        size = piece.shape[dim]
        start, stop = ranges[dim] if ranges[dim] is not None else (0, sum(p.shape[dim] for p in pieces))
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            local = list(ranges)
            local[dim] = (lo - offset, hi - offset)
            views.append(narrow(piece, local))
        offset += size
    return views


def span_bytes(view):
    """Bytes between a view's first and last element: what reading it touches in a mapped file."""
    if view.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))) * view.element_size()


def owned(parts, dim, dtype):
    """One new contiguous tensor from views (concatenated along dim), cast to dtype if it is floating (None keeps
    it): nothing of the result points into a file mapping."""
    if len(parts) == 1:
        tensor = parts[0]
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.to(target, copy=True, memory_format=torch.contiguous_format)
    merged = torch.cat(parts, dim=dim)
    return merged.to(dtype) if dtype is not None and merged.is_floating_point() else merged


def window_ranges(shape, rows, cols):
    return [rows, cols][:len(shape)]


class OpenFiles:
    """Source files opened on first use and kept open while fewer than READ_BLOCK_BYTES have been read through them.

    A tensor read from a mapped file (torch.load(mmap=True)) leaves its pages in the process's RSS until the
    mapping is dropped; dropping every open file after READ_BLOCK_BYTES keeps that bounded. Callers hold no view
    into an opened file across calls (they copy what they read)."""

    def __init__(self, opener):
        self.opener = opener
        self.files, self.read_bytes = {}, 0

    def get(self, path):
        if self.read_bytes >= READ_BLOCK_BYTES:
            self.close()
        if path not in self.files:
            self.files[path] = self.opener(path)
        return self.files[path]

    def charge(self, nbytes):
        self.read_bytes += nbytes

    def close(self):
        self.files.clear()
        self.read_bytes = 0


# ---------------------------------------------------------------- writing safetensors a block at a time


# safetensors' dtype names (the format's header) for the dtypes a checkpoint can hold, and back.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
SAFETENSORS_TORCH = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class SafetensorsWriter:
    """One .safetensors file written tensor by tensor, so that only the block being written is in memory.

    The format: an 8-byte little-endian header length N, N bytes of JSON naming each tensor's dtype, shape and
    byte range ("data_offsets", relative to the end of the header; padded with spaces to a multiple of 8), then
    the tensors' bytes, row-major, little-endian. entries: [(name, shape, dtype)] in the order write() receives
    them; each tensor may come in several blocks of whole rows.
    """

    def __init__(self, path, entries, metadata=None):
        assert sys.byteorder == "little", "safetensors stores little-endian bytes"
        header = {"__metadata__": metadata} if metadata else {}
        self.sizes, offset = [], 0
        for name, shape, dtype in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.sizes.append((name, dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.total = path, offset
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.index, self.left = 0, self.sizes[0][2] if self.sizes else 0

    def write(self, block):
        """The next block of rows of the current tensor (contiguous, in the entry's dtype)."""
        name, dtype, _ = self.sizes[self.index]
        nbytes = block.numel() * block.element_size()
        assert block.dtype == dtype and block.is_contiguous() and nbytes <= self.left, (name, block.dtype, nbytes)
        if nbytes:
            self.file.write(block.reshape(-1).view(torch.uint8).numpy())
        self.left -= nbytes
        while self.left == 0 and self.index + 1 < len(self.sizes):
            self.index += 1
            self.left = self.sizes[self.index][2]

    def close(self):
        self.file.close()
        assert self.index == len(self.sizes) - 1 and self.left == 0, f"{self.path}: not every tensor was written"

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.file.close()


def row_blocks(shape, itemsize):
    """(start, stop) row ranges that cover a tensor of `shape`, each at most READ_BLOCK_BYTES (at least one row)."""
    row_bytes = math.prod(shape[1:]) * itemsize
    step = max(1, READ_BLOCK_BYTES // max(row_bytes, 1))
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]
