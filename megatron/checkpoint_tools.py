"""Checkpoint tools' library: read TP x PP weight shards lazily, merge or reshard them, write and read HF BLOOM folders.

Used by tools/merge_mp_partitions.py, tools/convert_hf_to_megatron.py and tools/generate_text.py; all of it
runs in one process on CPU, without torch.distributed.

Our checkpoints (see megatron/checkpointing.py) hold one file per (TP rank, PP stage):
model_tp{tp:02d}_pp{pp:03d}.pt = {"weights": canonical name -> tensor, "partition_dims": name -> dim or None}.
Merging concatenates the TP slices of each tensor along its partition dim (the QKV weight's rows are
whole heads, BLOOM's per-head [q k v] layout, so a plain concatenation is right) and checks that replicated
tensors are identical on every TP rank. The embedding is stored only in the pp000 files.

Conversions stream: a reader (CheckpointReader for our layout, HFReader for a Hugging Face folder) maps its
files (torch.load(mmap=True), safetensors' safe_open) and reads only the window of a tensor that is asked for;
write_hf_folder writes each safetensors shard tensor by tensor, in blocks of at most
tensor_streams.READ_BLOCK_BYTES (128 MiB), and write_megatron_checkpoint builds one (TP, PP) output shard at a
time. A conversion holds one block of the HF output, or one output shard of our layout, never the whole model: a
176B model exports on a host with less RAM than the model (benchmarks/convert_memory.py measures it).

Every output folder is built under a hidden temporary sibling and renamed into place when complete, so an
error never leaves a half-written --output-path behind.
"""
import contextlib
import dataclasses
import json
import logging
import math
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from typing import Optional

import torch

from megatron import checkpointing
from megatron.config import ModelConfig
from megatron.file_modes import apply_umask
from megatron.tensor_streams import (SAFETENSORS_TORCH, OpenFiles, SafetensorsWriter, narrow, owned, row_blocks,
                                      span_bytes, window, window_ranges)

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt")
SHARD_RE = re.compile(r"^model_tp(\d{2})_pp(\d{3})\.pt$")

# Dimension along which tensor parallelism splits each canonical tensor (None: replicated on every rank).
_PARTITION_DIMS = [
    (re.compile(r"^embedding\.word_embeddings\.weight$"), 0),
    (re.compile(r"^layers\.\d+\.self_attention\.query_key_value\.(weight|bias)$"), 0),
    (re.compile(r"^layers\.\d+\.self_attention\.dense\.weight$"), 1),
    (re.compile(r"^layers\.\d+\.mlp\.dense_h_to_4h\.(weight|bias)$"), 0),
    (re.compile(r"^layers\.\d+\.mlp\.dense_4h_to_h\.weight$"), 1),
]


def partition_dim(name):
    for regex, dim in _PARTITION_DIMS:
        if regex.match(name):
            return dim
    return None


def expected_shapes(config):
    """Canonical name -> full (unsplit) shape for a ModelConfig, in BloomModel's parameter order."""
    h, f, v = config.hidden_size, config.ffn_dim, config.vocab_size
    shapes = {"embedding.word_embeddings.weight": (v, h)}
    if config.embed_layernorm:
        shapes.update({"embedding.word_embeddings_layernorm.weight": (h,),
                       "embedding.word_embeddings_layernorm.bias": (h,)})
    for n in range(config.num_layers):
        p = f"layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
            p + "self_attention.query_key_value.weight": (3 * h, h), p + "self_attention.query_key_value.bias": (3 * h,),
            p + "self_attention.dense.weight": (h, h), p + "self_attention.dense.bias": (h,),
            p + "post_attention_layernorm.weight": (h,), p + "post_attention_layernorm.bias": (h,),
            p + "mlp.dense_h_to_4h.weight": (f, h), p + "mlp.dense_h_to_4h.bias": (f,),
            p + "mlp.dense_4h_to_h.weight": (h, f), p + "mlp.dense_4h_to_h.bias": (h,),
        })
    shapes.update({"final_layernorm.weight": (h,), "final_layernorm.bias": (h,)})
    return shapes


def check_shapes(shapes, config, source):
    """RuntimeError naming source when names or shapes ({name: shape}) differ from what config describes."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in shapes]
    unexpected = [name for name in shapes if name not in expected]
    if missing or unexpected:
        raise RuntimeError(f"{source}: the weights do not match the model config "
                           f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
                           f"{unexpected[:3]}{'...' if len(unexpected) > 3 else ''}); is the checkpoint complete?")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise RuntimeError(f"{source}: {name} has shape {tuple(shapes[name])} but the model config "
                               f"implies {shape}")


def check_weights(weights, config, source):
    """check_shapes for a dict of tensors."""
    check_shapes({name: tuple(tensor.shape) for name, tensor in weights.items()}, config, source)


def model_config_from_dict(fields, source, **overrides):
    """ModelConfig from config.json's "model" section (unknown keys ignored), as a single-process model."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in fields.items() if k in known}
    values.update(tensor_model_parallel_size=1, checkpoint_activations=False, fused_layernorm=False)
    values.update(overrides)
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as err:
        raise RuntimeError(f"{source}: the model section is not a valid model config ({err})") from err


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
    latest = checkpointing.read_latest(path)
    if latest is None:
        raise RuntimeError(f"{flag} {path}: neither a checkpoint (no meta.json) nor a save folder (no `latest` "
                           "file); pass an iter_XXXXXXX folder")
    folder = os.path.join(path, latest)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        raise RuntimeError(f"{flag} {path}: `latest` names {latest}, but {os.path.join(folder, 'meta.json')} "
                           "is missing; pass an iter_XXXXXXX folder explicitly")
    return folder


def _read_json(path, what):
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
        meta = _read_json(os.path.join(folder, "meta.json"), "the checkpoint is incomplete")
        run_config = _read_json(os.path.join(folder, "config.json"), "the checkpoint is incomplete")
        try:
            tp, pp = int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"])
        except (KeyError, TypeError, ValueError) as err:
            raise RuntimeError(f"{os.path.join(folder, 'meta.json')} lacks the tensor/pipeline sizes ({err})") from err
        if num_partitions is not None and num_partitions != tp:
            raise RuntimeError(f"--num-partitions {num_partitions} does not match {folder}, which holds "
                               f"{tp} tensor-parallel partitions (meta.json); pass --num-partitions {tp} or omit it")
        found = sorted(n for n in os.listdir(folder) if SHARD_RE.match(n))
        expected = [checkpointing.shard_name(t, p) for p in range(pp) for t in range(tp)]
        for name in expected:
            if name not in found:
                raise RuntimeError(f"{os.path.join(folder, name)} is missing (meta.json says TP {tp} x PP {pp}); "
                                   "the checkpoint is incomplete")
        extra = sorted(set(found) - set(expected))
        if extra:
            raise RuntimeError(f"{os.path.join(folder, extra[0])} does not fit the TP {tp} x PP {pp} layout in "
                               "meta.json; the folder mixes checkpoints")
        if verify:
            reason = checkpointing.verify_checkpoint(folder)
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
        self._paths = {p: [os.path.join(folder, checkpointing.shard_name(t, p)) for t in range(tp)]
                       for p in range(pp)}
        self._where = {}  # name -> (stage, dim the TP slices are concatenated along, or None if replicated)
        shapes = self._scan()
        check_shapes(shapes, self.config, folder)
        self.shapes = {name: shapes[name] for name in expected_shapes(self.config)}
        self._files = OpenFiles(lambda file: read_shard(file, mmap=True)["weights"])

    def _scan(self):
        """Full shapes and stored dtype from every shard's metadata (the files are mapped, not read)."""
        shapes = {}
        for p, paths in self._paths.items():
            shards = [read_shard(x, mmap=True) for x in paths]
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
                pieces = [shard["weights"][name] for shard in shards]
                for piece, path in zip(pieces[1:], paths[1:]):
                    if piece.shape != pieces[0].shape or piece.dtype != pieces[0].dtype:
                        raise RuntimeError(f"{path}: {name} is {piece.dtype} {tuple(piece.shape)} but "
                                           f"{pieces[0].dtype} {tuple(pieces[0].shape)} in {paths[0]}; the shards "
                                           "come from different checkpoints")
                dim = shards[0]["partition_dims"].get(name)
                if len(pieces) > 1 and dim is None:
                    dim = partition_dim(name)
                shape = list(pieces[0].shape)
                if dim is not None:
                    if not isinstance(dim, int) or not 0 <= dim < len(shape):
                        raise RuntimeError(f"{paths[0]}: {name} has partition dim {dim!r} but {len(shape)} "
                                           "dimensions; the file is not one this project saved")
                    shape[dim] *= len(pieces)
                shapes[name] = tuple(shape)
                self._where[name] = (p, dim)
                if name == "embedding.word_embeddings.weight":
                    self.dtype = pieces[0].dtype
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


def _as_reader(weights):
    return weights if hasattr(weights, "read") else DictReader(weights)


# ---------------------------------------------------------------- splitting


def stage_of_layers(num_layers, pp):
    """Stage index of each transformer block, as DeepSpeed's PipelineModule places them ("type:BloomBlockPipe")
    with the spec list [embedding, block x L, final norm, head]."""
    from deepspeed.runtime.utils import partition_balanced
    binary = [0] + [1] * num_layers + [0, 0]
    parts = partition_balanced(weights=binary, num_parts=pp)
    stage = {}
    for s in range(pp):
        for spec in range(parts[s], parts[s + 1]):
            stage[spec] = s
    return [stage[i + 1] for i in range(num_layers)], stage[num_layers + 1]


def stage_names(config, tp, pp, tp_flag="--target-tensor-parallel-size", pp_flag="--target-pipeline-parallel-size"):
    """[names of stage 0, names of stage 1, ...] for a TP x PP layout, each in canonical order (ValueError naming
    the flag when the layout does not fit the model). The embedding is in stage 0 only, as
    checkpointing.model_shard stores it."""
    if pp > config.num_layers:
        raise ValueError(f"{pp_flag} {pp} exceeds the {config.num_layers} layers; "
                         f"use at most {config.num_layers}")
    try:
        dataclasses.replace(config, tensor_model_parallel_size=tp)
    except ValueError as err:
        raise ValueError(f"{tp_flag} {tp} does not fit this model: {err}") from err
    layer_stage, final_stage = stage_of_layers(config.num_layers, pp)
    stages = [[] for _ in range(pp)]
    for name in expected_shapes(config):
        if name.startswith("embedding."):
            stages[0].append(name)
        elif name.startswith("layers."):
            stages[layer_stage[int(name.split(".")[1])]].append(name)
        else:
            stages[final_stage].append(name)
    return stages


def target_piece(shape, dim, tp_rank, tp):
    """(rows, cols) of TP rank tp_rank's slice of a tensor of `shape` split tp ways along dim (None: all)."""
    if dim is None or tp == 1:
        return None, None
    size = shape[dim] // tp
    bounds = (tp_rank * size, (tp_rank + 1) * size)
    return (bounds, None) if dim == 0 else (None, bounds)


def read_shard_for(reader, names, tp_rank, tp, dtype=None):
    """Our shard format {"weights", "partition_dims"} of TP rank tp_rank (of tp) for `names`, read from reader."""
    shard = {"weights": {}, "partition_dims": {}}
    for name in names:
        dim = partition_dim(name) if tp > 1 else None
        rows, cols = target_piece(reader.shapes[name], dim, tp_rank, tp)
        shard["weights"][name] = reader.read(name, rows, cols, dtype)
        shard["partition_dims"][name] = dim
    return shard


def split_weights(weights, config, tp, pp, tp_flag="--target-tensor-parallel-size",
                  pp_flag="--target-pipeline-parallel-size"):
    """{(tp_rank, pp_rank): {"weights", "partition_dims"}} in our shard format for a TP x PP layout."""
    stages = stage_names(config, tp, pp, tp_flag, pp_flag)
    reader = _as_reader(weights)
    return {(t, p): read_shard_for(reader, stages[p], t, tp) for t in range(tp) for p in range(pp)}


def cast_weights(weights, dtype):
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in weights.items()}


def resolve_dtype(name, stored):
    """--dtype auto keeps the stored dtype; fp32/bf16/fp16 convert."""
    return stored if name == "auto" else DTYPES[name]


# ---------------------------------------------------------------- atomic output folders


def check_output_path(out, force, inputs=()):
    """RuntimeError when --output-path exists (without --force) or would overwrite an input."""
    out_abs = os.path.realpath(out)
    for src in inputs:
        src_abs = os.path.realpath(src)
        if out_abs == src_abs or src_abs.startswith(out_abs + os.sep):
            raise RuntimeError(f"--output-path {out} holds the input {src}; replacing it would delete the input, "
                               "choose another folder")
    if os.path.lexists(out) and not force:
        raise RuntimeError(f"--output-path {out} already exists; pass --force to replace it or choose another "
                           "folder")


@contextlib.contextmanager
def atomic_folder(out, force):
    """Yields a temporary sibling folder; on success it replaces `out` (removed first with force). An OSError
    while writing (a full disk, no permission) becomes a RuntimeError naming --output-path."""
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
                raise RuntimeError(f"--output-path {out} appeared while writing; pass --force to replace it")
            if os.path.isdir(out) and not os.path.islink(out):
                shutil.rmtree(out)
            else:
                os.remove(out)
        os.replace(tmp, out)
    except OSError as err:
        raise RuntimeError(f"--output-path {out}: writing failed ({err}); check the free space and permissions "
                           "there or choose another folder") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def write_megatron_checkpoint(out, weights, config, tp, pp, *, iteration=0, consumed_samples=0, run_config=None,
                              tokenizer_dir=None, precision="fp32", source=None, force=False, dtype=None):
    """Writes our checkpoint layout for TP x PP with weights only ("deepspeed_state": false).

    weights: full tensors by canonical name, or a reader (CheckpointReader, HFReader); dtype: the output dtype of
    floating tensors (None keeps theirs). The (TP, PP) shards are built one at a time, each read piece by piece
    from the reader, so at most one output shard is in memory.

    If the basename of `out` is iter_XXXXXXX, `out` is the checkpoint folder itself; otherwise `out` is a save
    root holding iter_XXXXXXX/ and `latest` (what --load and --save use). Returns the checkpoint folder.
    """
    reader = _as_reader(weights)
    stages = stage_names(config, tp, pp)
    check_shapes(reader.shapes, config, "the weights to write")
    is_tag = checkpointing.TAG_RE.match(os.path.basename(os.path.normpath(out))) is not None
    tag = checkpointing.tag_for(iteration)
    model_section = dataclasses.asdict(dataclasses.replace(config, tensor_model_parallel_size=tp))
    run_config = json.loads(json.dumps(run_config or {}, default=str))
    run_config["model"] = {**run_config.get("model", {}), **model_section}
    parallel = run_config.setdefault("parallel", {})
    parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    meta = {"iteration": iteration, "consumed_samples": consumed_samples, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "data_parallel_size": None, "zero_stage": None,
            "precision": precision, "deepspeed_state": False, "converted_from": source}
    with atomic_folder(out, force) as tmp:
        folder = tmp if is_tag else os.path.join(tmp, tag)
        os.makedirs(folder, exist_ok=True)
        for p in range(pp):
            for t in range(tp):
                shard = read_shard_for(reader, stages[p], t, tp, dtype)
                torch.save(shard, os.path.join(folder, checkpointing.shard_name(t, p)))
                del shard
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(run_config, f, indent=2, default=str)
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if has_tokenizer(tokenizer_dir):
            copy_tokenizer(tokenizer_dir, os.path.join(folder, "tokenizer"))
        checkpointing.write_manifest(folder, iteration)
        if not is_tag:
            with open(os.path.join(tmp, "latest"), "w") as f:
                f.write(tag)
        apply_umask(tmp)  # the copied tokenizer files keep their source's mode otherwise
    final = os.path.abspath(out)
    return final if is_tag else os.path.join(final, tag)


# ---------------------------------------------------------------- Hugging Face folders


def parse_size(text, flag="--max-shard-size"):
    """'5GB' -> 5e9 bytes ('GiB' -> 2**30; KB, MB, GB, TB and their binary forms; a plain integer is bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{flag} {text!r} is not a size; write it like 5GB, 500MB or 1073741824")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}[unit]
    size = int(number * scale)
    if size < 1:
        raise ValueError(f"{flag} {text!r} must be positive")
    return size


def _special_token_ids(tokenizer_dir):
    """(bos, eos, pad) ids from a tokenizer folder; BLOOM's 1, 2, 3 when there is none."""
    if not has_tokenizer(tokenizer_dir):
        return 1, 2, 3
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.hf_files import read_special_tokens
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    bos_token = read_special_tokens(tokenizer_dir).get("bos_token")
    bos = tokenizer.vocab.get(bos_token, tokenizer.eod) if bos_token else tokenizer.eod
    return bos, tokenizer.eod, tokenizer.pad


def plan_hf_shards(config, dtype, max_shard_size):
    """[[(HF name, canonical name, shape), ...] per file]: tensors in order, a new file whenever the next tensor
    would take the current one past max_shard_size. lm_head.weight is left out: it is tied to the embedding."""
    from megatron.model.hf_bloom import to_hf_name

    groups, current, size = [], [], 0
    for name, shape in expected_shapes(config).items():
        nbytes = math.prod(shape) * dtype.itemsize
        if current and size + nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append((to_hf_name(name), name, shape))
        size += nbytes
    groups.append(current)
    return groups


def write_hf_folder(out, weights, config, dtype, tokenizer_dir=None, max_shard_size=5 * 10 ** 9, force=False):
    """A folder BloomForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load offline:
    config.json, model.safetensors (or model-0000i-of-0000n.safetensors + index), generation_config.json,
    and the tokenizer files. lm_head.weight is left out: it is tied to the word embeddings.

    weights: full tensors by canonical name, or a reader (CheckpointReader, HFReader). Each file is written
    tensor by tensor, in blocks of rows of at most tensor_streams.READ_BLOCK_BYTES read from the reader, so the model
    never is in memory as a whole."""
    from transformers import GenerationConfig

    from megatron.model.hf_bloom import to_hf_config

    reader = _as_reader(weights)
    check_shapes(reader.shapes, config, "the weights to write")
    bos, eos, pad = _special_token_ids(tokenizer_dir)
    hf_config = to_hf_config(config, dtype=dtype, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    groups = plan_hf_shards(config, dtype, max_shard_size)
    filenames = (["model.safetensors"] if len(groups) == 1 else
                 [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])

    with atomic_folder(out, force) as tmp:
        hf_config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad).save_pretrained(tmp)
        weight_map, total = {}, 0
        for filename, group in zip(filenames, groups):
            entries = [(hf_name, shape, dtype) for hf_name, _, shape in group]
            with SafetensorsWriter(os.path.join(tmp, filename), entries, metadata={"format": "pt"}) as writer:
                for hf_name, name, shape in group:
                    for rows in row_blocks(shape, max(dtype.itemsize, 4)):  # the source may be fp32
                        writer.write(reader.read(name, rows=rows, dtype=dtype))
                    weight_map[hf_name] = filename
            total += writer.total
        if len(groups) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        copy_tokenizer(tokenizer_dir, tmp)
        apply_umask(tmp)  # copies keep their source's mode (and safetensors' own save_file writes 0600)
    return os.path.abspath(out)


def is_hf_folder(path):
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config) or os.path.isfile(os.path.join(path, "meta.json")):
        return False
    try:
        with open(config) as f:
            return json.load(f).get("model_type") == "bloom"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


class _HFFile:
    """One weight file of a Hugging Face folder, opened for lazy reads: safetensors through safe_open, a
    pytorch_model.bin through torch.load(mmap=True) (read whole when it predates torch's zip format)."""

    def __init__(self, full):
        from safetensors import SafetensorError, safe_open

        self.full = full
        if not os.path.isfile(full):
            raise RuntimeError(f"{full} is missing (named by the index file); the folder is incomplete")
        try:
            if full.endswith(".safetensors"):
                self.handle = safe_open(full, framework="pt")
                self.tensors = None
            else:
                try:
                    self.tensors = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as err:
                    if "mmap" not in str(err):
                        raise
                    logger.warning("%s is not in torch's zip format: reading it whole", full)
                    self.tensors = torch.load(full, map_location="cpu", weights_only=True)
                if not isinstance(self.tensors, dict):
                    raise ValueError("not a dict of tensors")
        except (SafetensorError, RuntimeError, KeyError, EOFError, OSError, ValueError,
                pickle.UnpicklingError) as err:
            raise RuntimeError(f"{full} is not a readable weight file ({str(err)[:120]})") from err

    def keys(self):
        return list(self.handle.keys()) if self.tensors is None else list(self.tensors)

    def shape_dtype(self, key):
        if self.tensors is not None:
            return tuple(self.tensors[key].shape), self.tensors[key].dtype
        view = self.handle.get_slice(key)
        return tuple(view.get_shape()), SAFETENSORS_TORCH[view.get_dtype()]

    def window(self, key, ranges):
        """A view (torch) or a copy (safetensors) of key's window; ranges as in tensor_streams.narrow."""
        if self.tensors is not None:
            return narrow(self.tensors[key], ranges)
        index = tuple(slice(None) if r is None else slice(r[0], r[1]) for r in ranges)
        return self.handle.get_slice(key)[index] if index else self.handle.get_tensor(key)


class HFReader:
    """A local Hugging Face BLOOM folder (save_pretrained: safetensors or pytorch_model.bin, single or sharded
    with an index), read lazily under our canonical names. Opening it reads the config and every file's
    header, checks the names and shapes, and that lm_head.weight (when stored) equals the word embeddings."""

    def __init__(self, path, flag="--hf-model-path"):
        from transformers import BloomConfig

        from megatron.model.hf_bloom import HF_TIED_HEAD, from_hf_config, from_hf_name

        if not os.path.isdir(path):
            raise RuntimeError(f"{flag} {path}: no such folder; pass a local folder written by save_pretrained")
        if not is_hf_folder(path):
            raise RuntimeError(f"{flag} {path}: {os.path.join(path, 'config.json')} is missing or is not a BLOOM "
                               "config (model_type 'bloom')")
        self.folder = path
        self._files = OpenFiles(_HFFile)
        self._where, shapes, dtypes, tied = {}, {}, {}, None
        try:
            config = from_hf_config(BloomConfig.from_pretrained(path))
            self.config = model_config_from_dict(dataclasses.asdict(config), path)
            for file in self._weight_files(flag):
                full = os.path.join(path, file)
                handle = self._files.get(full)
                for key in handle.keys():
                    name = key if key.startswith(("transformer.", HF_TIED_HEAD)) else "transformer." + key
                    if name == HF_TIED_HEAD:
                        tied = (full, key)
                        continue
                    canonical = from_hf_name(name)
                    self._where[canonical] = (full, key)
                    shapes[canonical], dtypes[canonical] = handle.shape_dtype(key)
        except (KeyError, ValueError) as err:
            raise RuntimeError(f"{flag} {path}: {err}") from err
        check_shapes(shapes, self.config, path)
        self.shapes = {name: shapes[name] for name in expected_shapes(self.config)}
        self.dtype = dtypes["embedding.word_embeddings.weight"]
        self.tokenizer_dir = path if has_tokenizer(path) else None
        self.run_config = {"model": dataclasses.asdict(self.config)}
        self.iteration, self.consumed_samples = 0, 0
        if tied is not None and not self._equals_embedding(*tied):
            raise RuntimeError(f"{flag} {path}: lm_head.weight differs from the word embeddings; BLOOM ties them "
                               "(tie_word_embeddings) and this converter supports only tied heads")

    def _weight_files(self, flag):
        for single, index in (("model.safetensors", "model.safetensors.index.json"),
                              ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if os.path.isfile(os.path.join(self.folder, single)):
                return [single]
            if os.path.isfile(os.path.join(self.folder, index)):
                weight_map = _read_json(os.path.join(self.folder, index), "the folder is incomplete").get(
                    "weight_map", {})
                return sorted(set(weight_map.values()))
        raise RuntimeError(f"{flag} {self.folder}: no model.safetensors, model.safetensors.index.json or "
                           "pytorch_model.bin; save the model there with save_pretrained")

    def _equals_embedding(self, full, key):
        shape, _ = self._files.get(full).shape_dtype(key)
        embedding = self.shapes["embedding.word_embeddings.weight"]
        if shape != embedding:
            return False
        for rows in row_blocks(shape, 4):
            head = self._read(full, key, [rows, None])
            if not torch.equal(head, self.read("embedding.word_embeddings.weight", rows=rows)):
                return False
        return True

    def _read(self, full, key, ranges, dtype=None):
        handle = self._files.get(full)
        view = handle.window(key, ranges)
        self._files.charge(span_bytes(view))
        if handle.tensors is not None:  # a view of the mapped file
            return owned([view], None, dtype)
        view = view.to(dtype) if dtype is not None and view.is_floating_point() else view
        return view.contiguous()  # safetensors returned a copy already

    def read(self, name, rows=None, cols=None, dtype=None):
        """As CheckpointReader.read: a new contiguous tensor, the window's bytes alone read from the file."""
        full, key = self._where[name]
        return self._read(full, key, window_ranges(self.shapes[name], rows, cols), dtype)

    def close(self):
        self._files.close()


def read_hf_folder(path, flag="--hf-model-path"):
    """A local Hugging Face BLOOM folder -> MergedCheckpoint (canonical names, iteration 0), all in memory."""
    reader = HFReader(path, flag)
    weights = {name: reader.read(name) for name in reader.shapes}
    reader.close()
    return MergedCheckpoint(config=reader.config, weights=weights, dtype=reader.dtype, folder=path,
                            tokenizer_dir=reader.tokenizer_dir, run_config=reader.run_config)


def load_any(path, num_partitions=None, flag="--load"):
    """Our checkpoint (folder or save root) or a Hugging Face BLOOM folder, merged into one process."""
    if os.path.isdir(path) and is_hf_folder(path):
        return read_hf_folder(path, flag)
    return load_merged_checkpoint(path, num_partitions, flag)


def build_model(merged, dtype=None, tp=1, tp_rank=0, device="cpu", attention_impl="torch"):
    """A BloomModel (parallel_output=False, eval mode) holding merged's weights; with tp > 1 this rank's slice
    (megatron.core.parallel_state must already be initialised for TP tp)."""
    from megatron.model.bloom import BloomModel

    config = dataclasses.replace(merged.config, tensor_model_parallel_size=tp, attention_impl=attention_impl,
                                 hidden_dropout=0.0, attention_dropout=0.0)
    weights = merged.weights
    if tp > 1:
        weights = split_weights(weights, merged.config, tp, 1, tp_flag="torchrun --nproc_per_node")[
            (tp_rank, 0)]["weights"]
    dtype = dtype or merged.dtype
    model = BloomModel(config, parallel_output=False)
    model.load_state_dict(cast_weights(weights, dtype), strict=True)
    return model.to(device=device, dtype=dtype).eval()
