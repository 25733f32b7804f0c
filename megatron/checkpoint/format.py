"""Checkpoint format: file names, `latest`, the manifest, the saved meta/config, and the model's partition layout.

Pure: files and JSON only (no torch.distributed, no DeepSpeed, no tensors). The rest of megatron.checkpoint
builds on it.

Layout of <save>/iter_0000100/ (written under <save>/.tmp_iter_0000100/ and renamed when complete):

    model_tp00_pp000.pt     weights of (TP rank, PP stage) under BloomModel's names, with each tensor's
                            partition dim; what tools/merge_mp_partitions.py, --finetune and resuming read
    model_tp00_pp000_dp00000.pt
                            under ZeRO-3, in place of model_tp00_pp000.pt: each DP rank's parts of the
                            weights, saved and loaded without gathering them (megatron/checkpoint/zero3.py)
    optimizer_tp00_pp000_dp00000.pt
                            the engine state of (TP rank, PP stage, DP rank): per parameter (BloomModel's
                            names), the region of it this rank holds (a ZeRO partition per DP rank, one file
                            for the DP group when the state is replicated): Adam's moments and, under bf16/fp16,
                            the fp32 master weights; the loss scaler, the LR schedule's position and the
                            engine's step counters. No model weights (megatron/checkpoint/optimizer_state.py).
    index_tp00_pp000_dp00000.json
                            beside each optimizer file: the parameters and regions it holds, with the partition
                            dim each tensor-parallel layer sets (megatron/checkpoint/saved_optimizer.py); no
                            tensors
    rng_rank00000.pt        per-rank CPU/CUDA/model-parallel RNG states
    tokenizer/              the tokenizer, saved with save_pretrained
    config.json             the resolved run config
    meta.json               iteration, consumed samples, topology, precision
    manifest.json           written last: every file's size and CRC32

<save>/latest holds the tag of the newest complete checkpoint (DeepSpeed's format) and is replaced atomically.
A folder named iter_* is complete unless the disk itself lost data, which the manifest's sizes and CRC32s then
catch on --load; .tmp_* folders (saves that did not finish) are never loaded.

Per parameter a checkpoint takes 4 + 8 bytes (fp32 weights + Adam's two moments) or 2 + 4 + 8 (bf16/fp16
weights + fp32 master weights + Adam), plus ZeRO's alignment padding and the files' headers (checkpoint_bytes).
"""
import dataclasses
import json
import logging
import os
import re
import zlib

from megatron.config import ModelConfig
from megatron.model.spec import expected_shapes, partition_dim  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)
TAG_RE = re.compile(r"^iter_(\d{7,})$")
TMP_PREFIX = ".tmp_"  # a save or conversion in progress (or one that crashed): never loaded
TRASH_PREFIX = ".trash_"  # renamed aside to be deleted (pruned, replaced)
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder, the cause and the fix."""


# ---------------------------------------------------------------- names


def tag_for(iteration):
    return f"iter_{iteration:07d}"


def iteration_of(tag):
    return int(TAG_RE.match(tag).group(1))


def shard_name(tp_rank, pp_rank):
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def partitioned_shard_name(tp_rank, pp_rank, dp_rank):
    """ZeRO-3: DP rank dp_rank's parts of the weights of (TP rank, stage) (megatron/checkpoint/zero3.py)."""
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:05d}.pt"


def optimizer_name(tp_rank, pp_rank, dp_rank):
    return f"optimizer_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:05d}.pt"


def index_name(tp_rank, pp_rank, dp_rank):
    return f"index_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:05d}.json"


def rng_name(rank):
    return f"rng_rank{rank:05d}.pt"


# ---------------------------------------------------------------- the manifest, `latest`, choosing a folder


def file_crc32(path, chunk=1 << 24):
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return value
            value = zlib.crc32(block, value)


def read_manifest(folder):
    """(files, None) with files {relative path: {"size", "crc32"}} from folder's manifest, or (None, reason)."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        return None, f"{folder} does not exist"
    if not os.path.isfile(manifest_path):
        return None, f"{manifest_path} is missing (the save did not finish)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            return None, f"{manifest_path} lists no files"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        return None, f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    for rel, info in files.items():
        if not isinstance(info, dict) or "size" not in info or "crc32" not in info:
            return None, f"{manifest_path} has a malformed entry for {rel}"
    return files, None


def verify_file(folder, rel, info):
    """None if folder/rel has the manifest entry's size and CRC32, else the reason (one line)."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f"{path} is missing"
    if os.path.getsize(path) != info["size"]:
        return f"{path} has {os.path.getsize(path)} bytes, the manifest says {info['size']} (truncated?)"
    if file_crc32(path) != info["crc32"]:
        return f"{path} does not match its checksum (corrupt)"
    return None


def verify_checkpoint(folder):
    """None if the folder is a complete checkpoint, else the reason (a one-line string naming the file). One
    process reads every byte; a training run splits the work over its ranks (megatron/checkpoint/verify.py)."""
    files, reason = read_manifest(folder)
    if reason:
        return reason
    for rel, info in files.items():
        reason = verify_file(folder, rel, info)
        if reason:
            return reason
    return None


def list_checkpoints(root):
    """Tags under root, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted((name for name in os.listdir(root) if TAG_RE.match(name)), key=iteration_of, reverse=True)


def read_latest(root):
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def is_tag_folder(path):
    """True when path's basename is iter_XXXXXXX (a checkpoint folder rather than a save root)."""
    return TAG_RE.match(os.path.basename(os.path.normpath(path))) is not None


def candidate_folders(root):
    """The folders --load would try, in order: `latest`'s, then the others newest first. When `latest`'s folder
    is missing but its trash name holds it (a crash between the two renames of a replacement on a file system
    without an atomic swap, io.replace_folder), that one stands in."""
    latest = read_latest(root)
    out = []
    for tag in ([latest] if latest else []) + [t for t in list_checkpoints(root) if t != latest]:
        folder = os.path.join(root, tag)
        aside = os.path.join(root, TRASH_PREFIX + tag)
        out.append((tag, aside if tag == latest and not os.path.isdir(folder) and os.path.isdir(aside) else folder))
    return out


def find_checkpoint(root, strict=False, verify=verify_checkpoint):
    """The folder to resume from: `latest` if it verifies, else the newest complete one (logged).

    With strict=True any problem with `latest` raises CheckpointError instead of falling back. Folders
    named .tmp_* (saves that did not finish) are never candidates. verify(folder) -> None or the reason.
    A training run checks the same candidates with its ranks sharing the reads (verify.choose_checkpoint).
    """
    if is_tag_folder(root) and os.path.isdir(root):
        reason = verify(root)
        if reason:
            raise CheckpointError(f"--load {root}: checkpoint is incomplete or corrupt: {reason}")
        return root
    for tag, folder in candidate_folders(root):
        reason = verify(folder)
        if reason is None:
            return folder
        if strict:
            raise CheckpointError(f"--load {root}: checkpoint {tag} is incomplete or corrupt: {reason} "
                                  "(--strict-load is set; drop it to fall back to an older checkpoint)")
        logger.warning("skipping checkpoint %s: %s", tag, reason)
    return None


# ---------------------------------------------------------------- what the run recorded


def read_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def read_saved_config(folder):
    """config.json of a checkpoint folder as saved, or None when it is missing or unreadable."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def saved_model_config(root):
    """The "model" section of the config saved with the checkpoint --load would pick first (None if none)."""
    folder = root if is_tag_folder(root) else None
    if folder is None:
        latest = read_latest(root) if os.path.isdir(root) else None
        tags = ([latest] if latest else []) + list_checkpoints(root)
        folder = next((os.path.join(root, t) for t in tags if os.path.isfile(os.path.join(root, t, "config.json"))),
                      None)
    saved = read_saved_config(folder) if folder else None
    return saved.get("model") if isinstance(saved, dict) else None


def layout_text(tp, pp, dp, zero, precision):
    return f"TP {tp}, PP {pp}, DP {dp}, ZeRO {zero}, {precision}"


# meta.json's "optimizer_format" of a checkpoint written by tools/convert_checkpoint.py (checkpoint/universal.py)
OPTIMIZER_FORMAT_PARAMETERS = "parameters"


def converted(meta):
    """True for a checkpoint written by tools/convert_checkpoint.py: its optimizer files hold state per parameter,
    for any DP size and ZeRO stage, so it always resumes through the index files, never into a DeepSpeed
    wrapper's state_dict."""
    return meta.get("optimizer_format") == OPTIMIZER_FORMAT_PARAMETERS


def has_parameter_index(folder, meta):
    """Whether a checkpoint folder holds its optimizer state with the per-parameter index files
    (saved_optimizer.py), what resuming on another layout and tools/convert_checkpoint.py read."""
    return bool(meta.get("deepspeed_state") and meta.get("engine_state_version") and
                os.path.isfile(os.path.join(folder, index_name(0, 0, 0))))


def saved_layout_text(meta):
    """The layout a checkpoint was written on, from its meta.json ("DP any, ZeRO any" for a converted one)."""
    if converted(meta):
        return layout_text(meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"], "any", "any",
                           meta.get("precision")) + " (tools/convert_checkpoint.py)"
    return layout_text(meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
                       meta.get("data_parallel_size"), meta.get("zero_stage"), meta.get("precision"))


def checkpoint_bytes(num_parameters, precision, no_save_optim=False):
    """Estimated size of one checkpoint: the weights once (model_tp*_pp*.pt) plus Adam's state (two fp32
    moments, and fp32 master weights under bf16/fp16): 12 bytes per parameter in fp32, 14 in bf16/fp16."""
    weight = 4 if precision == "fp32" else 2
    optimizer = 0 if no_save_optim else (8 if precision == "fp32" else 12)
    return num_parameters * (weight + optimizer)


# ---------------------------------------------------------------- the model's names, shapes and partition dims
# expected_shapes(config) and partition_dim(name) come from the parameter spec (megatron/model/spec.py).


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
