"""Fixtures shared by the inference unit tests."""
import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

from megatron.config import ModelConfig
from megatron.model import BloomModel
from megatron.model.hf_bloom import from_hf_state_dict

VOCAB = 256  # the tests' vocabulary (ids 1-3: bos, eos, pad)


@pytest.fixture
def engine_fault(tmp_path, monkeypatch):
    """The engine worker's test fault file (every step fails while it exists), probed every 50 ms while idle."""
    from megatron.inference import worker

    fault = tmp_path / "fault"
    monkeypatch.setenv(worker.FAULT_HOOK, str(fault))
    monkeypatch.setattr(worker, "PROBE_INTERVAL", 0.05)
    return fault


@pytest.fixture(scope="module")
def pair():
    """A random HF BLOOM with large weights (so greedy decoding does not just repeat) and our copy."""
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4, initializer_range=1.0,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=3)).eval()
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=128,
                         attention_impl="torch")
    ours = BloomModel(config, parallel_output=False).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    return hf, ours
