"""Reading a rank's part of saved tensors: windows of memory-mapped files copied out, and the bytes read counted.

Pure module (files and tensors only; no process group). A saved tensor is stored as TP slices along its
partition dim, one per saved TP rank, and each slice may be cut further into flat regions (a ZeRO partition per DP
rank). A rank needs a flat range of its own TP slice on the run's TP size (a ZeRO partition, or the whole slice).
Seen as a grid of rows x cols, rows = the product of the dims before the partition dim and cols = the rest, every TP
slice holds the same rows and a block of the whole tensor's columns; a flat range of a slice is at most three
rectangles of its grid (a partial row, whole rows, a partial row). read_slice copies exactly the rectangles a rank
needs out of the saved slices' views (memory-mapped: only those bytes are read from disk) into one new tensor; no
whole tensor is ever assembled, whatever the saved and the new TP sizes.

The bytes copied out of mapped files, plus the files read whole (index JSON, the pickled part of torch.save's
files), are counted per process: load.py logs the most any rank read, and with MEGATRON_TEST_COUNT_READS=DIR each
rank writes DIR/reads_rank{rank}.json so tests can check that no rank reads more than its share.
"""
import json
import math
import os
import zipfile

import torch

COUNT_ENV = "MEGATRON_TEST_COUNT_READS"
_counted = {"bytes": 0}


def charge(nbytes):
    _counted["bytes"] += int(nbytes)


def bytes_read():
    return _counted["bytes"]


def reset():
    _counted["bytes"] = 0


def write_report(rank, folder):
    """With MEGATRON_TEST_COUNT_READS=DIR: DIR/reads_rank{rank:05d}.json holding the bytes this rank read."""
    out = os.environ.get(COUNT_ENV)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"reads_rank{rank:05d}.json"), "w") as f:
            json.dump({"rank": rank, "folder": folder, "bytes": bytes_read()}, f)


def read_json(path):
    """A JSON file, read whole and counted."""
    with open(path, "rb") as f:
        data = f.read()
    charge(len(data))
    return json.loads(data)


def load_mapped(path, weights_only=False):
    """torch.load of a file with its tensors memory-mapped (nothing of them read yet); the pickle, read whole, is
    counted. The tensors' bytes are counted when read_slice copies them out."""
    with zipfile.ZipFile(path) as archive:
        charge(sum(info.file_size for info in archive.infolist() if "/data/" not in info.filename))
    return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)


def load_whole(path):
    """torch.load of a small file read whole (RNG states), counted."""
    charge(os.path.getsize(path))
    return torch.load(path, map_location="cpu", weights_only=False)


def slice_shape(saved_shape, dim, saved_tp, tp):
    """The shape of one TP rank's slice on tp ranks of a tensor saved as saved_tp slices of saved_shape."""
    if dim is None or saved_tp == tp:
        return list(saved_shape)
    whole = saved_shape[dim] * saved_tp
    if whole % tp:
        raise ValueError(f"size {whole} along dim {dim} is not divisible by {tp} tensor-parallel ranks")
    return [whole // tp if d == dim else size for d, size in enumerate(saved_shape)]


def rectangles(lo, hi, cols):
    """The flat range [lo, hi) of a grid `cols` wide as (row0, row1, col0, col1) rectangles: at most a partial row,
    whole rows, a partial row."""
    out = []
    row, col = divmod(lo, cols)
    if col and lo < hi:
        end = min(hi, (row + 1) * cols)
        out.append((row, row + 1, col, end - row * cols))
        lo, row = end, row + 1
    whole = (hi - lo) // cols if lo < hi else 0
    if whole:
        out.append((row, row + whole, 0, cols))
        lo, row = lo + whole * cols, row + whole
    if lo < hi:
        out.append((row, row + 1, 0, hi - lo))
    return out


def _grid_cols(shape, dim):
    return math.prod(shape[dim:]) if dim is not None else math.prod(shape)


def read_slice(pieces, saved_shape, dim, saved_tp, tp, tp_rank, start, numel, dtype):
    """Elements [start, start + numel) of TP rank tp_rank's (of tp) flattened slice, as a new 1-D tensor of dtype,
    of a tensor saved as saved_tp slices of saved_shape along dim (None: every slice holds the whole tensor).

    pieces(t, lo, hi): [(begin, flat view)] of saved slice t that hold its flat elements [lo, hi), each view
    holding elements [begin, begin + its numel). Only the overlapping elements are copied (and counted). Returns
    (tensor, elements found); elements no piece holds stay 0."""
    out = torch.zeros(numel, dtype=dtype)
    if dim is None or saved_tp == tp:  # the saved slice of this TP rank (or any one) is the slice
        saved_cols = new_cols = max(math.prod(saved_shape), 1)
        offset, source = 0, tp_rank if saved_tp == tp else 0
    else:
        saved_cols = _grid_cols(saved_shape, dim)
        new_cols = _grid_cols(slice_shape(saved_shape, dim, saved_tp, tp), dim)
        offset, source = tp_rank * new_cols, None
    found = 0
    for row0, row1, col0, col1 in rectangles(start, start + numel, new_cols):
        first, last = (offset + col0) // saved_cols, (offset + col1 - 1) // saved_cols
        for t in range(first, last + 1):
            lo = max(offset + col0, t * saved_cols) - t * saved_cols  # this rectangle's columns in slice t
            hi = min(offset + col1, (t + 1) * saved_cols) - t * saved_cols
            for begin, flat in pieces(t if source is None else source, row0 * saved_cols + lo,
                                      (row1 - 1) * saved_cols + hi):
                for r0, r1, c0, c1 in rectangles(begin, begin + flat.numel(), saved_cols):
                    rows, cols = (max(row0, r0), min(row1, r1)), (max(lo, c0), min(hi, c1))
                    if rows[0] >= rows[1] or cols[0] >= cols[1]:
                        continue
                    size = (rows[1] - rows[0], cols[1] - cols[0])
                    src = flat.as_strided(size, (saved_cols, 1), flat.storage_offset() + rows[0] * saved_cols +
                                          cols[0] - begin)
                    new_col = cols[0] + t * saved_cols - offset
                    out.as_strided(size, (new_cols, 1), rows[0] * new_cols + new_col - start).copy_(src)
                    charge(src.numel() * src.element_size())
                    found += src.numel()
    return out, found
