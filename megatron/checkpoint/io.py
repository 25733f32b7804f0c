"""Checkpoint file I/O: durable writes (fsynced, atomic renames), checksummed torch.save, the manifest, atomic folders.

Local file operations only (no process group). Training saves write each file through torch_save_synced or
write_text_synced, which return the file's manifest entry as the bytes pass, so write_manifest need not read
them back; conversions build their output under a temporary sibling (atomic_folder) renamed into place when
complete, so an error never leaves a half-written --output-path behind.
"""
import contextlib
import json
import os
import shutil
import zlib

import torch

from megatron.checkpoint.format import MANIFEST, TMP_PREFIX, file_crc32


def fsync_dir(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder):
    """fsync every file and folder under folder (folders too: a rename or a new entry is only durable then)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def write_json_atomic(path, obj):
    """obj as indented JSON, written beside path, fsynced and renamed over it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path, text):
    """text written to a hidden sibling (TMP_PREFIX, so a crash leaves only what the next save removes), fsynced
    and renamed over path."""
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Checksummed:
    """A write-only file wrapper that keeps the size and CRC32 of what passes through it (torch.save writes a
    file object through write() alone), so that the manifest needs no second pass over the bytes."""

    def __init__(self, f):
        self.f, self.size, self.crc32 = f, 0, 0

    def write(self, data):
        view = memoryview(data)
        self.size += view.nbytes
        self.crc32 = zlib.crc32(view, self.crc32)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def torch_save_synced(obj, path):
    """torch.save to path, flushed and fsynced; returns the file's manifest entry {"size", "crc32"}."""
    with open(path, "wb") as f:
        stream = _Checksummed(f)
        torch.save(obj, stream)
        f.flush()
        os.fsync(f.fileno())
    return {"size": stream.size, "crc32": stream.crc32}


def write_text_synced(text, path):
    """text to path, flushed and fsynced; returns the file's manifest entry {"size", "crc32"}."""
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": zlib.crc32(data)}


def write_manifest(folder, iteration, known=None):
    """manifest.json for every file under folder; known: {relative path: {"size", "crc32"}} computed while the
    files were written (used when the size on disk agrees), the others are read back."""
    known = known or {}
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == MANIFEST:
                continue
            size = os.path.getsize(path)
            entry = known.get(rel)
            files[rel] = entry if entry and entry["size"] == size else {"size": size, "crc32": file_crc32(path)}
    write_json_atomic(os.path.join(folder, MANIFEST), {"iteration": iteration, "files": files})


# ---------------------------------------------------------------- atomic output folders (conversions)


def check_output_path(out, force, inputs=(), flag="--output-path"):
    """RuntimeError when the output (the tool's flag) exists (without --force) or would overwrite an input."""
    out_abs = os.path.realpath(out)
    for src in inputs:
        src_abs = os.path.realpath(src)
        if out_abs == src_abs or src_abs.startswith(out_abs + os.sep):
            raise RuntimeError(f"{flag} {out} holds the input {src}; replacing it would delete the input, "
                               "choose another folder")
    if os.path.lexists(out) and not force:
        raise RuntimeError(f"{flag} {out} already exists; pass --force to replace it or choose another folder")


@contextlib.contextmanager
def atomic_folder(out, force, flag="--output-path"):
    """Yields a temporary sibling folder; on success it replaces `out` (removed first with force). An OSError
    while writing (a full disk, no permission) becomes a RuntimeError naming the tool's output flag."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        yield tmp
        if os.path.lexists(out):
            if not force:
                raise RuntimeError(f"{flag} {out} appeared while writing; pass --force to replace it")
            if os.path.isdir(out) and not os.path.islink(out):
                shutil.rmtree(out)
            else:
                os.remove(out)
        os.replace(tmp, out)
    except OSError as err:
        raise RuntimeError(f"{flag} {out}: writing failed ({err}); check the free space and permissions there or "
                           "choose another folder") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
