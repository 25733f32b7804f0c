"""Checks pretrain_bloom.py runs before it starts any process group: inputs that would otherwise fail late or
silently (an IndexError deep in the embedding, NaN losses at TP 2, pages of load_state_dict size mismatches, a
DeepSpeed traceback) stop the run with one line naming the flag, the value and the fix.

    check_before_start(config, tokenizer)   all of them; ValueError on the first one broken

- The data's largest token id against the tokenizer's vocabulary and the model's padded vocabulary
  (largest_token_id: numpy's max over the .bin's memory map, or evenly spaced samples of it past
  FULL_SCAN_BYTES, which the message then says). Every process of a launch runs this before any process group
  exists, so the scan is done once per node and file version: the processes of a node take turns on a lock in the
  node's temporary folder, the first scans and records the result there, the others read it
  (cached_largest_token_id).
- The model-shape flags against the model section of the --load checkpoint's config.json.
- --fp16 on a CPU whose DeepSpeed accelerator does not support it.
"""
import fcntl
import hashlib
import json
import logging
import os
import tempfile

import numpy as np

logger = logging.getLogger("megatron")

FULL_SCAN_BYTES = 1 << 30  # a .bin up to this size is scanned whole (about a second from the page cache)
SAMPLE_BLOCKS = 256  # past it: this many evenly spaced blocks...
SAMPLE_BLOCK_BYTES = 4 << 20  # ...of this size are scanned (1 GiB in all)

# Model fields that decide the weights' shapes (or how they are read), with the flag that sets each.
SHAPE_FLAGS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
               ("num_attention_heads", "--num-attention-heads"), ("ffn_hidden_size", "--ffn-hidden-size"),
               ("embed_layernorm", "--embed-layernorm/--no-embed-layernorm"),
               ("vocab_size", "padded vocabulary"))


def largest_token_id(prefix, full_scan_bytes=FULL_SCAN_BYTES, blocks=SAMPLE_BLOCKS, block_bytes=SAMPLE_BLOCK_BYTES):
    """(largest token id in prefix.bin, whether the whole file was scanned). Opens the pair with
    MMapIndexedDataset (its checks name a truncated or corrupt file)."""
    from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path

    dtype = MMapIndexedDataset(prefix).dtype
    if os.path.getsize(data_file_path(prefix)) < dtype.itemsize:  # numpy cannot map an empty file
        return -1, True
    tokens = np.memmap(data_file_path(prefix), dtype=dtype, mode="r")
    if tokens.nbytes <= full_scan_bytes:
        return int(tokens.max()), True
    per_block = max(1, block_bytes // dtype.itemsize)
    starts = np.linspace(0, tokens.size - per_block, blocks).astype(np.int64)
    return int(max(tokens[s:s + per_block].max() for s in starts)), False


def cached_largest_token_id(prefix, cache_dir=None, scan=largest_token_id):
    """largest_token_id(prefix), scanned once per node and version of the .bin: the result is kept in cache_dir
    (default: the node's temporary folder, so no shared file system is assumed) under a name from the .bin's real
    path, keyed by its size and modification time; a lock there makes the other processes of the node wait for the
    first one's scan instead of repeating it."""
    from megatron.data.indexed_dataset import data_file_path

    path = os.path.realpath(data_file_path(prefix))
    try:
        info = os.stat(path)
    except OSError:
        return scan(prefix)  # a missing file: the scan's opening names it
    key = {"path": path, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), f"megatron-token-scan-{os.getuid()}")
    os.makedirs(cache_dir, exist_ok=True)
    name = os.path.join(cache_dir, hashlib.sha1(path.encode()).hexdigest())
    with open(name + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(name + ".json") as f:
                cached = json.load(f)
            if cached["key"] == key:
                return cached["largest"], cached["whole"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or of another version of the file: scan
        largest, whole = scan(prefix)
        with open(name + ".json.tmp", "w") as f:
            json.dump({"key": key, "largest": largest, "whole": whole}, f)
        os.replace(name + ".json.tmp", name + ".json")
        return largest, whole


def check_data_vocabulary(prefixes, tokenizer_vocab_size, padded_vocab_size, tokenizer_flag,
                          largest=cached_largest_token_id):
    """ValueError when a --data-path dataset holds a token id the tokenizer (or the model) cannot have."""
    from megatron.data.indexed_dataset import IndexedDatasetError

    for prefix in prefixes:
        try:
            largest_id, whole = largest(prefix)
        except IndexedDatasetError:
            continue  # a truncated or corrupt pair: the dataset build names it (exit 1) as before
        if largest_id >= tokenizer_vocab_size:
            seen = "" if whole else " (sampled: the .bin is larger than 1 GiB)"
            raise ValueError(
                f"--data-path {prefix}: token id {largest_id}{seen} does not fit the tokenizer's {tokenizer_vocab_size} "
                f"tokens ({tokenizer_flag}) nor the model's padded vocabulary of {padded_vocab_size}; the data was "
                "made with another tokenizer: pass that one, or re-run tools/preprocess_data.py with this one")
        logger.info("%s: largest token id %d%s < tokenizer vocabulary %d <= padded %d", prefix, largest_id,
                    "" if whole else " (sampled)", tokenizer_vocab_size, padded_vocab_size)


def model_shape_differences(model, saved):
    """['--num-layers 3 (checkpoint: 2)', ...] for the shape fields where ModelConfig `model` differs from
    the checkpoint's saved model section `saved` (a dict)."""
    differences = []
    for field, flag in SHAPE_FLAGS:
        if field not in saved:
            continue
        ours, theirs = getattr(model, field), saved[field]
        if field == "ffn_hidden_size":  # 4 x hidden unless set: compared only when one side sets it
            if ours is None and theirs is None:
                continue
            ours, theirs = model.ffn_dim, theirs or 4 * saved.get("hidden_size", model.hidden_size)
        if ours == theirs:
            continue
        if field == "embed_layernorm":
            differences.append(f"{'--embed-layernorm' if ours else '--no-embed-layernorm'} (checkpoint: "
                               f"{'with' if theirs else 'without'} it)")
        elif field == "vocab_size":
            differences.append(f"padded vocabulary {ours} (checkpoint: {theirs}; pass the tokenizer it was trained "
                               f"with, or --pad-vocab-size-to {theirs})")
        else:
            differences.append(f"{flag} {ours} (checkpoint: {theirs})")
    return differences


def check_model_against_checkpoint(model, load, finetune=False):
    """ValueError when the model flags describe weights of another shape than the --load checkpoint's."""
    from megatron.checkpoint.format import saved_model_config

    if not load or not os.path.isdir(load):
        return
    saved = saved_model_config(load)
    if not isinstance(saved, dict):
        return  # no config.json of ours (an empty folder, another format): the load says what it is
    differences = model_shape_differences(model, saved)
    if differences:
        raise ValueError(f"--load {load}{' (--finetune)' if finetune else ''}: the model flags do not match the "
                         f"checkpoint's config.json: {', '.join(differences)}; pass the checkpoint's values or load "
                         "another checkpoint")


def check_fp16_supported(precision, cuda_available):
    """ValueError for --fp16 (or --bf16) on a CPU whose DeepSpeed accelerator refuses it, which DeepSpeed's engine
    would report as a traceback ("Type fp16 is not supported on your device.") after building the model."""
    if not (precision.fp16 or precision.bf16) or cuda_available:
        return
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    if precision.fp16 and not accelerator.is_fp16_supported():
        raise ValueError("--fp16: DeepSpeed does not support fp16 on this CPU (it needs AVX512-FP16 or AMX-FP16); "
                         "use --bf16, or drop --fp16 to train in fp32, or run on a GPU")
    if precision.bf16 and not accelerator.is_bf16_supported():
        raise ValueError("--bf16: DeepSpeed does not support bf16 on this CPU; drop --bf16 to train in fp32, or run "
                         "on a GPU")


def check_before_start(config, tokenizer):
    """Every check above for a resolved Config and its tokenizer (None with --mock-data)."""
    import torch

    check_fp16_supported(config.precision, torch.cuda.is_available())
    check_model_against_checkpoint(config.model, config.checkpoint.load, config.checkpoint.finetune)
    if tokenizer is not None and not config.data.mock_data:
        flag = ("--tokenizer-name-or-path " + config.data.tokenizer_name_or_path
                if config.data.tokenizer_name_or_path else f"--vocab-file {config.data.vocab_file}")
        check_data_vocabulary(config.data.prefixes, tokenizer.vocab_size, config.model.vocab_size, flag)
