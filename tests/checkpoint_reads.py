"""A rank's share of a checkpoint, and the check that each rank's load read no more than 1.25x of it.

With MEGATRON_TEST_COUNT_READS=DIR every rank writes DIR/reads_rank{rank}.json, the bytes it read to load
(megatron/checkpoint/reads.py: the elements copied out of mapped files, plus the index JSON, the pickled part of
torch.save's files and the RNG file, read whole). The share is computed here from the checkpoint's own files,
independently of the load code: each weight's TP slice on the new TP size (the whole tensor where it is not split),
and the optimizer state of that slice, 1/dp of it at ZeRO 1-2 (the flat partition), all of it at ZeRO 0. For
resumes onto PP 1 (the stage holds every tensor).
"""
import glob
import json
import os
import re

import torch

MOST = 1.25  # no rank reads more than this multiple of its share (issue 27)
LEAST = 0.9  # nor less than this (the counter counts what a rank must read): ZeRO's padding aside


def share_bytes(folder, tp, dp, zero):
    """Bytes one rank of TP tp x PP 1 x DP dp (ZeRO stage zero) holds of the checkpoint in folder, in its dtypes."""
    weights = 0
    for path in glob.glob(os.path.join(folder, "model_tp*_pp*.pt")):
        first_tp = "_tp00_" in os.path.basename(path)
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in shard["weights"].items():
            nbytes = tensor.numel() * tensor.element_size()
            split = shard["partition_dims"].get(name) is not None
            weights += nbytes / tp if split else (nbytes if first_tp else 0)
    state = 0
    for path in glob.glob(os.path.join(folder, "index_tp*_pp*_dp*.json")):
        first_tp = "_tp00_" in os.path.basename(path)
        with open(path) as f:
            params = json.load(f)["params"]
        for entry in params.values():
            nbytes = entry["numel"] * 4 * (3 if entry["fp32"] else 2)
            state += nbytes / tp if entry["partition_dim"] is not None else (nbytes if first_tp else 0)
    return weights + (state / dp if zero else state)


def assert_reads_within_share(reads_dir, folder, tp, dp, zero, log=None):
    """Every rank's reported bytes within [LEAST, MOST] x its share; log (the run's output): the figure its resume
    line prints, "at most B GB read by one rank", is the largest report. Returns ({rank: bytes}, share)."""
    share = share_bytes(str(folder), tp, dp, zero)
    reports = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(reads_dir, "reads_rank*.json")))]
    assert sorted(r["rank"] for r in reports) == list(range(tp * dp)), reports
    got = {r["rank"]: r["bytes"] for r in reports}
    for report in reports:
        assert os.path.normpath(report["folder"]) == os.path.normpath(folder), report
        assert LEAST * share <= report["bytes"] <= MOST * share, (report, share, got)
    if log is not None:
        printed = re.findall(r"at most ([0-9.]+) GB read by one rank", log)
        assert printed == [f"{max(got.values()) / 1e9:.3f}"], (printed, got)
    return got, share
