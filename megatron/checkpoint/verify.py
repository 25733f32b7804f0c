"""Checkpoint verification on --load, shared by the ranks: each checks an even share of the manifest's bytes.

Rank 0 lists the candidate folders (`latest`, then the others newest first, format.candidate_folders) and reads
each candidate's manifest; every rank then reads its share of the files (sizes balanced: the largest file first,
to the rank with the fewest bytes so far) and checks sizes and CRC32s; one all-reduce of the first failing file
combines the answers, and the rank that found it sends the reason. At 2.5 TB over 384 ranks each rank reads
about 6.5 GB instead of rank 0 reading everything while the others wait.

The collectives run on their own gloo group whose timeout is --checkpoint-verify-timeout-minutes, so a long
verification is bounded by that flag and not by --distributed-timeout-minutes (which bounds training's
collectives). Without torch.distributed (tools, tests) one process checks every file.
"""
import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron.checkpoint.format import (CheckpointError, candidate_folders, is_tag_folder, read_manifest,
                                        verify_file)

logger = logging.getLogger(__name__)


def share(files, world_size):
    """{relative path: owning rank}: every file to one rank, the largest first to the rank with the fewest bytes
    (ties to the lowest rank), so each reads about total / world_size bytes."""
    load = [0] * world_size
    owner = {}
    for rel in sorted(files, key=lambda r: (-files[r]["size"], r)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[rel] = rank
        load[rank] += files[rel]["size"]
    return owner


class Verifier:
    """The ranks' shared check of one folder at a time. Collective: every rank constructs it and calls it with
    the same folder."""

    def __init__(self, timeout_minutes):
        self.timeout_minutes = timeout_minutes
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = None
        if self.distributed:  # collective; gloo: the messages are host objects whatever the training backend
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
        self.bytes = self.files = 0

    def _collective(self, collective, *args, **kwargs):
        try:
            return collective(*args, group=self.group, **kwargs)
        except RuntimeError as err:  # gloo's timeout, or a peer that died meanwhile
            raise CheckpointError(
                f"verifying the checkpoint did not finish on every rank within --checkpoint-verify-timeout-minutes "
                f"{self.timeout_minutes} ({type(err).__name__}: {str(err).splitlines()[0]}); raise it, or check the "
                "file system's read speed") from None

    def broadcast(self, obj, src=0):
        if not self.distributed:
            return obj
        box = [obj]
        self._collective(dist.broadcast_object_list, box, src=src)
        return box[0]

    def maximum(self, value):
        """The largest of the ranks' integers."""
        if not self.distributed:
            return value
        flag = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def __call__(self, folder):
        """None when folder is complete, else the reason (the same on every rank)."""
        files, reason = read_manifest(folder) if self.rank == 0 else (None, None)
        files, reason = self.broadcast((files, reason))
        if reason:
            return reason
        owner = share(files, self.world_size)
        order = sorted(files)
        failed = len(order)
        for index, rel in enumerate(order):
            if owner[rel] == self.rank:
                reason = verify_file(folder, rel, files[rel])
                if reason:
                    failed = index
                    break
        if self.distributed:
            flag = torch.tensor([failed], dtype=torch.int64)
            self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN)
            failed = int(flag.item())
            if failed < len(order):
                reason = self.broadcast(reason, src=owner[order[failed]])
        if failed < len(order):
            return reason
        self.files, self.bytes = len(order), sum(info["size"] for info in files.values())
        return None


def choose_checkpoint(root, strict=False, timeout_minutes=60, verifier=None):
    """The folder to resume from (format.find_checkpoint's choice and messages), its files checked by every rank
    sharing the reads (Verifier; the caller's, whose group it then reuses for the load, or a new one). Collective.
    Logs the time it took, once (rank 0). Returns (folder or None, seconds)."""
    start = time.perf_counter()
    verifier = verifier or Verifier(timeout_minutes)
    single = is_tag_folder(root) and os.path.isdir(root)  # an iter_* folder named directly
    candidates = None
    if verifier.rank == 0:
        candidates = [(None, root)] if single else candidate_folders(root)
    candidates = verifier.broadcast(candidates)
    chosen = None
    for tag, folder in candidates:
        reason = verifier(folder)
        if reason is None:
            chosen = folder
            break
        if single:
            raise CheckpointError(f"--load {root}: checkpoint is incomplete or corrupt: {reason}")
        if strict:
            raise CheckpointError(f"--load {root}: checkpoint {tag} is incomplete or corrupt: {reason} "
                                  "(--strict-load is set; drop it to fall back to an older checkpoint)")
        if verifier.rank == 0:
            logger.warning("skipping checkpoint %s: %s", tag, reason)
    seconds = time.perf_counter() - start
    if chosen is not None and verifier.rank == 0:
        logger.info("verified checkpoint %s: %d files, %.3f GB, checksums read by %d rank(s) in %.2f s",
                    chosen, verifier.files, verifier.bytes / 1e9, verifier.world_size, seconds)
    return chosen, seconds
