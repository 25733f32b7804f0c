"""pretrain_bloom.py's start-up checks (megatron/training/startup_checks.py) and the empty-validation warning: each
silent failure of issue 21 stops with one line (exact text) before any process group, engine or load exists."""
import json
import os
import sys

import numpy as np
import pytest

from megatron.config import ModelConfig, PrecisionConfig
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.training import startup_checks
from megatron.training.startup_checks import (check_data_vocabulary, check_fp16_supported,
                                              check_model_against_checkpoint, largest_token_id)
from tests.launch import ROOT, TOKENIZER, run_pretrain

sys.path.insert(0, str(ROOT / "tools"))

import preprocess_data  # noqa: E402

GPT2 = ROOT / "tests" / "fixtures" / "gpt2"


def _dataset(prefix, documents, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_item(np.asarray(doc, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_largest_token_id_scans_whole_files_and_samples_large_ones(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5000, size=40_000).astype(np.int32)
    tokens[12_345] = 7000
    prefix = _dataset(tmp_path / "d", [tokens[:10_000], tokens[10_000:]], np.int32)
    assert largest_token_id(prefix) == (7000, True)
    # past full_scan_bytes: 4 blocks of 1000 tokens at evenly spaced starts, exactly what numpy finds there
    starts = np.linspace(0, tokens.size - 1000, 4).astype(np.int64)
    expected = max(int(tokens[s:s + 1000].max()) for s in starts)
    assert largest_token_id(prefix, full_scan_bytes=1000, blocks=4, block_bytes=4000) == (expected, False)
    assert expected < 7000  # the sampled blocks miss the outlier, and say that they sampled
    assert largest_token_id(_dataset(tmp_path / "e", [])) == (-1, True)


def _counting_scan(prefix):
    with open(f"{prefix}.scans", "a") as f:  # one line per real scan, whichever process made it
        f.write("scan\n")
    return largest_token_id(prefix)


def _check_in_process(prefix, cache_dir, results):
    results.put(startup_checks.cached_largest_token_id(prefix, cache_dir, scan=_counting_scan))


def test_the_processes_of_a_node_scan_a_file_once(tmp_path):
    """Four processes starting together (one per GPU of a node) scan the .bin once and all get its result; a new
    version of the file (another size or modification time) is scanned again."""
    import multiprocessing

    prefix = _dataset(tmp_path / "d", [[5, 9, 8001], [3]])
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_check_in_process, args=(prefix, cache, results)) for _ in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0, 0, 0]
    assert [results.get(timeout=5) for _ in processes] == [(8001, True)] * 4
    assert open(f"{prefix}.scans").read() == "scan\n"
    _dataset(tmp_path / "d", [[5, 9, 8002], [3]])  # same size, later modification time
    os.utime(f"{prefix}.bin", ns=(os.stat(f"{prefix}.bin").st_atime_ns, os.stat(f"{prefix}.bin").st_mtime_ns + 1))
    assert startup_checks.cached_largest_token_id(prefix, cache, scan=_counting_scan) == (8002, True)
    assert open(f"{prefix}.scans").read() == "scan\nscan\n"


def test_data_with_ids_beyond_the_tokenizer_stops(tmp_path):
    prefix = _dataset(tmp_path / "d", [[5, 9, 8001], [3]])
    check_data_vocabulary([prefix], 8002, 8064, "--vocab-file v.json")  # 8001 fits 8002 tokens
    with pytest.raises(ValueError, match="token id 8001 does not fit the tokenizer's 8001 tokens"):
        check_data_vocabulary([prefix], 8001, 8064, "--vocab-file v.json")  # ids run 0 .. 8000
    with pytest.raises(ValueError) as err:
        check_data_vocabulary([prefix], 8000, 8064, "--vocab-file v.json")
    assert str(err.value) == (
        f"--data-path {prefix}: token id 8001 does not fit the tokenizer's 8000 tokens (--vocab-file v.json) nor "
        "the model's padded vocabulary of 8064; the data was made with another tokenizer: pass that one, or re-run "
        "tools/preprocess_data.py with this one")


def _saved(root, **model):
    folder = root / "iter_0000002"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model": model}))
    (root / "latest").write_text("iter_0000002")
    return str(root)


def test_model_flags_against_the_checkpoint_config(tmp_path):
    saved = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=8064, ffn_hidden_size=None,
                 embed_layernorm=True)
    root = _saved(tmp_path / "ckpt", **saved)
    same = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=8064)
    check_model_against_checkpoint(same, root)
    check_model_against_checkpoint(same, str(tmp_path / "none"))  # nothing to compare: the load says so
    other = ModelConfig(num_layers=3, hidden_size=128, num_attention_heads=8, vocab_size=8192, embed_layernorm=False)
    with pytest.raises(ValueError) as err:
        check_model_against_checkpoint(other, root, finetune=True)
    assert str(err.value) == (
        f"--load {root} (--finetune): the model flags do not match the checkpoint's config.json: --num-layers 3 "
        "(checkpoint: 2), --hidden-size 128 (checkpoint: 64), --num-attention-heads 8 (checkpoint: 4), "
        "--no-embed-layernorm (checkpoint: with it), padded vocabulary 8192 (checkpoint: 8064; pass the tokenizer "
        "it was trained with, or --pad-vocab-size-to 8064); pass the checkpoint's values or load another checkpoint")
    ffn = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=8064, ffn_hidden_size=200)
    with pytest.raises(ValueError, match=r"--ffn-hidden-size 200 \(checkpoint: 256\)"):
        check_model_against_checkpoint(ffn, root)


def test_fp16_on_a_cpu_without_it_is_one_line(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: False)
    check_fp16_supported(PrecisionConfig(bf16=True), cuda_available=False)
    check_fp16_supported(PrecisionConfig(fp16=True), cuda_available=True)
    with pytest.raises(ValueError) as err:
        check_fp16_supported(PrecisionConfig(fp16=True), cuda_available=False)
    assert str(err.value) == ("--fp16: DeepSpeed does not support fp16 on this CPU (it needs AVX512-FP16 or "
                              "AMX-FP16); use --bf16, or drop --fp16 to train in fp32, or run on a GPU")
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: True)
    check_fp16_supported(PrecisionConfig(fp16=True), cuda_available=False)
    monkeypatch.setattr(accelerator, "is_bf16_supported", lambda: False)
    with pytest.raises(ValueError) as err:
        check_fp16_supported(PrecisionConfig(bf16=True), cuda_available=False)
    assert str(err.value) == ("--bf16: DeepSpeed does not support bf16 on this CPU; drop --bf16 to train in fp32, "
                              "or run on a GPU")


def test_empty_validation_split_warns_once(tmp_path, caplog):
    prefix = _dataset(tmp_path / "three", [[1, 2, 3, 4]] * 3)
    with caplog.at_level("WARNING"):
        train, valid, _ = build_train_valid_test_datasets(prefix, "969,30,1", (4, 2, 0), 3, 1, str(tmp_path))
        assert train is not None and valid is None
        build_train_valid_test_datasets([0.5, prefix, 0.5, prefix], "969,30,1", (4, 2, 0), 3, 1, str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        f"the validation split is empty: --split 969,30,1 gives it none of the 3 documents of {prefix}, so no "
        "validation loss is computed; add documents or raise the validation part of --split",
        "the validation split is empty: --split 969,30,1 gives it no document of any --data-path dataset, so no "
        "validation loss is computed; add documents or raise the validation part of --split"]


MODEL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
         "32", "--micro-batch-size", "1", "--lr", "1e-3", "--deepspeed", "--tokenizer-name-or-path", str(TOKENIZER)]


def _one_line(proc):
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    return [line.split(" ERROR megatron: ")[-1] for line in output.splitlines() if " ERROR " in line]


def test_pretrain_stops_before_starting(tmp_path):
    """One real 2-layer run on a 3-document corpus (its empty validation split warned about once), then the
    launches that used to fail late: --num-layers 3 on its checkpoint, --finetune with another hidden size, and
    data tokenized with GPT-2's 50257 tokens under the 8000-token tokenizer."""
    sample = ROOT / "examples" / "data" / "sample.jsonl"
    three = tmp_path / "three.jsonl"
    three.write_text("".join(sample.read_text().splitlines(keepends=True)[:3]))
    assert preprocess_data.main(["--input", str(three), "--output-prefix", str(tmp_path / "ours"),
                                 "--tokenizer-name-or-path", str(TOKENIZER), "--append-eod"]) == 0
    ours = str(tmp_path / "ours_text_document")
    ckpt = str(tmp_path / "ckpt")
    run = run_pretrain(MODEL + ["--num-layers", "2", "--train-iters", "2", "--data-path", ours, "--save", ckpt,
                                "--save-interval", "2", "--eval-interval", "1"])
    warnings = [line for line in (run.stdout + run.stderr).splitlines() if "validation split is empty" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"the validation split is empty: --split 969,30,1 gives it none of the 3 documents of {ours}, so no "
        "validation loss is computed; add documents or raise the validation part of --split")

    deeper = run_pretrain(MODEL + ["--num-layers", "3", "--train-iters", "3", "--data-path", ours, "--load", ckpt],
                          check=False)
    assert deeper.returncode == 2 and _one_line(deeper) == [
        f"--load {ckpt}: the model flags do not match the checkpoint's config.json: --num-layers 3 (checkpoint: 2); "
        "pass the checkpoint's values or load another checkpoint"]
    wider = run_pretrain(MODEL[2:] + ["--hidden-size", "128", "--num-layers", "2", "--train-iters", "3",
                                      "--data-path", ours, "--load", ckpt, "--finetune"], check=False)
    assert wider.returncode == 2 and _one_line(wider) == [
        f"--load {ckpt} (--finetune): the model flags do not match the checkpoint's config.json: --hidden-size 128 "
        "(checkpoint: 64); pass the checkpoint's values or load another checkpoint"]

    assert preprocess_data.main(["--input", str(three), "--output-prefix", str(tmp_path / "gpt2"), "--vocab-file",
                                 str(GPT2 / "vocab.json"), "--merge-file", str(GPT2 / "merges.txt"),
                                 "--append-eod"]) == 0
    theirs = str(tmp_path / "gpt2_text_document")
    wrong = run_pretrain(MODEL + ["--num-layers", "2", "--train-iters", "1", "--data-path", theirs], check=False)
    largest = int(np.fromfile(theirs + ".bin", dtype=np.uint16).max())
    assert largest >= 8000
    assert wrong.returncode == 2 and _one_line(wrong) == [
        f"--data-path {theirs}: token id {largest} does not fit the tokenizer's 8000 tokens (--tokenizer-name-or-path "
        f"{TOKENIZER}) nor the model's padded vocabulary of 8064; the data was made with another tokenizer: pass "
        "that one, or re-run tools/preprocess_data.py with this one"]
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest", "metrics.jsonl"]  # nothing new was written


def test_the_checks_are_wired_into_pretrain(monkeypatch):
    """check_before_start runs every check with the run's values (a stand-in records the calls)."""
    calls = []
    monkeypatch.setattr(startup_checks, "check_fp16_supported", lambda *a: calls.append(("fp16",) + a))
    monkeypatch.setattr(startup_checks, "check_model_against_checkpoint", lambda *a: calls.append(("model",) + a))
    monkeypatch.setattr(startup_checks, "check_data_vocabulary", lambda *a: calls.append(("data",) + a))
    from megatron.arguments import load_and_resolve
    config, _, tokenizer = load_and_resolve(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-name-or-path", str(TOKENIZER)],
        world_size=1)
    startup_checks.check_before_start(config, tokenizer)
    assert [c[0] for c in calls] == ["fp16", "model"]  # mock data: no data to check
