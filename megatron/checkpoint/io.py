"""Checkpoint file I/O: durable writes (fsynced, atomic renames), checksummed torch.save, the manifest, atomic folders.

Local file operations only (no process group). Training saves write each file through torch_save_synced or
write_text_synced, which return the file's manifest entry as the bytes pass; the manifest lists exactly the
entries the writers report (never a directory listing). Conversions build their output under a temporary
sibling (atomic_folder), fsynced, then swapped in by rename: an error or a crash never leaves a half-written
--output-path, and --force deletes the old output only once the new one is in place.

Durability order everywhere: files fsynced, their folder fsynced, then the rename, then the parent fsynced.
Anything set aside for deletion is first renamed to a trash name (TRASH_PREFIX), so a crash while deleting
leaves a hidden folder that the next save or conversion removes, never a half-deleted live one.
"""
import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import zlib

import torch

from megatron.checkpoint.format import MANIFEST, TMP_PREFIX, TRASH_PREFIX, file_crc32

logger = logging.getLogger(__name__)

# Tests stop the process at each named step of a publish, a prune or a --force swap (tests/unit/
# test_checkpoint_durability.py forks a child that calls os._exit there); None in real runs.
crash_hook = None


def crash_point(step):
    if crash_hook is not None:
        crash_hook(step)


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
    """obj as indented JSON, written beside path, fsynced and renamed over it; returns its manifest entry."""
    data = json.dumps(obj, indent=2, default=str).encode()
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"size": len(data), "crc32": zlib.crc32(data)}


def write_text_atomic(path, text):
    """text written to a hidden sibling (TMP_PREFIX, so a crash leaves only what the next save removes), fsynced
    and renamed over path."""
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


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


def torch_save_synced(obj, path, save=torch.save):
    """torch.save to path (or save(obj, stream): torch_stream.save), flushed and fsynced; returns the file's
    manifest entry {"size", "crc32"}."""
    with open(path, "wb") as f:
        stream = _Checksummed(f)
        save(obj, stream)
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


def file_entry(path):
    """The manifest entry of a file on disk (for files a library wrote, such as a tokenizer's)."""
    return {"size": os.path.getsize(path), "crc32": file_crc32(path)}


def listed_entries(folder):
    """Manifest entries of every file under folder, read back. Only for folders assembled by hand (tests,
    upgrading an old folder): a save lists what its writers report instead."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST:
                files[rel] = file_entry(os.path.join(root, name))
    return files


def write_manifest(folder, iteration, files=None):
    """manifest.json listing `files` ({relative path: {"size", "crc32"}}: what the writers report they wrote),
    fsynced with its folder. files=None lists the folder instead (listed_entries: hand-made folders only)."""
    files = listed_entries(folder) if files is None else dict(sorted(files.items()))
    write_json_atomic(os.path.join(folder, MANIFEST), {"iteration": iteration, "files": files})
    fsync_dir(folder)


# ---------------------------------------------------------------- renames that never lose the old copy

_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a, b):
    """Atomically swaps the names a and b (renameat2 RENAME_EXCHANGE). False where the kernel or the file
    system cannot (then the caller falls back to two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def trash_name(path):
    """The hidden sibling a folder is renamed to before it is deleted."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, TRASH_PREFIX + base)


def remove_durably(path):
    """Deletes a folder or file: renamed to its trash name (durable), then removed. A crash in between leaves
    only the trash name, which the next save (save.clean_root) or conversion (atomic_folder) removes."""
    trash = trash_name(path)
    _remove(trash)  # an older leftover of the same name
    os.replace(path, trash)
    fsync_dir(os.path.dirname(trash))
    crash_point("renamed to trash")
    _remove(trash)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def replace_folder(new, final):
    """Puts the complete, fsynced folder `new` at `final`, replacing what is there without ever removing it
    first: swapped in one atomic rename where the file system can (the old contents then sit under `new`'s name
    and are deleted), else the old folder renamed to its trash name and `new` renamed in. The parent is fsynced
    after each rename."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.lexists(final):
        os.replace(new, final)
        fsync_dir(parent)
        crash_point("renamed into place")
        return
    if _exchange(new, final):
        fsync_dir(parent)
        crash_point("swapped")
        _remove(new)  # the old contents, under the temporary name: a crash leaves a .tmp_* that is never loaded
        return
    trash = trash_name(final)
    _remove(trash)
    os.replace(final, trash)
    fsync_dir(parent)
    crash_point("old set aside")
    os.replace(new, final)
    fsync_dir(parent)
    crash_point("renamed into place")
    _remove(trash)


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
    """Yields a temporary sibling folder; on success its files and folders are fsynced and it replaces `out`
    (replace_folder: with --force the old output is deleted only after the new one is in place). An OSError
    while writing (a full disk, no permission) becomes a RuntimeError naming the tool's output flag."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{os.path.basename(out)}-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        _remove(trash_name(out))  # left by a crash while an earlier --force deleted the old output
        prefix = f"{TMP_PREFIX}{os.path.basename(out)}-"
        for name in os.listdir(parent):  # left by a conversion to this output that crashed
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                _remove(os.path.join(parent, name))
        os.makedirs(tmp)
        yield tmp
        if os.path.lexists(out) and not force:
            raise RuntimeError(f"{flag} {out} appeared while writing; pass --force to replace it")
        fsync_tree(tmp)
        crash_point("output written")
        replace_folder(tmp, out)
    except OSError as err:
        raise RuntimeError(f"{flag} {out}: writing failed ({err}); check the free space and permissions there or "
                           "choose another folder") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
