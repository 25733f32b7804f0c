"""Hugging Face BLOOM folders: export a checkpoint (write_hf_folder), read one lazily (HFReader), or load any model.

write_hf_folder writes each safetensors shard tensor by tensor, in blocks of at most streams.READ_BLOCK_BYTES
(128 MiB) read from a reader (convert.CheckpointReader, HFReader, or tensors in memory), so a 176B model exports
on a host with less RAM than the model; HFReader maps a folder's files (safetensors' safe_open,
torch.load(mmap=True)) and reads only the window of a tensor that is asked for, under our canonical names, so
tools/convert_hf_to_megatron.py imports one output shard at a time (convert.write_megatron_checkpoint).
"""
import dataclasses
import json
import logging
import math
import os
import pickle
import re

import torch

from megatron.checkpoint.convert import (DTYPE_NAMES, MergedCheckpoint, as_reader, copy_tokenizer, has_tokenizer,
                                         load_merged_checkpoint, read_json)
from megatron.checkpoint.format import check_shapes, expected_shapes, model_config_from_dict
from megatron.checkpoint.io import atomic_folder
from megatron.checkpoint.model_card import set_model_max_length, write_model_card
from megatron.checkpoint.streams import SAFETENSORS_TORCH, OpenFiles, SafetensorsWriter, narrow, owned, row_blocks, \
    span_bytes, window_ranges
from megatron.file_modes import apply_umask

logger = logging.getLogger(__name__)


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


def write_hf_folder(out, weights, config, dtype, tokenizer_dir=None, max_shard_size=5 * 10 ** 9, force=False,
                    source=None):
    """A folder BloomForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load offline:
    config.json, model.safetensors (or model-0000i-of-0000n.safetensors + index), generation_config.json,
    the tokenizer files (model_max_length = the trained sequence length) and a model card README.md written
    from `source` (the CheckpointReader: its config.json, meta and metrics; model_card.py). lm_head.weight is
    left out: it is tied to the word embeddings.

    weights: full tensors by canonical name, or a reader (CheckpointReader, HFReader). Each file is written
    tensor by tensor, in blocks of rows of at most streams.READ_BLOCK_BYTES read from the reader, so the model
    never is in memory as a whole."""
    from transformers import GenerationConfig

    from megatron.model.hf_bloom import to_hf_config

    reader = as_reader(weights)
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
        set_model_max_length(tmp, config.seq_length)
        write_model_card(tmp, config, DTYPE_NAMES[dtype], source)
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
        """A view (torch) or a copy (safetensors) of key's window; ranges as in streams.narrow."""
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
                weight_map = read_json(os.path.join(self.folder, index), "the folder is incomplete").get(
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
