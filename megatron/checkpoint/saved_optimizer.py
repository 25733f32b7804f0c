"""Saved optimizer state per parameter: the index files and their reader, for resuming on any layout.

Pure module (files and tensors only; no process group, no DeepSpeed). Every rank that writes an optimizer file
(optimizer_tp{t}_pp{p}_dp{d}.pt, megatron/checkpoint/optimizer_state.py) also writes index_tp{t}_pp{p}_dp{d}.json,
which names the parameters whose state the file holds and the region of each:

    {"version": 2, "step": 11.0, "params": {canonical name: {
        "shape": [rows, cols],          this TP rank's slice of the parameter
        "partition_dim": 0 | 1 | null,  set by the layer that owns it (tensor_model_parallel / partition_dim)
        "start": 0, "numel": 24,        the region of the flattened slice held in the file (a ZeRO rank's part)
        "fp32": true | false}}}         whether the fp32 master weights are saved (false in fp32: the weights are)

The file holds the region's tensors at ["optimizer"]["params"][name][key] (key: "fp32", "exp_avg", "exp_avg_sq").
A parameter partitioned over DP has one region per DP rank that holds part of it; replicated state one region,
the whole slice, in DP rank 0's file; the tied word embedding is saved on the first pipeline stage only.

Version 1 (checkpoints of FORMAT 2, written before the optimizer adapters; also tools/convert_checkpoint.py's output)
stored a "pieces" list per parameter instead: {"state": path to the dict holding exp_avg/exp_avg_sq, "fp32": path to
the fp32 master or null, "offset": where the piece starts in those flat tensors, "start", "numel"}, a path being the
keys and list positions from the file's "optimizer" entry down. Both are read (SavedOptimizer); version 2 is written.

Reading on any layout (SavedOptimizer.full): the regions of every DP rank make each TP slice, the TP slices
concatenated along the partition dim make the whole parameter; target_slice cuts the new TP rank's slice. On the
same TP size, SavedOptimizer.region reads one rank's region from the saved regions that overlap it.
"""
import json
import os

import torch

from megatron.checkpoint.format import index_name, optimizer_name
from megatron.checkpoint.reads import load_mapped, read_json, read_slice
from megatron.checkpoint.streams import OpenFiles

VERSION = 2
KEYS = ("exp_avg", "exp_avg_sq")


def index_entry(shape, partition_dim, start, numel, fp32):
    """One parameter's entry of a version-2 index (see the module docstring)."""
    return {"shape": list(shape), "partition_dim": partition_dim, "start": int(start), "numel": int(numel),
            "fp32": bool(fp32)}


def index_text(step, params):
    """The JSON of an index (params: canonical name -> entry as in the module docstring)."""
    return json.dumps({"version": VERSION, "step": step, "params": params}, sort_keys=True)


def resolve(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def target_slice(tensor, dim, tp, tp_rank):
    """TP rank tp_rank's slice (of tp) of a whole tensor along dim (the tensor itself when dim is None)."""
    if dim is None or tp == 1:
        return tensor
    if tensor.shape[dim] % tp:
        raise ValueError(f"size {tensor.shape[dim]} along dim {dim} is not divisible by {tp} tensor-parallel ranks")
    return tensor.chunk(tp, dim)[tp_rank].contiguous()


def _pieces(name, entry):
    """[(start, numel, fp32 saved, locate(file's dict, key) -> (flat tensor, offset))] of an index entry."""
    if "pieces" not in entry:  # version 2: regions named by parameter
        return [(entry["start"], entry["numel"], entry["fp32"],
                 lambda saved, key: (saved["optimizer"]["params"][name][key], 0))]
    out = []
    for piece in entry["pieces"]:  # version 1: paths into the file's "optimizer" dict
        def locate(saved, key, piece=piece):
            state = saved["optimizer"]
            return (resolve(state, piece["fp32"]) if key == "fp32" else resolve(state, piece["state"])[key],
                    piece["offset"])
        out.append((piece["start"], piece["numel"], piece["fp32"] is not None, locate))
    return out


def read_indexes(folder, meta, tp_ranks=None, pp_ranks=None):
    """{(tp, pp, dp): index} of a checkpoint folder's index files (of the TP ranks and stages given; default all).
    A training run has one rank read them and broadcast them (load.py), instead of every rank opening every file.
    Raises FileNotFoundError naming a missing DP rank 0 index (checkpoints written before the index existed)."""
    indexes = {}
    for t in range(meta["tensor_model_parallel_size"]) if tp_ranks is None else tp_ranks:
        for p in range(meta["pipeline_model_parallel_size"]) if pp_ranks is None else pp_ranks:
            for d in range(meta["data_parallel_size"]):
                path = os.path.join(folder, index_name(t, p, d))
                if not os.path.isfile(path):
                    if d == 0:
                        raise FileNotFoundError(path)
                    continue  # replicated state: DP rank 0's file serves all
                indexes[(t, p, d)] = read_json(path)
    return indexes


class SavedOptimizer:
    """The per-parameter optimizer state of a checkpoint folder, read through its index files.

    meta: the folder's meta.json; tp_ranks / pp_ranks: the saved TP ranks and stages to index (default all);
    indexes: read_indexes' dict, read once by one rank and broadcast (default: read here).
    Files are opened lazily (memory-mapped) and dropped after streams.READ_BLOCK_BYTES read through them
    (streams.OpenFiles), so memory stays bounded for any model. Raises FileNotFoundError naming a missing index
    (checkpoints written before the index existed)."""

    def __init__(self, folder, meta, tp_ranks=None, pp_ranks=None, indexes=None):
        self.folder = folder
        self.tp = meta["tensor_model_parallel_size"]
        self.locations = {}  # name -> {tp_rank: [(file, piece)]}
        self.entries = {}  # name -> {tp_rank: entry}
        self.step = None
        # mapped files dropped after every READ_BLOCK_BYTES read through them: bounded RSS for any model size
        self._files = OpenFiles(load_mapped)
        if indexes is None:
            indexes = read_indexes(folder, meta, tp_ranks, pp_ranks)
        for (t, p, d), index in sorted(indexes.items()):
            if (tp_ranks is not None and t not in tp_ranks) or (pp_ranks is not None and p not in pp_ranks):
                continue
            if self.step is None:
                self.step = index["step"]
            for name, entry in index["params"].items():
                self.entries.setdefault(name, {})[t] = entry
                places = self.locations.setdefault(name, {}).setdefault(t, [])
                places.extend((optimizer_name(t, p, d), piece) for piece in _pieces(name, entry))

    def names(self):
        return sorted(self.entries)

    def has_fp32(self, name=None):
        """Whether fp32 master weights are saved (for parameter `name`, or for any)."""
        locations = self.locations.values() if name is None else [self.locations[name]]
        return any(piece[2] for tps in locations for places in tps.values() for _, piece in places)

    def partition_dim(self, name):
        return next(iter(self.entries[name].values()))["partition_dim"]

    def region(self, name, key, tp_rank, start, numel):
        """Elements [start, start + numel) of saved TP rank tp_rank's flattened slice of parameter `name`'s state
        `key` ("fp32", "exp_avg", "exp_avg_sq"), as fp32, from the saved regions that overlap them."""
        return self.window(name, key, self.tp, tp_rank, start, numel)

    def window(self, name, key, tp, tp_rank, start, numel, dim=None):
        """Elements [start, start + numel) of TP rank tp_rank's (of tp, any TP size) flattened slice of parameter
        `name`'s state `key`, as fp32: only the overlapping parts of the saved regions are read (reads.read_slice),
        never the whole parameter. dim: the partition dim where the index records none."""
        recorded = self.partition_dim(name)
        dim = recorded if recorded is not None else dim
        shape = next(iter(self.entries[name].values()))["shape"]

        def pieces(t, lo, hi):
            out = []
            for file, (begin, length, _, locate) in self.locations[name].get(t, ()):
                if begin < hi and begin + length > lo:
                    source, offset = locate(self._files.get(os.path.join(self.folder, file)), key)
                    out.append((begin, source.reshape(-1)[offset:offset + length]))
                    self._files.charge((min(hi, begin + length) - max(lo, begin)) * source.element_size())
            return out
        out, found = read_slice(pieces, shape, dim, self.tp, tp, tp_rank, start, numel, torch.float32)
        if found != numel:
            raise ValueError(f"{self.folder}: the optimizer files hold {found} of {numel} elements of {name}'s "
                             f"{key} for TP rank {tp_rank}")
        return out

    def tp_slice(self, name, key, tp_rank):
        """Saved TP rank tp_rank's slice of parameter `name`'s state `key`."""
        shape = self.entries[name][tp_rank]["shape"]
        return self.region(name, key, tp_rank, 0, int(torch.Size(shape).numel())).view(shape)

    def full(self, name, key, dim=None):
        """The whole parameter's state `key` (TP slices concatenated along the parameter's partition dim, or
        along dim where the index records none)."""
        dim = self.partition_dim(name) if self.partition_dim(name) is not None else dim
        slices = [self.tp_slice(name, key, t) for t in range(self.tp)] if dim is not None else \
            [self.tp_slice(name, key, 0)]
        return torch.cat(slices, dim) if len(slices) > 1 else slices[0]
