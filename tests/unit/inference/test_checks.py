"""Generation and serving check the tokenizer against the model and a prompt against the context in one place
(megatron/inference/checks.py): tools/generate_text.py refuses what the server answers with HTTP 400, in the
same words; a tokenizer that is not the model's stops both with one line."""
import importlib.util
import types

import pytest
import torch

from megatron.checkpoint import hf
from megatron.config import ModelConfig
from megatron.inference import api
from megatron.inference.api import APIError, Limits
from megatron.inference.checks import check_tokenizer_fits_model
from megatron.inference.loading import load_checkpoint_and_tokenizer
from megatron.model.bloom import BloomModel
from megatron.tokenizer import build_tokenizer
from tests.launch import ROOT, TOKENIZER

GPT2 = str(ROOT / "tests" / "fixtures" / "gpt2")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(TOKENIZER))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A 64-token-context model with the examples tokenizer (8000 tokens, padded 8064), and the same weights
    without a tokenizer."""
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=8064, seq_length=64)
    torch.manual_seed(0)
    weights = {name: tensor.clone() for name, tensor in BloomModel(config).state_dict().items()}
    root = tmp_path_factory.mktemp("hf")
    with_tokenizer = hf.write_hf_folder(str(root / "model"), weights, config, torch.float32, str(TOKENIZER))
    bare = hf.write_hf_folder(str(root / "bare"), weights, config, torch.float32)
    return with_tokenizer, bare


def _generate(argv, capsys):
    spec = importlib.util.spec_from_file_location("generate_text", ROOT / "tools" / "generate_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_generate_text_refuses_what_the_server_refuses(hf_folders, tokenizer, capsys):
    prompt = "The" + " cat" * 240
    assert len(tokenizer.tokenize(prompt)) == 241
    code, err = _generate(["--load", hf_folders[0], "--prompt", prompt, "--max-new-tokens", "8"], capsys)
    assert (code, err) == (2, ["error: prompt is 241 tokens long; the model's context is 64 tokens (prompt + "
                               "--max-new-tokens): shorten the prompt"])
    with pytest.raises(APIError) as served:  # the server's request path, with the engine's context of 64
        api.tokenize_prompts([prompt], tokenizer, Limits(max_new_tokens=63, context=64, vocab_size=8000), 8)
    assert (served.value.status, served.value.param, served.value.message) == (
        400, "prompt", "prompt is 241 tokens long; the model's context is 64 tokens (prompt + max_tokens): shorten "
                       "the prompt")
    short = "The" + " cat" * 59  # 60 tokens + 8 new > 64
    code, err = _generate(["--load", hf_folders[0], "--prompt", "a", "--prompt", short, "--max-new-tokens", "8"],
                          capsys)
    assert (code, err) == (2, ["error: prompt 1 (60 tokens) plus --max-new-tokens (8) exceeds the model's context "
                               "of 64 tokens: ask for at most 4 tokens"])
    code, _ = _generate(["--load", hf_folders[0], "--prompt", short, "--max-new-tokens", "4", "--greedy"], capsys)
    assert code == 0


def test_a_tokenizer_that_is_not_the_models_stops(hf_folders):
    model, bare = hf_folders
    with pytest.raises(ValueError) as err:
        load_checkpoint_and_tokenizer(model, tokenizer_dir=GPT2)
    assert str(err.value) == (f"--tokenizer-name-or-path {GPT2}: its vocabulary (50258 tokens) is not the one the "
                              f"model was trained with ({model}, 8000 tokens); leave the flag out to use the model's "
                              "own tokenizer")
    with pytest.raises(ValueError) as err:  # no tokenizer of its own: checked against the vocabulary's size
        load_checkpoint_and_tokenizer(bare, tokenizer_dir=GPT2)
    assert str(err.value) == (f"the tokenizer in {GPT2} has 50258 tokens but the model's vocabulary holds 8064; "
                              "pass the tokenizer the model was trained with")
    merged, tok = load_checkpoint_and_tokenizer(bare, tokenizer_dir=str(TOKENIZER))
    assert (merged.config.vocab_size, tok.vocab_size) == (8064, 8000)


def test_tokenizer_against_the_runs_padding():
    small = types.SimpleNamespace(vocab_size=8000, vocab={"a": 0})
    run = {"data": {"make_vocab_size_divisible_by": 128, "pad_vocab_size_to": None},
           "parallel": {"tensor_model_parallel_size": 2}}
    check_tokenizer_fits_model(small, "tok", 8192, run)  # 8000 -> multiple of 256: 8192
    with pytest.raises(ValueError) as err:
        check_tokenizer_fits_model(small, "tok", 50432, run)
    assert str(err.value) == ("the tokenizer in tok has 8000 tokens, which the run's padding makes 8192, but the "
                              "model's vocabulary is 50432 (its config.json); pass the tokenizer the model was "
                              "trained with")
    check_tokenizer_fits_model(small, "tok", 8064)  # no record of the padding: within 1024 of the tokenizer
    with pytest.raises(ValueError) as err:
        check_tokenizer_fits_model(small, "tok", 9024)
    assert str(err.value) == ("the tokenizer in tok has 8000 tokens but the model's vocabulary is 9024 (its "
                              "config.json), more than padding adds; pass the tokenizer the model was trained with")
    bloom = types.SimpleNamespace(vocab_size=250680, vocab={})
    check_tokenizer_fits_model(bloom, "bloom", 250880)  # BLOOM's own padding (TP 4) passes
