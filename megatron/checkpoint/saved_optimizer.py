"""Saved optimizer state per parameter: the index files and their reader, for resuming on another layout.

Pure module (files and tensors only; no process group, no DeepSpeed). Every rank that writes an optimizer file
(optimizer_tp{t}_pp{p}_dp{d}.pt, DeepSpeed's optimizer wrapper's state_dict, megatron/checkpoint/optimizer_state.py)
also writes index_tp{t}_pp{p}_dp{d}.json, which says where each of its parameters' state lies inside that file:

    {"version": 1, "step": 11.0, "params": {canonical name: {
        "shape": [rows, cols],          this TP rank's slice of the parameter
        "partition_dim": 0 | 1 | null,  set by the layer that owns it (tensor_model_parallel / partition_dim)
        "pieces": [{"state": [path to the dict holding exp_avg, exp_avg_sq],
                    "fp32": [path to the fp32 master tensor] | null (fp32 runs: the weights are the master),
                    "offset": where the piece starts in those tensors (flattened),
                    "start": where it starts in the flattened parameter slice, "numel": its length}]}}}

A path is the keys and list positions from the file's top level down to a tensor (or a dict of tensors). ZeRO
partitions and BF16_Optimizer give a parameter one piece per DP rank that holds part of it; torch's AdamW and
FP16_UnfusedOptimizer one piece, the whole slice. The index holds no tensor, so every tensor is still stored once;
the tied word embedding is indexed on the first pipeline stage only (the last stage's copy holds the same).

Reading on any layout (SavedOptimizer.full): the pieces of every DP rank make each TP slice, the TP slices
concatenated along the partition dim make the whole parameter; target_slice cuts the new TP rank's slice.
"""
import json
import os

import torch

from megatron.checkpoint.format import index_name, optimizer_name
from megatron.checkpoint.streams import OpenFiles

VERSION = 1
KEYS = ("exp_avg", "exp_avg_sq")


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


class SavedOptimizer:
    """The per-parameter optimizer state of a checkpoint folder, read through its index files.

    meta: the folder's meta.json. Files are opened lazily (memory-mapped) and dropped after
    streams.READ_BLOCK_BYTES read through them (streams.OpenFiles), so memory stays bounded for any model.
    Raises FileNotFoundError naming a missing index (checkpoints written before the index existed)."""

    def __init__(self, folder, meta):
        self.folder = folder
        self.tp = meta["tensor_model_parallel_size"]
        self.pp = meta["pipeline_model_parallel_size"]
        dp = meta["data_parallel_size"]
        self.locations = {}  # name -> {tp_rank: [(file, piece)]}
        self.entries = {}  # name -> {tp_rank: entry}
        self.step = None
        # mapped files dropped after every READ_BLOCK_BYTES read through them: bounded RSS for any model size
        self._files = OpenFiles(lambda path: torch.load(path, map_location="cpu", weights_only=False,
                                                        mmap=True)["optimizer"])
        for t in range(self.tp):
            for p in range(self.pp):
                for d in range(dp):
                    path = os.path.join(folder, index_name(t, p, d))
                    if not os.path.isfile(path):
                        if d == 0:
                            raise FileNotFoundError(path)
                        continue  # replicated state: DP rank 0's file serves all
                    with open(path) as f:
                        index = json.load(f)
                    if self.step is None:
                        self.step = index["step"]
                    for name, entry in index["params"].items():
                        self.entries.setdefault(name, {})[t] = entry
                        places = self.locations.setdefault(name, {}).setdefault(t, [])
                        places.extend((optimizer_name(t, p, d), piece) for piece in entry["pieces"])

    def names(self):
        return sorted(self.entries)

    def has_fp32(self, name=None):
        """Whether fp32 master weights are saved (for parameter `name`, or for any)."""
        locations = self.locations.values() if name is None else [self.locations[name]]
        return any(piece["fp32"] is not None for tps in locations for places in tps.values() for _, piece in places)

    def partition_dim(self, name):
        return self.entries[name][0]["partition_dim"]

    def tp_slice(self, name, key, tp_rank):
        """Saved TP rank tp_rank's slice of parameter `name`'s state `key` ("fp32", "exp_avg", "exp_avg_sq")."""
        entry = self.entries[name][tp_rank]
        shape = entry["shape"]
        out = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
        covered = 0
        for file, piece in self.locations[name][tp_rank]:
            state = self._files.get(os.path.join(self.folder, file))
            source = resolve(state, piece["fp32"]) if key == "fp32" else resolve(state, piece["state"])[key]
            out[piece["start"]:piece["start"] + piece["numel"]] = \
                source.reshape(-1)[piece["offset"]:piece["offset"] + piece["numel"]].float()
            self._files.charge(piece["numel"] * source.element_size())
            covered += piece["numel"]
        if covered != out.numel():
            raise ValueError(f"{self.folder}: the optimizer files hold {covered} of {out.numel()} elements of "
                             f"{name}'s {key} for TP rank {tp_rank}")
        return out.view(shape)

    def full(self, name, key, dim=None):
        """The whole parameter's state `key` (TP slices concatenated along the parameter's partition dim, or
        along dim where the index records none)."""
        dim = self.partition_dim(name) if self.partition_dim(name) is not None else dim
        slices = [self.tp_slice(name, key, t) for t in range(self.tp)] if dim is not None else \
            [self.tp_slice(name, key, 0)]
        return torch.cat(slices, dim) if len(slices) > 1 else slices[0]
