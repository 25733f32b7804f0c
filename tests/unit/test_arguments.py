"""Configuration errors stop the run before any work, with a message naming the flags, values and fix."""
import json
import os
import subprocess
import sys

import pytest

from pretrain_bloom import resolve_config
from tests.launch import ROOT, TOKENIZER, env

DOC_COMMAND = (
    "--model-parallel-size 4 --pipe-parallel-size 2 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --batch-size 8 --micro-batch-size 4 --train-iters 100000 "
    "--lr 6e-5 --min-lr 1e-6 --lr-decay-style cosine --warmup 500 --weight-decay 0.01 --clip-grad 1.0 --bf16 "
    "--deepspeed --deepspeed_config {ds} --data-path {data} --vocab-file {vocab} --merge-file {merges} "
    "--save-interval 1000 --log-interval 10").split()


@pytest.fixture
def doc_args(tmp_path, sample_data):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 1}}))
    values = dict(ds=str(ds), data=sample_data, vocab=str(TOKENIZER / "vocab.json"),
                  merges=str(TOKENIZER / "merges.txt"))
    return [arg.format(**values) for arg in DOC_COMMAND]


def resolve(args, world, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return resolve_config(args)


def replace(args, flag, value):
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def test_document_command_on_four_gpus_says_what_fits(doc_args, monkeypatch):
    with pytest.raises(ValueError) as err:
        resolve(doc_args, 4, monkeypatch)
    assert str(err.value) == (
        "--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 processes per model replica, "
        "which does not divide the 4 processes launched; launch a multiple of 8 processes or pick a layout "
        "that fits 4: TP 1 x PP 1, TP 1 x PP 2, TP 1 x PP 4, TP 2 x PP 1, TP 2 x PP 2, TP 4 x PP 1")


def test_document_json_contradicts_itself(doc_args, monkeypatch):
    with pytest.raises(ValueError) as err:
        resolve(doc_args, 8, monkeypatch)
    assert str(err.value) == (
        "DeepSpeed config contradicts itself: train_batch_size 8 must equal train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 4 x data-parallel size 1 = 16; set train_batch_size to 16 or "
        "gradient_accumulation_steps to 2, or drop the batch keys and let the flags decide")


def test_document_command_with_consistent_json_resolves(doc_args, monkeypatch, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}))
    config, ds_dict, tokenizer = resolve(doc_args, 8, monkeypatch)
    assert config.parallel.data_parallel_size == 1
    assert config.training.gradient_accumulation_steps == 2
    assert config.optimizer.lr_warmup_iters == 500
    assert config.model.vocab_size == 8192  # the 8000-token example tokenizer padded to 128 x TP 4
    assert ds_dict["train_batch_size"] == 8 and ds_dict["bf16"]["enabled"] and ds_dict["gradient_clipping"] == 1.0
    assert ds_dict["zero_optimization"]["stage"] == 0


def test_flags_alone_configure_deepspeed(doc_args, monkeypatch):
    args = doc_args[:doc_args.index("--deepspeed_config")] + doc_args[doc_args.index("--deepspeed_config") + 2:]
    config, ds_dict, _ = resolve(args + ["--zero-stage", "1"], 16, monkeypatch)
    assert (ds_dict["train_batch_size"], ds_dict["train_micro_batch_size_per_gpu"],
            ds_dict["gradient_accumulation_steps"]) == (8, 4, 1)
    assert ds_dict["zero_optimization"]["stage"] == 1


CASES = [
    ("global batch", 16, ["--batch-size", "12"],
     "--global-batch-size 12 is not divisible by --micro-batch-size 4 x data-parallel size 2 = 8; "
     "use a multiple of 8"),
    ("heads", 8, ["--num-attention-heads", "4"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8; "
     "choose a TP size that divides the head count"),
    ("hidden", 8, ["--hidden-size", "2050"],
     "--hidden-size 2050 is not divisible by --num-attention-heads 16; "
     "choose a head count that divides the hidden size"),
    ("stages", 8, ["--num-layers", "1"],
     "--pipeline-model-parallel-size 2 is larger than --num-layers 1; every stage needs at least one layer"),
    ("vocab", 8, ["--pad-vocab-size-to", "4096"],
     "--pad-vocab-size-to 4096 is smaller than the tokenizer's vocabulary of 8000 tokens; "
     "pass a value >= 8000 or leave it unset"),
    ("zero3 with pp", 8, ["--zero-stage", "3"],
     "--zero-stage 3 cannot be combined with --pipeline-model-parallel-size 2: DeepSpeed's pipeline engine "
     "supports ZeRO 0 and 1; use --zero-stage 1 or --pipeline-model-parallel-size 1"),
    ("precision", 8, ["--fp16"],
     "DeepSpeed config bf16.enabled=True contradicts --fp16 ; pick one precision"),
]


@pytest.mark.parametrize("name,world,overrides,message", CASES, ids=[c[0] for c in CASES])
def test_config_errors(doc_args, monkeypatch, tmp_path, name, world, overrides, message):
    ds = tmp_path / "ok.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))
    args = replace(doc_args, "--deepspeed_config", str(ds))
    if name == "heads":
        args = replace(args, "--model-parallel-size", "8")
        args = replace(args, "--pipe-parallel-size", "1")
    for flag, value in zip(overrides[::2], overrides[1::2]):
        args = replace(args, flag, value) if flag in args else args + [flag, value]
    if overrides == ["--fp16"]:
        args = [a for a in args if a != "--bf16"] + ["--fp16"]
    with pytest.raises(ValueError) as err:
        resolve(args, world, monkeypatch)
    assert str(err.value) == message


def test_missing_data_files(doc_args, monkeypatch, tmp_path):
    args = replace(doc_args, "--data-path", str(tmp_path / "c4_en"))
    args = replace(args, "--deepspeed_config", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="^--deepspeed_config .*missing.json: file not found"):
        resolve(args, 8, monkeypatch)
    args = [a for a in args if a not in ("--deepspeed_config", str(tmp_path / "missing.json"))]
    with pytest.raises(ValueError) as err:
        resolve(args, 8, monkeypatch)
    prefix = str(tmp_path / "c4_en")
    assert str(err.value) == (f"--data-path {prefix}: {prefix}.bin does not exist; run tools/preprocess_data.py "
                              "first or fix the prefix (no .bin/.idx suffix)")


def test_cli_stops_before_any_work_with_one_line(doc_args):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_bloom.py")] + doc_args, cwd=ROOT,
                          env=env({"WORLD_SIZE": "4", "RANK": "0"}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "TP 4 x PP 1" in errors[0], proc.stderr
    assert "deepspeed" not in proc.stderr.lower().replace("--deepspeed", "")


def test_partition_activations_needs_checkpointing(doc_args, monkeypatch, tmp_path):
    ds = tmp_path / "ok.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))
    args = replace(doc_args, "--deepspeed_config", str(ds)) + ["--partition-activations"]
    with pytest.raises(ValueError) as err:
        resolve(args, 8, monkeypatch)
    assert str(err.value) == ("--partition-activations splits the activations that --checkpoint-activations keeps "
                              "across tensor-parallel ranks; add --checkpoint-activations")
    config, ds_dict, _ = resolve(args + ["--checkpoint-activations"], 8, monkeypatch)
    assert ds_dict["activation_checkpointing"]["partition_activations"] is True
