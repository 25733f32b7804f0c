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


# ---------------------------------------------------------------- training runs shared by several test files
# (tests/integration/test_layout_change.py and test_convert_checkpoint.py; their flags are test_layout_change's)


@pytest.fixture(scope="session")
def layout_source(tmp_path_factory, sample_data):
    """The uninterrupted TP 2 x PP 2 fp32 run of 20 iterations (4 processes, ZeRO 0), saved at iterations 10 and
    20: its output folder (ckpt/, metrics.jsonl)."""
    from tests.integration.test_layout_change import SOURCE, args
    from tests.launch import run_pretrain
    out = tmp_path_factory.mktemp("layout_source")
    run_pretrain(args(sample_data, out, *SOURCE, "--save", str(out / "ckpt"), "--save-interval", "10"), 4)
    return out


@pytest.fixture(scope="session")
def layout_resumed_on_zero1(layout_source, sample_data, tmp_path_factory):
    """layout_source's iteration-10 checkpoint resumed on TP 1 x PP 1 x DP 2 ZeRO-1 for iterations 11-20:
    (the finished process, its output folder)."""
    from tests.integration.test_layout_change import LAYOUTS, args
    from tests.launch import run_pretrain
    flags, nproc = LAYOUTS["tp1-pp1-dp2-zero1"]
    out = tmp_path_factory.mktemp("layout_resumed_on_zero1")
    proc = run_pretrain(args(sample_data, out, *flags, "--load", str(layout_source / "ckpt" / "iter_0000010")), nproc)
    return proc, out


@pytest.fixture(scope="session")
def layout_resumed_on_tp2_dp2(layout_source, sample_data, tmp_path_factory):
    """layout_source's iteration-10 checkpoint resumed on TP 2 x PP 1 x DP 2 ZeRO-2 for iterations 11-20, saved at
    iteration 15, each rank's bytes read counted (tests/checkpoint_reads.py): (the finished process, its output
    folder: ckpt/, reads/, metrics.jsonl)."""
    from tests.integration.test_layout_change import LAYOUTS, args
    from tests.launch import run_pretrain
    flags, nproc = LAYOUTS["tp2-pp1-dp2-zero2"]
    out = tmp_path_factory.mktemp("layout_resumed_on_tp2_dp2")
    proc = run_pretrain(args(sample_data, out, *flags, "--load", str(layout_source / "ckpt" / "iter_0000010"),
                             "--save", str(out / "ckpt"), "--save-interval", "15"), nproc,
                        extra_env={"MEGATRON_TEST_COUNT_READS": str(out / "reads")})
    return proc, out


@pytest.fixture(scope="session")
def bf16_zero1_source(tmp_path_factory, sample_data):
    """A bf16 TP 1 x DP 2 ZeRO-1 run (2 processes) stopped after iteration 14 (--exit-interval; the schedule is
    --train-iters 20's), saved at iterations 10 and 14: its output folder (ckpt/, metrics.jsonl)."""
    from tests.integration.test_layout_change import args
    from tests.launch import run_pretrain
    out = tmp_path_factory.mktemp("bf16_zero1_source")
    run_pretrain(args(sample_data, out, "--bf16", "--zero-stage", "1", "--exit-interval", "14", "--save",
                      str(out / "ckpt"), "--save-interval", "10"), 2)
    return out


@pytest.fixture
def isolated_logging():
    """For a test that runs a tool's main() in this process: main() calls setup_logging, whose
    logging.basicConfig(force=True) binds a handler to the test's captured stderr (closed after the test) and
    which edits the DeepSpeed logger's filters and warnings.filters. All of it is put back afterwards, so later
    tests' log records neither go to a closed stream nor lose their capture."""
    import logging
    import warnings
    root, ds_logger = logging.getLogger(), logging.getLogger("DeepSpeed")
    saved = (root.handlers[:], root.level, ds_logger.filters[:], warnings.filters[:])
    yield
    root.handlers[:], ds_logger.filters[:], warnings.filters[:] = saved[0], saved[2], saved[3]
    root.setLevel(saved[1])

