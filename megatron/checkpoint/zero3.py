"""ZeRO-3 weights, shard by shard: each rank saves and loads its own partition of every parameter, nothing gathered.

Under ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) each parameter's flattened TP slice is cut into DP-size equal parts, part
r on DP rank r (param.ds_tensor, the last one padded). Gathering the whole model to save or load it would hold the
full unsharded parameter set on every rank, so instead every rank writes its own parts of the weights:

    model_tp{t}_pp{p}_dp{d}.pt  {"weights": name -> 1-D part (this rank's region of the flattened TP slice),
                                 "regions": name -> [start, numel], "shapes": name -> the TP slice's shape,
                                 "partition_dims": name -> the TP partition dim or None}

the same regions as its optimizer file (megatron/checkpoint/optimizer_state.py), in place of the one
model_tp{t}_pp{p}.pt other stages write. Readers (load.load_model_weights, convert.CheckpointReader and the tools on
it) see the same {"weights", "partition_dims"} either way (read_weights): for partitioned files, "weights" is a
mapping that assembles one parameter's TP slice from the DP parts when it is asked for (one parameter at a time in
memory). Loading into a ZeRO-3 engine copies into each rank's part only the elements of that part (load_partitions):
on the same DP size straight from the rank's own file, on another from the one parameter assembled.
"""
import collections.abc
import os

import torch

from megatron.checkpoint.format import partitioned_shard_name, shard_name


def is_zero3_parameter(param):
    return hasattr(param, "ds_tensor")


def part_of(param, group=None):
    """(start, numel) of this rank's part of a ZeRO-3 parameter's flattened TP slice (numel 0: it holds none);
    group: the DP group, where the parameter names none (ds_process_group)."""
    import torch.distributed as dist
    count = param.ds_tensor.ds_numel
    start = dist.get_rank(group=getattr(param, "ds_process_group", None) or group) * count
    return start, max(0, min(count, param.ds_numel - start))


def partition_shard(named, dims, host=None):
    """This rank's weights file (the module docstring's dict) from [(canonical name, ZeRO-3 parameter)]; dims:
    {canonical name: partition dim}. host (an async_save.HostBuffers): copies into it; None: fresh CPU copies of
    this rank's parts only."""
    shard = {"weights": {}, "regions": {}, "shapes": {}, "partition_dims": {}}
    for name, param in named:
        start, numel = part_of(param)
        shard["shapes"][name] = list(param.ds_shape)
        shard["partition_dims"][name] = dims.get(name)
        if numel == 0:
            continue
        part = param.ds_tensor.detach().narrow(0, 0, numel)
        shard["weights"][name] = host.copy(("weights", name), part) if host is not None else part.to("cpu", copy=True)
        shard["regions"][name] = [start, numel]
    return shard


class AssembledWeights(collections.abc.Mapping):
    """{name: TP slice} over the DP parts of one (TP rank, stage): each access assembles that one tensor from the
    parts (views of the mapped files until copied together)."""

    def __init__(self, parts):
        self.parts = parts  # the partition files' dicts, DP rank order
        self.shapes = parts[0]["shapes"]

    def __getitem__(self, name):
        shape = self.shapes[name]
        pieces = sorted((shard["regions"][name][0], shard["weights"][name]) for shard in self.parts
                        if name in shard["regions"])
        covered = sum(piece.numel() for _, piece in pieces)
        if covered != torch.Size(shape).numel():
            raise RuntimeError(f"the ZeRO-3 weight parts hold {covered} of {torch.Size(shape).numel()} elements "
                               f"of {name}; the checkpoint is incomplete")
        return torch.cat([piece.reshape(-1) for _, piece in pieces]).view(shape)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)

    def spec(self, name):
        """(shape, dtype) of tensor `name`, read from no tensor's data."""
        first = next(shard["weights"][name] for shard in self.parts if name in shard["weights"])
        return torch.Size(self.shapes[name]), first.dtype


def partitioned_paths(folder, tp_rank, pp_rank):
    """The ZeRO-3 weight part files of (TP rank, stage) in DP rank order ([] when the stage has one shard file)."""
    paths = []
    while os.path.isfile(os.path.join(folder, partitioned_shard_name(tp_rank, pp_rank, len(paths)))):
        paths.append(os.path.join(folder, partitioned_shard_name(tp_rank, pp_rank, len(paths))))
    return paths


def read_weights(folder, tp_rank, pp_rank, read):
    """{"weights", "partition_dims"} of (TP rank, stage), whichever way it was saved; read(path) loads one file."""
    parts = partitioned_paths(folder, tp_rank, pp_rank)
    if not parts:
        return read(os.path.join(folder, shard_name(tp_rank, pp_rank)))
    shards = [read(path) for path in parts]
    return {"weights": AssembledWeights(shards), "partition_dims": shards[0]["partition_dims"]}


def tensor_spec(weights, name):
    """(shape, dtype) of weights[name] without reading its data (an AssembledWeights' or a mapped tensor's)."""
    if isinstance(weights, AssembledWeights):
        return weights.spec(name)
    return weights[name].shape, weights[name].dtype


def load_partitions(module, weights, own=None):
    """Copies into each ZeRO-3 parameter of module (a BloomModel: canonical names) its part of weights[name]
    (a zero-argument function returning the TP slice: called when its turn comes, one parameter at a time).
    own: this rank's part file saved on the same DP size (partition_shard's dict); a part it holds is copied
    from it and nothing else is read for that parameter."""
    params = dict(module.named_parameters())
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise KeyError(f"the checkpoint's weights do not match the model (missing {missing[:3]}, unexpected "
                       f"{unexpected[:3]})")
    with torch.no_grad():
        for name, param in params.items():
            start, numel = part_of(param)
            if own is not None and own["regions"].get(name) == [start, numel]:
                shape, flat = own["shapes"][name], own["weights"][name]
            else:
                tensor = weights[name]()
                shape, flat = tensor.shape, tensor.reshape(-1).narrow(0, start, numel)
            if tuple(shape) != tuple(param.ds_shape):
                raise KeyError(f"{name} has shape {tuple(shape)} in the checkpoint, {tuple(param.ds_shape)} in "
                               "the model")
            param.ds_tensor.narrow(0, 0, numel).copy_(flat)
