"""Checkpoint conversion: read TP x PP weight shards lazily, merge them, reshard them, write our layout.

Used by tools/merge_mp_partitions.py, tools/convert_hf_to_megatron.py, tools/generate_text.py and
megatron/checkpoint/hf.py; all of it runs in one process on CPU, without torch.distributed.

Our checkpoints (megatron/checkpoint/format.py) hold one file per (TP rank, PP stage):
model_tp{tp:02d}_pp{pp:03d}.pt = {"weights": canonical name -> tensor, "partition_dims": name -> dim or None}
(under ZeRO-3, each DP rank's parts of it instead, model_tp{tp:02d}_pp{pp:03d}_dp{dp:05d}.pt, read as the same dict:
megatron/checkpoint/zero3.py).
Merging concatenates the TP slices of each tensor along its partition dim (the QKV weight's rows are
whole heads, BLOOM's per-head [q k v] layout, so a plain concatenation is right) and checks that replicated
tensors are identical on every TP rank. The embedding is stored only in the pp000 files.

Conversions stream: a reader (CheckpointReader for our layout, hf.HFReader for a Hugging Face folder) maps its
files (torch.load(mmap=True)) and reads only the window of a tensor that is asked for (megatron/checkpoint/
streams.py); write_megatron_checkpoint builds one (TP, PP) output shard at a time, so a conversion holds one
output shard of our layout, never the whole model (benchmarks/convert_memory.py measures it). Output folders are
built under a temporary sibling and renamed into place when complete (io.atomic_folder).
"""
import dataclasses
import json
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.checkpoint import zero3
from megatron.checkpoint.format import (check_shapes, expected_shapes, is_tag_folder, model_config_from_dict,
                                        partition_dim, read_latest, shard_name, tag_for, verify_checkpoint)
from megatron.checkpoint.io import (atomic_folder, fsync_tree, listed_entries, torch_save_synced, write_manifest,
                                    write_text_synced)
from megatron.checkpoint.streams import OpenFiles, narrow, owned, span_bytes, window, window_ranges
from megatron.config import ModelConfig
from megatron.file_modes import apply_umask
from megatron.model import spec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt")
SHARD_RE = re.compile(r"^model_tp(\d{2})_pp(\d{3})\.pt$")


# ---------------------------------------------------------------- reading our checkpoints


@dataclass
class MergedCheckpoint:
    """A whole model in one process: full tensors under canonical names, plus what the run recorded."""
    config: ModelConfig          # tensor_model_parallel_size 1
    weights: dict
    dtype: torch.dtype           # dtype of the stored weights
    folder: str
    iteration: int = 0
    consumed_samples: int = 0
    tokenizer_dir: Optional[str] = None
    run_config: Optional[dict] = None  # config.json as saved (None for a Hugging Face folder)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1


def resolve_checkpoint_folder(path, flag="--model-path"):
    """An iter_XXXXXXX folder (or any folder with meta.json), or a save root whose `latest` names one."""
    if not os.path.isdir(path):
        raise RuntimeError(f"{flag} {path}: no such folder; pass a checkpoint folder (iter_XXXXXXX) or the "
                           "--save folder that holds `latest`")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = read_latest(path)
    if latest is None:
        raise RuntimeError(f"{flag} {path}: neither a checkpoint (no meta.json) nor a save folder (no `latest` "
                           "file); pass an iter_XXXXXXX folder")
    folder = os.path.join(path, latest)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        raise RuntimeError(f"{flag} {path}: `latest` names {latest}, but {os.path.join(folder, 'meta.json')} "
                           "is missing; pass an iter_XXXXXXX folder explicitly")
    return folder


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as err:
        raise RuntimeError(f"{path} is missing; {what}") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RuntimeError(f"{path} is unreadable ({err}); {what}") from err


def read_shard(path, mmap=False):
    """{"weights", "partition_dims"} of one shard file, or RuntimeError naming the file. With mmap the tensors
    are views of the mapped file: nothing is read until they are used."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError as err:
        raise RuntimeError(f"{path} is missing") from err
    except (RuntimeError, KeyError, EOFError, OSError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as err:
        reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise RuntimeError(f"{path} is not a readable weight shard ({type(err).__name__}: {reason}); "
                           "the file is truncated or not one this project saved") from err
    if (not isinstance(shard, dict) or not isinstance(shard.get("weights"), dict)
            or not isinstance(shard.get("partition_dims"), dict)
            or not all(isinstance(t, torch.Tensor) for t in shard["weights"].values())):
        raise RuntimeError(f"{path} is not a weight shard of this project (expected a dict with 'weights' and "
                           "'partition_dims')")
    return shard


class CheckpointReader:
    """A checkpoint of any TP x PP layout (ZeRO 0-3, any precision), read lazily.

    Opening it checks the layout (meta.json, every shard file, the manifest's checksums unless verify=False) and
    the names and shapes in every shard against config.json's model, reading no tensor data. read() then merges
    one tensor, or a window of it, from the mapped shards of its stage.

    num_partitions: the TP size the caller expects (RuntimeError when the checkpoint holds another).
    """

    def __init__(self, path, num_partitions=None, flag="--model-path", verify=True):
        folder = resolve_checkpoint_folder(path, flag)
        meta = read_json(os.path.join(folder, "meta.json"), "the checkpoint is incomplete")
        run_config = read_json(os.path.join(folder, "config.json"), "the checkpoint is incomplete")
        try:
            tp, pp = int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"])
        except (KeyError, TypeError, ValueError) as err:
            raise RuntimeError(f"{os.path.join(folder, 'meta.json')} lacks the tensor/pipeline sizes ({err})") from err
        if num_partitions is not None and num_partitions != tp:
            raise RuntimeError(f"--num-partitions {num_partitions} does not match {folder}, which holds "
                               f"{tp} tensor-parallel partitions (meta.json); pass --num-partitions {tp} or omit it")
        found = sorted(n for n in os.listdir(folder) if SHARD_RE.match(n))
        expected = [shard_name(t, p) for p in range(pp) for t in range(tp)]
        for name in expected:
            if name not in found and not zero3.partitioned_paths(folder, *map(int, SHARD_RE.match(name).groups())):
                raise RuntimeError(f"{os.path.join(folder, name)} is missing (meta.json says TP {tp} x PP {pp}); "
                                   "the checkpoint is incomplete")
        extra = sorted(set(found) - set(expected))
        if extra:
            raise RuntimeError(f"{os.path.join(folder, extra[0])} does not fit the TP {tp} x PP {pp} layout in "
                               "meta.json; the folder mixes checkpoints")
        if verify:
            reason = verify_checkpoint(folder)
            if reason:
                raise RuntimeError(f"{flag} {path}: checkpoint is incomplete or corrupt: {reason}")
        if "model" not in run_config:
            raise RuntimeError(f"{os.path.join(folder, 'config.json')} has no model section")
        self.config = model_config_from_dict(run_config["model"], os.path.join(folder, "config.json"))
        self.folder, self.run_config = folder, run_config
        self.iteration = int(meta.get("iteration", 0))
        self.consumed_samples = int(meta.get("consumed_samples", 0))
        self.tensor_model_parallel_size, self.pipeline_model_parallel_size = tp, pp
        tokenizer_dir = os.path.join(folder, "tokenizer")
        self.tokenizer_dir = tokenizer_dir if os.path.isdir(tokenizer_dir) else None
        self._paths = {p: [os.path.join(folder, shard_name(t, p)) for t in range(tp)]
                       for p in range(pp)}
        self._where = {}  # name -> (stage, dim the TP slices are concatenated along, or None if replicated)
        shapes = self._scan()
        check_shapes(shapes, self.config, folder)
        self.shapes = {name: shapes[name] for name in expected_shapes(self.config)}
        self._files = OpenFiles(lambda file: self._read(file)["weights"])

    @staticmethod
    def _read(path):
        """{"weights", "partition_dims"} of the shard at path, or of the ZeRO-3 parts saved in its place (zero3.py:
        "weights" then assembles each tensor when asked), mapped."""
        tp_rank, pp_rank = map(int, SHARD_RE.match(os.path.basename(path)).groups())
        return zero3.read_weights(os.path.dirname(path), tp_rank, pp_rank, lambda file: read_shard(file, mmap=True))

    def _scan(self):
        """Full shapes and stored dtype from every shard's metadata (the files are mapped, not read)."""
        shapes = {}
        for p, paths in self._paths.items():
            shards = [self._read(x) for x in paths]
            names = list(shards[0]["weights"])
            for shard, path in zip(shards[1:], paths[1:]):
                if set(shard["weights"]) != set(names):
                    diff = sorted(set(shard["weights"]) ^ set(names))
                    raise RuntimeError(f"{path} holds other tensors than {paths[0]} ({diff[:3]}); the shards come "
                                       "from different checkpoints")
            for name in names:
                if name in self._where:
                    raise RuntimeError(f"{paths[0]}: {name} is also in an earlier stage's shard; the folder mixes "
                                       "checkpoints")
                pieces = [zero3.tensor_spec(shard["weights"], name) for shard in shards]  # (shape, dtype)
                for (piece_shape, piece_dtype), path in zip(pieces[1:], paths[1:]):
                    if piece_shape != pieces[0][0] or piece_dtype != pieces[0][1]:
                        raise RuntimeError(f"{path}: {name} is {piece_dtype} {tuple(piece_shape)} but "
                                           f"{pieces[0][1]} {tuple(pieces[0][0])} in {paths[0]}; the shards "
                                           "come from different checkpoints")
                dim = shards[0]["partition_dims"].get(name)
                if len(pieces) > 1 and dim is None:
                    dim = partition_dim(name)
                shape = list(pieces[0][0])
                if dim is not None:
                    if not isinstance(dim, int) or not 0 <= dim < len(shape):
                        raise RuntimeError(f"{paths[0]}: {name} has partition dim {dim!r} but {len(shape)} "
                                           "dimensions; the file is not one this project saved")
                    shape[dim] *= len(pieces)
                shapes[name] = tuple(shape)
                self._where[name] = (p, dim)
                if name == "embedding.word_embeddings.weight":
                    self.dtype = pieces[0][1]
            del shards
        return shapes

    def read(self, name, rows=None, cols=None, dtype=None):
        """Tensor `name` merged over the TP ranks, or its window rows x cols ((start, stop) in the full tensor;
        None: all), as a new contiguous tensor in dtype (floating tensors; None keeps the stored dtype). Only
        the window's bytes are read from the mapped files; replicated tensors are compared across TP ranks."""
        stage, dim = self._where[name]
        paths = self._paths[stage]
        pieces = [self._files.get(path)[name] for path in paths]
        ranges = window_ranges(self.shapes[name], rows, cols)
        if dim is None:
            views = [narrow(piece, ranges) for piece in pieces]
            for view, path in zip(views[1:], paths[1:]):
                if not torch.equal(view, views[0]):
                    raise RuntimeError(f"{path}: replicated tensor {name} differs from its copy in {paths[0]}; "
                                       "the shards come from different checkpoints or iterations")
            parts = views[:1]
        else:
            views = parts = window(pieces, dim, ranges)
        self._files.charge(sum(span_bytes(view) for view in views))
        return owned(parts, dim, dtype)

    def close(self):
        self._files.close()


def load_merged_checkpoint(path, num_partitions=None, flag="--model-path", verify=True):
    """Reads a checkpoint of any TP x PP layout (ZeRO 0-3, any precision) and merges it into full tensors, all
    in memory (generation needs the whole model; conversions use CheckpointReader and stream).

    num_partitions: the TP size the caller expects (RuntimeError when the checkpoint holds another).
    """
    reader = CheckpointReader(path, num_partitions, flag, verify)
    weights = {name: reader.read(name) for name in reader.shapes}
    reader.close()
    return MergedCheckpoint(
        config=reader.config, weights=weights, dtype=reader.dtype, folder=reader.folder,
        iteration=reader.iteration, consumed_samples=reader.consumed_samples, tokenizer_dir=reader.tokenizer_dir,
        run_config=reader.run_config, tensor_model_parallel_size=reader.tensor_model_parallel_size,
        pipeline_model_parallel_size=reader.pipeline_model_parallel_size)


class DictReader:
    """The reader interface (shapes, dtype, read) over full tensors already in memory."""

    def __init__(self, weights):
        self.weights = weights
        self.shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
        embedding = weights.get("embedding.word_embeddings.weight")
        self.dtype = embedding.dtype if embedding is not None else None

    def read(self, name, rows=None, cols=None, dtype=None):
        tensor = self.weights[name]
        return owned([narrow(tensor, window_ranges(tensor.shape, rows, cols))], None, dtype)

    def close(self):
        pass


def as_reader(weights):
    return weights if hasattr(weights, "read") else DictReader(weights)


# ---------------------------------------------------------------- splitting


def stage_names(config, tp, pp, tp_flag="--target-tensor-parallel-size", pp_flag="--target-pipeline-parallel-size",
                partition_method=spec.DEFAULT_PARTITION_METHOD):
    """[names of stage 0, names of stage 1, ...] for a TP x PP layout, each in canonical order (ValueError naming
    the flag when the layout does not fit the model): the stages DeepSpeed's PipelineModule gives the layers under
    partition_method (spec.stage_names). The embedding is in stage 0 only, as save.model_shard stores it."""
    for flag, value in ((tp_flag, tp), (pp_flag, pp)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    if pp > config.num_layers:
        raise ValueError(f"{pp_flag} {pp} exceeds the {config.num_layers} layers; "
                         f"use at most {config.num_layers}")
    try:
        dataclasses.replace(config, tensor_model_parallel_size=tp)
    except ValueError as err:
        raise ValueError(f"{tp_flag} {tp} does not fit this model: {err}") from err
    return spec.stage_names(config, pp, partition_method, tp)


def partition_method_of(run_config):
    """DeepSpeed's partition method of the run whose config.json is run_config (its --pp-partition-method), so a
    converted checkpoint is staged as a run with the same flags stages its PipelineModule; the default for none."""
    from megatron.upstream_compat import pipeline_partition_method
    value = ((run_config or {}).get("upstream") or {}).get("pp_partition_method")
    return pipeline_partition_method(value) if value else spec.DEFAULT_PARTITION_METHOD


def target_piece(shape, dim, tp_rank, tp):
    """(rows, cols) of TP rank tp_rank's slice of a tensor of `shape` split tp ways along dim (None: all)."""
    if dim is None or tp == 1:
        return None, None
    size = shape[dim] // tp
    bounds = (tp_rank * size, (tp_rank + 1) * size)
    return (bounds, None) if dim == 0 else (None, bounds)


def read_shard_for(reader, names, tp_rank, tp, dtype=None):
    """Our shard format {"weights", "partition_dims"} of TP rank tp_rank (of tp) for `names`, read from reader;
    the partition dims are recorded at every TP size, as training's saves record them."""
    shard = {"weights": {}, "partition_dims": {}}
    for name in names:
        dim = partition_dim(name)
        rows, cols = target_piece(reader.shapes[name], dim if tp > 1 else None, tp_rank, tp)
        shard["weights"][name] = reader.read(name, rows, cols, dtype)
        shard["partition_dims"][name] = dim
    return shard


def cast_weights(weights, dtype):
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in weights.items()}


def resolve_dtype(name, stored):
    """--dtype auto keeps the stored dtype; fp32/bf16/fp16 convert."""
    return stored if name == "auto" else DTYPES[name]


# ---------------------------------------------------------------- tokenizer files


def copy_tokenizer(src, dst):
    """Copies the Hugging Face tokenizer files of folder src (those present) into dst; returns their names."""
    copied = []
    if src is None:
        return copied
    os.makedirs(dst, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def has_tokenizer(folder):
    return folder is not None and (os.path.isfile(os.path.join(folder, "tokenizer.json")) or (
        os.path.isfile(os.path.join(folder, "vocab.json")) and os.path.isfile(os.path.join(folder, "merges.txt"))))


# ---------------------------------------------------------------- our layout


def layout_config(run_config, tp, pp):
    """config.json for a TP x PP layout: run_config (a run's config.json, or {}) with the new parallel sizes."""
    config = json.loads(json.dumps(run_config or {}, default=str))
    config.setdefault("model", {})["tensor_model_parallel_size"] = tp
    parallel = config.setdefault("parallel", {})
    parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    if "data_parallel_size" in parallel:
        parallel["data_parallel_size"] = 1
    return config


def write_checkpoint_folder(out, iteration, stages, tp, write_rank, run_config, meta, tokenizer_dir=None,
                            force=False, flag="--output-path"):
    """Writes one checkpoint folder of our layout atomically, for tools (one process).

    write_rank(folder, tp_rank, stage, names) writes that rank's files (each through io's synced writes) and
    returns their manifest entries, so the manifest reads nothing back. If the basename of `out` is
    iter_XXXXXXX, `out` is the checkpoint folder itself; otherwise `out` is a save root holding iter_XXXXXXX/
    and `latest` (what --load and --save use). Returns the checkpoint folder."""
    is_tag = is_tag_folder(out)
    tag = tag_for(iteration)
    with atomic_folder(out, force, flag) as tmp:
        folder = tmp if is_tag else os.path.join(tmp, tag)
        os.makedirs(folder, exist_ok=True)
        written = {}
        for p, names in enumerate(stages):
            for t in range(tp):
                written.update(write_rank(folder, t, p, names))
        for name, obj in (("config.json", run_config), ("meta.json", meta)):
            written[name] = write_text_synced(json.dumps(obj, indent=2, default=str), os.path.join(folder, name))
        if has_tokenizer(tokenizer_dir):
            copy_tokenizer(tokenizer_dir, os.path.join(folder, "tokenizer"))
            written.update({os.path.join("tokenizer", rel): entry
                            for rel, entry in listed_entries(os.path.join(folder, "tokenizer")).items()})
        apply_umask(tmp)  # the copied tokenizer files keep their source's mode otherwise
        fsync_tree(folder)
        write_manifest(folder, iteration, written)  # what this tool wrote, not a listing of the folder
        if not is_tag:
            with open(os.path.join(tmp, "latest"), "w") as f:
                f.write(tag)
    final = os.path.abspath(out)
    return final if is_tag else os.path.join(final, tag)


def write_megatron_checkpoint(out, weights, config, tp, pp, *, iteration=0, consumed_samples=0, run_config=None,
                              tokenizer_dir=None, precision="fp32", source=None, force=False, dtype=None):
    """Writes our checkpoint layout for TP x PP with weights only ("deepspeed_state": false).

    weights: full tensors by canonical name, or a reader (CheckpointReader, HFReader); dtype: the output dtype of
    floating tensors (None keeps theirs). The (TP, PP) shards are built one at a time, each read piece by piece
    from the reader, so at most one output shard is in memory. `out` as write_checkpoint_folder takes it.
    """
    reader = as_reader(weights)
    stages = stage_names(config, tp, pp, partition_method=partition_method_of(run_config))
    check_shapes(reader.shapes, config, "the weights to write")
    run_config = layout_config(run_config, tp, pp)
    run_config["model"].update(dataclasses.asdict(dataclasses.replace(config, tensor_model_parallel_size=tp)))
    meta = {"iteration": iteration, "consumed_samples": consumed_samples, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "data_parallel_size": None, "zero_stage": None,
            "precision": precision, "deepspeed_state": False, "converted_from": source}

    def write_rank(folder, t, p, names):
        name = shard_name(t, p)
        return {name: torch_save_synced(read_shard_for(reader, names, t, tp, dtype), os.path.join(folder, name))}

    return write_checkpoint_folder(out, iteration, stages, tp, write_rank, run_config, meta, tokenizer_dir, force)


def build_model(merged, dtype=None, tp=1, tp_rank=0, device="cpu", attention_impl="torch", tp_group=None):
    """A BloomModel (parallel_output=False, eval mode) holding merged's weights; with tp > 1 this rank's slice,
    tp_group being the tensor-parallel ProcessGroup of the tp ranks (rank tp_rank in it)."""
    from megatron.model.bloom import BloomModel

    config = dataclasses.replace(merged.config, tensor_model_parallel_size=tp, attention_impl=attention_impl,
                                 hidden_dropout=0.0, attention_dropout=0.0)
    weights = merged.weights
    if tp > 1:  # this rank's slices only
        names = stage_names(merged.config, tp, 1, tp_flag="torchrun --nproc_per_node")[0]
        weights = read_shard_for(as_reader(weights), names, tp_rank, tp)["weights"]
    dtype = dtype or merged.dtype
    model = BloomModel(config, parallel_output=False, tp_group=tp_group)
    model.load_state_dict(cast_weights(weights, dtype), strict=True)
    return model.to(device=device, dtype=dtype).eval()
