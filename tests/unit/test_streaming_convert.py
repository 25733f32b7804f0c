"""Conversions stream (megatron/checkpoint/convert.py, hf.py, streams.py): merge to HF, reshard and HF
import hold one block or one output shard, never the model, and drop the file mappings they read through.

Every read a conversion makes goes through a reader's read(); the `tracked` fixture wraps it to follow the bytes
of the tensors it returned that are still alive (weakref finalizers) and the process's file-backed resident pages
(RssFile: pages of the mapped shards) after each read. The tools run in this process through their main().
"""
import importlib.util
import json
import math
import os
import weakref

import pytest
import torch

from megatron.checkpoint import convert, hf, streams
from megatron.checkpoint.format import expected_shapes, partition_dim
from megatron.config import ModelConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_file():
    """Resident file-backed pages of this process, in bytes (/proc/self/status RssFile)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


class Tracker:
    def __init__(self):
        self.live = self.peak_live = self.reads = 0
        self.rss_file_start = self.peak_rss_file = rss_file()

    def returned(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.peak_live = max(self.peak_live, self.live)
        self.reads += 1
        weakref.finalize(tensor, self._freed, nbytes)
        self.peak_rss_file = max(self.peak_rss_file, rss_file())
        return tensor

    def _freed(self, nbytes):
        self.live -= nbytes

    @property
    def mapped_growth(self):
        return self.peak_rss_file - self.rss_file_start


@pytest.fixture
def tracked(monkeypatch):
    """Returns start(): a fresh Tracker that every reader's read() reports to from then on."""
    current = []

    def wrap(read):
        def tracked_read(self, *args, **kwargs):
            return current[-1].returned(read(self, *args, **kwargs))
        return tracked_read

    for cls in (convert.CheckpointReader, hf.HFReader):
        monkeypatch.setattr(cls, "read", wrap(cls.read))

    def start():
        current.append(Tracker())
        return current[-1]
    return start


def config_for(num_layers, hidden=64, vocab=512):
    return ModelConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=4, vocab_size=vocab,
                       seq_length=16)


def random_weights(config, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator)
            for name, shape in expected_shapes(config).items()}


def make_checkpoint(path, config, tp, pp, weights=None):
    weights = weights if weights is not None else random_weights(config)
    return convert.write_megatron_checkpoint(str(path), weights, config, tp, pp, iteration=3), weights


def nbytes(shape, dtype=torch.float32):
    return math.prod(shape) * dtype.itemsize


def largest_shard_bytes(config, tp, pp):
    """Bytes of the largest (TP, PP) shard of our layout, from the shapes alone."""
    shapes = expected_shapes(config)
    largest = 0
    for names in convert.stage_names(config, tp, pp):
        size = sum(nbytes(shapes[n]) // (tp if partition_dim(n) is not None and tp > 1 else 1)
                   for n in names)
        largest = max(largest, size)
    return largest


def read_hf_output(folder):
    from safetensors.torch import load_file

    files = ["model.safetensors"]
    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(folder, file)))
    return tensors


def test_hf_export_holds_one_block_whatever_the_depth(tmp_path, tracked, monkeypatch):
    """TP 2 x PP 2 -> HF in blocks of 3000 bytes: the embedding's blocks straddle the TP boundary (rows 256 bytes,
    256 rows per rank), the column-split dense weights merge both ranks per block. The most alive at once is one
    block, the same for 2 and 6 layers, and the output equals the weights exactly."""
    from megatron.model.hf_bloom import to_hf_name

    monkeypatch.setattr(streams, "READ_BLOCK_BYTES", 3000)
    merge = load_tool("merge_mp_partitions")
    peaks = {}
    for layers in (2, 6):
        config = config_for(layers)
        source, weights = make_checkpoint(tmp_path / f"src{layers}", config, 2, 2)
        tracker = tracked()
        out = tmp_path / f"hf{layers}"
        assert merge.main(["--model-path", source, "--output-path", str(out), "--max-shard-size", "200KB"]) == 0
        peaks[layers] = tracker.peak_live
        back = read_hf_output(out)
        assert sorted(back) == sorted(to_hf_name(n) for n in weights)
        for name, tensor in weights.items():
            assert torch.equal(back[to_hf_name(name)], tensor), name
        total = sum(nbytes(t.shape) for t in weights.values())
        assert tracker.reads > len(weights)  # the large tensors came in several blocks
        assert tracker.live == 0, "a tensor the conversion read is still alive"
        assert total > 30 * 3000
    # 11 rows of 256 bytes (embedding, QKV, h_to_4h, dense) is the largest block under 3000 bytes
    assert peaks == {2: 11 * 256, 6: 11 * 256}


@pytest.mark.parametrize("source_layout, target_layout", [((2, 2), (1, 2)), ((1, 1), (4, 2))])
def test_reshard_holds_one_output_shard(tmp_path, tracked, source_layout, target_layout):
    """The most alive at once is the largest output shard (not the model), and the shards merge back exactly."""
    config = config_for(4)
    source, weights = make_checkpoint(tmp_path / "src", config, *source_layout)
    tracker = tracked()
    tp, pp = target_layout
    assert load_tool("merge_mp_partitions").main([
        "--model-path", source, "--output-format", "megatron", "--target-tensor-parallel-size", str(tp),
        "--target-pipeline-parallel-size", str(pp), "--output-path", str(tmp_path / "out")]) == 0
    assert tracker.peak_live == largest_shard_bytes(config, tp, pp)
    assert tracker.peak_live < 0.6 * sum(nbytes(t.shape) for t in weights.values())
    assert tracker.live == 0
    merged = convert.load_merged_checkpoint(str(tmp_path / "out"), num_partitions=tp)
    assert merged.iteration == 3 and merged.pipeline_model_parallel_size == pp
    assert all(torch.equal(merged.weights[n], weights[n]) for n in weights)


def test_hf_import_holds_one_output_shard(tmp_path, tracked):
    """A sharded HF folder (save_pretrained, several safetensors files) -> TP 2 x PP 2, to bf16."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=64, n_layer=4, n_head=4))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="150KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    tracker = tracked()
    assert load_tool("convert_hf_to_megatron").main([
        "--hf-model-path", str(tmp_path / "hf"), "--output-path", str(tmp_path / "ours"), "--dtype", "bf16",
        "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]) == 0
    config = config_for(4)
    assert tracker.peak_live == largest_shard_bytes(config, 2, 2) // 2  # bf16
    assert tracker.live == 0
    merged = convert.load_merged_checkpoint(str(tmp_path / "ours"))
    state = hf.state_dict()
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged.weights["layers.3.mlp.dense_4h_to_h.weight"],
                       state["transformer.h.3.mlp.dense_4h_to_h.weight"].to(torch.bfloat16))
    assert torch.equal(merged.weights["embedding.word_embeddings.weight"],
                       state["transformer.word_embeddings.weight"].to(torch.bfloat16))


def test_mapped_pages_are_dropped_as_the_conversion_goes(tmp_path, tracked, monkeypatch):
    """One 25 MB shard (TP 1 x PP 1) -> HF: the shard's pages resident through its mapping stay within a few
    READ_BLOCK_BYTES (1 MiB; 1.2 MB measured) because the mapping is dropped as reads add up. Without dropping it
    (a budget larger than the model: the control) they grow to the model's size, so the measure tells them apart."""
    config = config_for(8, hidden=256, vocab=1024)
    source, _ = make_checkpoint(tmp_path / "src", config, 1, 1)
    model_bytes = os.path.getsize(os.path.join(source, "model_tp00_pp000.pt"))
    assert model_bytes > 25 * 2 ** 20
    merge = load_tool("merge_mp_partitions")
    growth = {}
    for budget in (2 ** 30, 2 ** 20):  # the control first: it also loads the libraries a first conversion maps
        monkeypatch.setattr(streams, "READ_BLOCK_BYTES", budget)
        tracker = tracked()
        assert merge.main(["--model-path", source, "--output-path", str(tmp_path / f"hf{budget}")]) == 0
        growth[budget] = tracker.mapped_growth
    assert growth[2 ** 20] < 3 * 2 ** 20, growth  # at most the budget plus the last read, with page rounding
    assert growth[2 ** 30] > 0.8 * model_bytes, growth  # the control: the measure sees mapped pages


def test_safetensors_writer_writes_the_published_format(tmp_path):
    from safetensors import safe_open

    tensors = {"a": torch.randn(5, 3).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(2, 2, 2)}
    path = str(tmp_path / "x.safetensors")
    entries = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    with streams.SafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        writer.write(tensors["a"][:2].contiguous())  # a tensor in blocks of rows
        writer.write(tensors["a"][2:].contiguous())
        writer.write(tensors["b"])
        writer.write(tensors["c"])
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert (8 + header_len) % 8 == 0
    assert os.path.getsize(path) == 8 + header_len + sum(nbytes(t.shape, t.dtype) for t in tensors.values())
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
    with pytest.raises(AssertionError, match="not every tensor was written"):
        with streams.SafetensorsWriter(str(tmp_path / "y.safetensors"), entries) as writer:
            writer.write(tensors["a"])
