"""Shared pytest fixtures and the gpu marker's skip rule."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory):
    """The shipped sample corpus, preprocessed once with the shipped tokenizer: the --data-path prefix."""
    from tests.launch import ROOT, TOKENIZER, run_tool
    out = tmp_path_factory.mktemp("sample_data")
    run_tool("tools/preprocess_data.py", [
        "--input", ROOT / "examples" / "data" / "sample.jsonl", "--output-prefix", out / "sample",
        "--vocab-file", TOKENIZER / "vocab.json", "--merge-file", TOKENIZER / "merges.txt",
        "--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1"])
    return str(out / "sample_text_document")
