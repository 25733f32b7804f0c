"""Outputs get the mode the umask gives (megatron/file_modes.py): a merged HF folder and preprocessed data."""
import json
import os
import stat
import sys

import pytest
import torch

from megatron.checkpoint import hf
from megatron.config import ModelConfig
from megatron.file_modes import apply_umask, current_umask, default_file_mode
from megatron.model.bloom import BloomModel

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_data  # noqa: E402


@pytest.fixture
def umask_027():
    """umask 027 (group read, others nothing): 0640 files, not the 0644 a hard-coded mode would give."""
    old = os.umask(0o027)
    yield
    os.umask(old)


def _modes(folder):
    return {name: stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) for name in sorted(os.listdir(folder))}


def test_default_mode_follows_the_umask_without_changing_it(umask_027):
    assert (current_umask(), default_file_mode()) == (0o027, 0o640)
    assert current_umask() == 0o027
    os.umask(0o022)
    assert (current_umask(), default_file_mode()) == (0o022, 0o644)


def test_apply_umask_widens_or_narrows_files_and_leaves_links(tmp_path, umask_027):
    (tmp_path / "sub").mkdir()
    for path, mode in ((tmp_path / "private", 0o600), (tmp_path / "sub" / "open", 0o666)):
        path.write_text("x")
        os.chmod(path, mode)
    (tmp_path / "link").symlink_to(tmp_path / "sub" / "open")
    assert apply_umask(str(tmp_path)) == str(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "sub" / "open").st_mode) == 0o640
    assert os.path.islink(tmp_path / "link")
    os.chmod(tmp_path / "private", 0o600)
    apply_umask(str(tmp_path / "private"))  # one file
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o640


def test_merged_hf_folder_has_umask_modes(tmp_path, umask_027):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=8064, seq_length=16)
    weights = {name: tensor.clone() for name, tensor in BloomModel(config).state_dict().items()}
    for shard_size in (None, 200_000):  # one model.safetensors; several shards with an index
        out = tmp_path / f"hf_{shard_size}"
        kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
        hf.write_hf_folder(str(out), weights, config, torch.float32, tokenizer_dir=TOKENIZER, **kwargs)
        modes = _modes(out)
        assert ("model.safetensors" in modes) == (shard_size is None)
        assert ("model.safetensors.index.json" in modes) == (shard_size is not None)
        assert {"config.json", "tokenizer.json", "vocab.json"} <= set(modes)
        assert modes == {name: 0o640 for name in modes}
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o750


def test_preprocess_outputs_have_umask_modes(tmp_path, umask_027):
    data = tmp_path / "c4.jsonl"
    data.write_text(json.dumps({"text": "Alice was beginning to get very tired."}) + "\n")
    assert preprocess_data.main(["--input", str(data), "--output-prefix", str(tmp_path / "c4"), "--vocab-file",
                                 os.path.join(TOKENIZER, "vocab.json"), "--merge-file",
                                 os.path.join(TOKENIZER, "merges.txt"), "--append-eod"]) == 0
    modes = _modes(tmp_path)
    assert modes == {"c4.jsonl": 0o640, "c4_text_document.bin": 0o640, "c4_text_document.idx": 0o640}
