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


def test_decode_flags_reach_the_engine_and_bad_combinations_stop_with_one_line(hf_folders, capsys):
    """--compile-mode, --graph-step, --gemm and --prefill-graph-tokens of both tools: InferenceEngine's
    compile_mode=, graph_step=, gemm=, prefill_graph_tokens=;
    what cannot run here (a CUDA graph or the Triton GEMM on the CPU, fused-step options under TP) is one line."""
    import argparse

    from megatron.inference.loading import add_decode_flags, decode_options

    spec = importlib.util.spec_from_file_location("server_tool", ROOT / "tools" / "run_text_generation_server.py")
    server_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server_tool)
    args = server_tool.parse_args(["--load", hf_folders[0], "--compile-mode", "default", "--gemm", "auto",
                                   "--batch-wait-ms", "3"])
    engine, _, settings, _ = server_tool.build(args)
    assert (engine.decoder.compile_mode, engine.decoder.gemm, engine.graph_step) == ("default", "torch", False)
    assert settings.batch_wait_ms == 3
    with pytest.raises(ValueError) as err:
        server_tool.check_args(server_tool.parse_args(["--load", hf_folders[0], "--batch-wait-ms", "-1"]))
    assert str(err.value) == "--batch-wait-ms -1 must be >= 0"

    prompt = ["--load", hf_folders[0], "--prompt", "The cat", "--max-new-tokens", "4", "--greedy"]
    assert _generate(prompt + ["--graph-step"], capsys) == (2, [
        "error: --graph-step captures the whole decode step in a CUDA graph: it needs a GPU and CUDA graphs (this "
        "run has none); drop --graph-step"])
    assert _generate(prompt + ["--gemm", "triton"], capsys) == (2, [
        "error: --gemm triton needs CUDA and the triton package; use --gemm torch or --gemm auto"])
    assert _generate(prompt + ["--prefill-graph-tokens", "-1"], capsys) == (2, [
        "error: --prefill-graph-tokens -1 is negative; give 0 (no prefill graphs) or a positive bound"])

    parser = argparse.ArgumentParser()
    add_decode_flags(parser)
    assert decode_options(parser.parse_args([]), "cpu", 2, False) == {"compile_mode": None, "graph_step": False,
                                                                      "gemm": "torch", "prefill_graph_tokens": None}
    assert decode_options(parser.parse_args(["--prefill-graph-tokens", "512"]), "cpu", 1,
                          False)["prefill_graph_tokens"] == 0  # no graphs: no padding
    assert decode_options(parser.parse_args(["--prefill-graph-tokens", "512"]), "cuda", 1,
                          True)["prefill_graph_tokens"] == 512
    for flags, message in ((["--compile-mode", "default"], "--compile-mode default tunes the fused decode step, "
                            "which runs at tensor-parallel size 1 (this run: TP 2); drop --compile-mode"),
                           (["--gemm", "auto"], "--gemm auto tunes the fused decode step, which runs at "
                            "tensor-parallel size 1 (this run: TP 2); drop --gemm"),
                           (["--graph-step"], "--graph-step cannot capture the per-step token broadcast of tensor "
                            "parallelism (this run: TP 2); drop --graph-step")):
        with pytest.raises(ValueError) as err:
            decode_options(parser.parse_args(flags), "cuda", 2, True)
        assert str(err.value) == message


def test_generate_text_compiled_decode_step_gives_the_eager_tokens(hf_folders, tmp_path, capsys):
    """--compile-mode default on the CPU (inductor's C++ backend): the same greedy tokens as the eager step."""
    outputs = []
    for extra in ([], ["--compile-mode", "default"]):
        out = tmp_path / f"gen{len(extra)}.jsonl"
        code, _ = _generate(["--load", hf_folders[0], "--prompt", "The cat sat", "--max-new-tokens", "6", "--greedy",
                             "--output-file", str(out)] + extra, capsys)
        assert code == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
