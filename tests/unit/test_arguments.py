"""Configuration errors stop the run before any work, with a message naming the flags, values and fix."""
import json
import logging
import signal
import subprocess
import sys

import pytest

from megatron.arguments import load_and_resolve, parse_args, resolve
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


def load(args, world):
    return load_and_resolve(args, world_size=world)


def replace(args, flag, value):
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def test_document_command_on_four_gpus_says_what_fits(doc_args):
    with pytest.raises(ValueError) as err:
        load(doc_args, 4)
    assert str(err.value) == (
        "--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 processes per model replica, "
        "which does not divide the 4 processes launched; launch a multiple of 8 processes or pick a layout "
        "that fits 4: TP 1 x PP 1, TP 1 x PP 2, TP 1 x PP 4, TP 2 x PP 1, TP 2 x PP 2, TP 4 x PP 1")


def test_document_json_contradicts_itself(doc_args):
    with pytest.raises(ValueError) as err:
        load(doc_args, 8)
    assert str(err.value) == (
        "DeepSpeed config contradicts itself: train_batch_size 8 must equal train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 4 x data-parallel size 1 = 16; set train_batch_size to 16 or "
        "gradient_accumulation_steps to 2, or drop the batch keys and let the flags decide")


def test_document_command_with_consistent_json_resolves(doc_args, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}))
    config, ds_dict, tokenizer = load(doc_args, 8)
    assert config.parallel.data_parallel_size == 1
    assert config.training.gradient_accumulation_steps == 2
    assert config.optimizer.lr_warmup_iters == 500
    assert config.model.vocab_size == 8192  # the 8000-token example tokenizer padded to 128 x TP 4
    assert (ds_dict["train_batch_size"], ds_dict["bf16"], ds_dict["gradient_clipping"]) == (8, {"enabled": True}, 1.0)
    assert ds_dict["zero_optimization"]["stage"] == 0


def test_flags_alone_configure_deepspeed(doc_args):
    args = doc_args[:doc_args.index("--deepspeed_config")] + doc_args[doc_args.index("--deepspeed_config") + 2:]
    config, ds_dict, _ = load(args + ["--zero-stage", "1"], 16)
    assert (ds_dict["train_batch_size"], ds_dict["train_micro_batch_size_per_gpu"],
            ds_dict["gradient_accumulation_steps"]) == (8, 4, 1)
    assert ds_dict["zero_optimization"]["stage"] == 1


CASES = [
    ("global batch", 16, ["--batch-size", "12"],
     "--global-batch-size 12 is not divisible by --micro-batch-size 4 x data-parallel size 2 = 8; "
     "use a global batch of 8 or 16, or a micro batch size of 2, 3 or 6"),
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
     "--bf16 and --fp16 are both set (as flags or as bf16.enabled and fp16.enabled in the DeepSpeed JSON); "
     "choose one"),
]


@pytest.mark.parametrize("name,world,overrides,message", CASES, ids=[c[0] for c in CASES])
def test_config_errors(doc_args, tmp_path, name, world, overrides, message):
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
        load(args, world)
    assert str(err.value) == message


def test_missing_data_files(doc_args, tmp_path):
    args = replace(doc_args, "--data-path", str(tmp_path / "c4_en"))
    args = replace(args, "--deepspeed_config", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="^--deepspeed_config .*missing.json: file not found"):
        load(args, 8)
    args = [a for a in args if a not in ("--deepspeed_config", str(tmp_path / "missing.json"))]
    with pytest.raises(ValueError) as err:
        load(args, 8)
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


def test_loss_chunk_size_is_refused_under_pipeline_parallelism(doc_args, tmp_path):
    """The pipeline's last stage computes the whole logits before its loss function, so a chunk size would be
    silently ignored there: it is refused instead (PP 1 takes it)."""
    ds = tmp_path / "ok.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))
    doc_args = replace(doc_args, "--deepspeed_config", str(ds))
    with pytest.raises(ValueError) as err:
        load(doc_args + ["--loss-chunk-size", "4096"], 8)
    assert str(err.value) == ("--loss-chunk-size 4096 cannot be combined with --pipeline-model-parallel-size 2: the "
                              "pipeline's last stage computes the whole logits before its loss function; drop "
                              "--loss-chunk-size")
    config, _, _ = load(replace(doc_args, "--pipe-parallel-size", "1") + ["--loss-chunk-size", "4096"], 4)
    assert config.model.loss_chunk_size == 4096


def test_partition_activations_needs_checkpointing(doc_args, tmp_path):
    ds = tmp_path / "ok.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))
    args = replace(doc_args, "--deepspeed_config", str(ds)) + ["--partition-activations"]
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == ("--partition-activations splits the activations that --checkpoint-activations keeps "
                              "across tensor-parallel ranks; add --checkpoint-activations")
    config, ds_dict, _ = load(args + ["--checkpoint-activations"], 8)
    assert ds_dict["activation_checkpointing"]["partition_activations"] is True


# The keys of BLOOM's published ds_config that are not DeepSpeed's but name our flags, and those flags.
DOC_JSON_FLAG_KEYS = {"lr": 6e-5, "min_lr": 1e-6, "lr_decay_style": "cosine", "warmup_iters": 500,
                      "weight_decay": 0.1, "clip_grad": 0.5, "micro_batch_size": 4, "log_interval": 10,
                      "save_interval": 1000}
DOC_FLAGS_OF_KEYS = ["--lr", "--min-lr", "--lr-decay-style", "--warmup", "--weight-decay", "--clip-grad",
                     "--micro-batch-size", "--log-interval", "--save-interval"]


def without(args, *flags):
    out = list(args)
    for flag in flags:
        i = out.index(flag)
        del out[i:i + 2]
    return out


def with_json(args, tmp_path, content):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(content))
    return replace(args, "--deepspeed_config", str(ds)), str(ds)


def test_document_json_keys_act_as_the_flags_they_name(doc_args, tmp_path, caplog):
    args, ds = with_json(without(doc_args, *DOC_FLAGS_OF_KEYS), tmp_path,
                         {"train_batch_size": 8, "bf16": {"enabled": True}, **DOC_JSON_FLAG_KEYS})
    with caplog.at_level(logging.INFO, logger="megatron"):
        config, ds_dict, _ = load(args, 8)
    opt = config.optimizer
    assert (opt.lr, opt.min_lr, opt.lr_decay_style, opt.lr_warmup_iters, opt.weight_decay, opt.clip_grad) == \
        (6e-5, 1e-6, "cosine", 500, 0.1, 0.5)
    assert (config.training.micro_batch_size, config.training.gradient_accumulation_steps,
            config.logging.log_interval, config.checkpoint.save_interval) == (4, 2, 10, 1000)
    assert (ds_dict["gradient_clipping"], ds_dict["train_micro_batch_size_per_gpu"]) == (0.5, 4)
    assert not set(DOC_JSON_FLAG_KEYS) & set(ds_dict)  # DeepSpeed gets its own keys only
    assert [r.getMessage() for r in caplog.records if r.name == "megatron.deepspeed_config"] == [
        f"DeepSpeed config {ds} sets --lr 6e-05, --min-lr 1e-06, --lr-decay-style cosine, --lr-warmup-iters 500.0, "
        "--weight-decay 0.1, --clip-grad 0.5, --micro-batch-size 4, --log-interval 10, --save-interval 1000"]


@pytest.mark.parametrize("key,value,flag,flag_value,shown", [
    ("lr", 6e-5, "--lr", "6e-4", "--lr 0.0006"),
    ("weight_decay", 0.1, "--weight-decay", "0.01", "--weight-decay 0.01"),  # explicit, though the default
    ("lr_decay_style", "linear", "--lr-decay-style", "cosine", "--lr-decay-style cosine"),
    ("warmup_iters", 100, "--warmup", "500", "--lr-warmup-iters 500.0"),
], ids=["lr", "explicit-default", "choice", "alias"])
def test_json_key_contradicting_an_explicit_flag_stops(doc_args, tmp_path, key, value, flag,
                                                       flag_value, shown):
    args, _ = with_json(replace(doc_args, flag, flag_value), tmp_path, {key: value})
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == (f"DeepSpeed config {key}={json.dumps(value)} contradicts {shown}; make them equal "
                              "or drop the key from the JSON")


def test_json_key_equal_to_the_flag_and_defaulted_flags(doc_args, tmp_path):
    args, _ = with_json(doc_args, tmp_path, {"lr": 6e-5, "min_lr": 1e-6, "seed": 7, "hidden_dropout": 0.1})
    config, _, _ = load(args, 8)
    assert (config.optimizer.lr, config.model.seed, config.model.hidden_dropout) == (6e-5, 7, 0.1)


def test_unknown_json_keys_warned_once_by_name(doc_args, tmp_path, caplog):
    args, ds = with_json(doc_args, tmp_path, {"gradient_cliping": 1.0, "foo_bar": 2, "steps_per_print": 10})
    with caplog.at_level(logging.WARNING, logger="megatron"):
        load(args, 8)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"DeepSpeed config {ds}: key gradient_cliping is neither DeepSpeed's nor a flag's; ignored "
        "(did you mean gradient_clipping?)",
        f"DeepSpeed config {ds}: key foo_bar is neither DeepSpeed's nor a flag's; ignored"]


def test_deepspeed_keys_come_from_deepspeed():
    from megatron.deepspeed_config import deepspeed_keys
    keys = deepspeed_keys()
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
            "zero_optimization", "optimizer", "scheduler", "gradient_clipping", "activation_checkpointing",
            "tensorboard", "wandb", "flops_profiler", "steps_per_print", "wall_clock_breakdown", "autotuning",
            "data_types", "comms_logger", "pipeline"} <= keys
    assert not set(DOC_JSON_FLAG_KEYS) & keys


@pytest.mark.parametrize("content,message", [
    ({"lr": "fast"}, 'DeepSpeed config lr="fast" is not a valid --lr: expected a number; fix the value or drop '
                     "the key"),
    ({"lr_decay_style": "exp"}, 'DeepSpeed config lr_decay_style="exp" is not a valid --lr-decay-style: expected '
                                "one of constant, linear, cosine; fix the value or drop the key"),
    ({"log_interval": 2.5}, "DeepSpeed config log_interval=2.5 is not a valid --log-interval: expected an integer; "
                            "fix the value or drop the key"),
    ({"warmup": 10, "warmup_iters": 20}, "DeepSpeed config warmup_iters=20 contradicts its warmup=10 (both set "
                                         "--lr-warmup-iters); keep one"),
    ({"rampup_batch_size": [2, 2]}, "DeepSpeed config rampup_batch_size=[2, 2] is not a valid --rampup-batch-size: "
                                    "expected a list of 3 values; fix the value or drop the key"),
], ids=["type", "choice", "integer", "two-keys", "count"])
def test_bad_json_flag_values(doc_args, tmp_path, content, message):
    args, _ = with_json(without(doc_args, "--lr", "--lr-decay-style", "--log-interval", "--warmup"), tmp_path,
                        content)
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == message


def test_removed_deepspeed_section_stops_before_launching_anything(doc_args, tmp_path):
    from megatron.deepspeed_config import removed_deepspeed_keys
    args, ds = with_json(doc_args, tmp_path, {"elasticity": {"enabled": True}})
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == f"--deepspeed_config {ds}: {removed_deepspeed_keys()['elasticity']}"


def test_required_flags_from_the_command_line_or_the_json(doc_args, tmp_path):
    args, _ = with_json(without(doc_args, "--lr", "--micro-batch-size"), tmp_path, {"bf16": {"enabled": True}})
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == ("missing required flags: --micro-batch-size, --lr; pass them on the command line "
                              "(or as micro_batch_size, lr in the --deepspeed_config JSON)")
    args, _ = with_json(args, tmp_path, {"lr": 1e-4, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ValueError, match="^missing required flags: --micro-batch-size;"):
        load(args, 8)  # DeepSpeed's own micro batch key does not stand in for the flag
    args, _ = with_json(args, tmp_path, {"lr": 1e-4, "micro_batch_size": 4})
    config, _, _ = load(args, 8)
    assert (config.optimizer.lr, config.training.micro_batch_size) == (1e-4, 4)


# Global batch 8 with micro batch 3 on one data-parallel rank: 8 is not divisible by 3; what fits is 6 or 9,
# or a micro batch of 1, 2, 4 or 8. No gradient_accumulation_steps can fix it.
FIT_8_3 = "use a global batch of 6 or 9, or a micro batch size of 1, 2, 4 or 8"
BATCH_CASES = [
    ("json total and accumulation", [], {"train_batch_size": 8, "gradient_accumulation_steps": 2},
     "DeepSpeed config gradient_accumulation_steps 2 x --micro-batch-size 3 x data-parallel size 1 = 6 differs "
     "from DeepSpeed config train_batch_size 8; 8 is not divisible by --micro-batch-size 3 x data-parallel size 1 "
     f"= 3: {FIT_8_3}; then drop gradient_accumulation_steps (it follows from the two)"),
    ("flag total, json accumulation", ["--batch-size", "8"], {"gradient_accumulation_steps": 2},
     "DeepSpeed config gradient_accumulation_steps 2 x --micro-batch-size 3 x data-parallel size 1 = 6 differs "
     "from --global-batch-size 8; 8 is not divisible by --micro-batch-size 3 x data-parallel size 1 = 3: "
     f"{FIT_8_3}; then drop gradient_accumulation_steps (it follows from the two)"),
    ("json total only", [], {"train_batch_size": 8},
     f"DeepSpeed config train_batch_size 8 is not divisible by --micro-batch-size 3 x data-parallel size 1 = 3; "
     f"{FIT_8_3}"),
    ("flags only", ["--batch-size", "8"], {},
     f"--global-batch-size 8 is not divisible by --micro-batch-size 3 x data-parallel size 1 = 3; {FIT_8_3}"),
]


@pytest.mark.parametrize("name,flags,content,message", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_indivisible_batch_says_what_fits(doc_args, tmp_path, name, flags, content, message):
    args, _ = with_json(replace(without(doc_args, "--batch-size"), "--micro-batch-size", "3") + flags, tmp_path,
                        content)
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == message


def test_divisible_batch_names_the_accumulation_that_fits(doc_args, tmp_path):
    args, _ = with_json(doc_args, tmp_path, {"gradient_accumulation_steps": 1})
    with pytest.raises(ValueError) as err:
        load(args, 8)
    assert str(err.value) == ("DeepSpeed config gradient_accumulation_steps 1 x --micro-batch-size 4 x data-parallel "
                              "size 1 = 4 differs from --global-batch-size 8; set gradient_accumulation_steps to 2 "
                              "or drop it")


MOCK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]


def test_resolve_is_pure_and_leaves_the_namespace_alone():
    args = parse_args(MOCK + ["--deepspeed_config", "never-read.json", "--tensor-model-parallel-size", "2"])
    before = dict(vars(args))
    config, ds_dict = resolve(args, 8, {"clip_grad": 0.5, "gradient_accumulation_steps": 3}, None, 1000)
    assert vars(args) == before and (args.clip_grad, args.global_batch_size) == (1.0, None)  # the flags' defaults
    assert (config.parallel.data_parallel_size, config.training.global_batch_size, config.optimizer.clip_grad,
            config.model.vocab_size, config.deepspeed_config) == (4, 24, 0.5, 1024, "never-read.json")
    assert (ds_dict["train_batch_size"], ds_dict["gradient_accumulation_steps"], ds_dict["gradient_clipping"]) == \
        (24, 3, 0.5)
    other, other_ds = resolve(args, 2, None, None, 1000)  # another world, no JSON: nothing carries over
    assert (other.parallel.data_parallel_size, other.training.global_batch_size, other.optimizer.clip_grad,
            other_ds["train_batch_size"], other_ds["gradient_accumulation_steps"]) == (1, 2, 1.0, 2, 1)
    again, again_ds = resolve(args, 8, {"clip_grad": 0.5, "gradient_accumulation_steps": 3}, None, 1000)
    assert (again.parallel.data_parallel_size, again.training.global_batch_size, again.optimizer.clip_grad,
            again_ds["train_batch_size"], again_ds["gradient_accumulation_steps"]) == (4, 24, 0.5, 24, 3)
    assert vars(args) == before


def test_defaults_live_in_the_configs():
    config, ds_dict = resolve(parse_args(MOCK), 4, None, None, None)
    assert (config.training.global_batch_size, config.optimizer.clip_grad, config.training.zero_stage,
            config.model.vocab_size, config.parallel.distributed_backend) == (8, 1.0, 0, 50304, "gloo")
    assert config.optimizer.lr_decay_style == "linear"  # Megatron's default
    assert (ds_dict["train_batch_size"], ds_dict["gradient_clipping"], ds_dict["zero_optimization"]) == \
        (8, 1.0, {"stage": 0})
    samples = [a for a in MOCK if a not in ("--train-iters", "10")] + ["--train-samples", "100", "--warmup", "0.25"]
    config, _ = resolve(parse_args(samples + ["--global-batch-size", "16"]), 4, None, None, None, cuda_available=True)
    assert (config.training.train_iters, config.optimizer.lr_decay_iters, config.optimizer.lr_warmup_iters,
            config.parallel.distributed_backend) == (6, 6, 2, "nccl")


def test_saved_padded_vocab_is_kept_when_resuming():
    args = parse_args(MOCK + ["--load", "ckpt", "--tensor-model-parallel-size", "2"])
    config, _ = resolve(args, 2, None, {"vocab_size": 1280}, 1000)
    assert (config.model.vocab_size, config.data.pad_vocab_size_to) == (1280, 1280)
    config, _ = resolve(args, 2, None, {"vocab_size": 900}, 1000)  # smaller than the tokenizer: padded anew
    assert (config.model.vocab_size, config.data.pad_vocab_size_to) == (1024, None)
    config, _ = resolve(parse_args(MOCK + ["--tensor-model-parallel-size", "2"]), 2, None, {"vocab_size": 1280}, 1000)
    assert config.model.vocab_size == 1024  # no --load: the meta is not consulted
    args = parse_args(MOCK + ["--load", "ckpt", "--tensor-model-parallel-size", "4"])
    with pytest.raises(ValueError) as err:
        resolve(args, 4, None, {"vocab_size": 1282}, 1000)
    assert str(err.value) == ("--load ckpt: its padded vocabulary (1282) is not divisible by "
                              "--tensor-model-parallel-size 4; pick a TP size that divides it")


@pytest.mark.parametrize("given,expected", [
    (dict(tokenizer_type="PretrainedFromHF", vocab_file="v.json"), "PretrainedFromHF"),
    (dict(vocab_file="v.json", merge_file="m.txt", tokenizer_name_or_path="dir"), "GPT2BPETokenizer"),
    (dict(vocab_file="v.json"), "GPT2BPETokenizer"),  # build_tokenizer then names the missing --merge-file
    (dict(tokenizer_name_or_path="dir"), "PretrainedFromHF"),
], ids=["explicit", "both", "half", "hf"])
def test_infer_tokenizer_type(given, expected):
    from megatron.tokenizer import infer_tokenizer_type
    assert infer_tokenizer_type(given.pop("tokenizer_type", None), **given) == expected


def test_no_tokenizer_is_one_message_for_training_and_preprocessing(tmp_path):
    from megatron.tokenizer import infer_tokenizer_type
    from tools.preprocess_data import check_args, get_args
    message = ("no tokenizer: pass --vocab-file and --merge-file (GPT2BPETokenizer) or --tokenizer-name-or-path "
               "(PretrainedFromHF: a local Hugging Face tokenizer folder)")
    with pytest.raises(ValueError) as err:
        infer_tokenizer_type(None)
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        load_and_resolve([a for a in MOCK if a != "--mock-data"] + ["--data-path", "x"], world_size=1)
    assert str(err.value) == message
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError) as err:
        check_args(get_args(["--input", str(corpus), "--output-prefix", str(tmp_path / "out")]))
    assert str(err.value) == message


@pytest.mark.parametrize("argv,message", [
    (["--micro-batch-szie", "4"], "unrecognized arguments: --micro-batch-szie 4 (did you mean --micro-batch-size?)"),
    (["--misspeled-flag"], "unrecognized arguments: --misspeled-flag"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
], ids=["close", "unknown", "type"])
def test_bad_command_line_raises_and_the_entry_point_prints_it_once(monkeypatch, capsys, isolated_logging, argv,
                                                                    message):
    """The parser raises ConfigError carrying the line and prints nothing; pretrain_bloom.py prints it once (the
    first local rank: no usage block) and exits 2, the other ranks silently with the same code."""
    import pretrain_bloom
    from megatron import initialize
    from megatron.arguments import build_parser
    from megatron.config import ConfigError
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert str(err.value) == f"{message}; see {build_parser().prog} --help"
    assert capsys.readouterr() == ("", "")
    with pytest.raises(SystemExit) as exit_:
        pretrain_bloom.main(argv)
    out, stderr = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert [line.split("] ", 2)[2] for line in stderr.splitlines()] == [  # after "[time] [rank 0] "
        f"ERROR megatron: {message}; see {build_parser().prog} --help"]
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(initialize, "_SILENT_RANK_GRACE_S", 0)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as exit_:
            pretrain_bloom.main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert exit_.value.code == 2 and capsys.readouterr() == ("", "")


def test_help_printed_by_the_first_rank_only(monkeypatch, capsys):
    from megatron.arguments import parse_args
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--log-level {debug,info,warning}" in capsys.readouterr().out


def _field_defaults():
    """{dest: (field default or MISSING, FlagSpec)} read from the config dataclasses themselves."""
    import dataclasses
    from megatron.config import FLAG_SECTIONS
    return {f.name: (f.default, f.metadata["flag"]) for _, cls in FLAG_SECTIONS for f in dataclasses.fields(cls)
            if "flag" in f.metadata}


def test_every_flag_has_help_showing_its_config_default():
    """Each flag comes from one config field: its parsed default is the field's, its help describes it and ends
    with that default (or "required ..."); only the launcher's flags and upstream's refused ones set no field."""
    import dataclasses
    from megatron.arguments import LAUNCHER_FLAGS, build_parser
    from megatron.flags import REQUIRED_TEXT, shown
    from megatron.upstream_compat import NOT_SUPPORTED
    fields = _field_defaults()
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    launcher = {s for spellings, _ in LAUNCHER_FLAGS for s in spellings} | set(NOT_SUPPORTED.values())
    assert {a.dest for a in actions} - set(fields) == {s.lstrip("-").replace("-", "_") for s in launcher}
    assert set(fields) <= {a.dest for a in actions}
    for action in actions:
        assert action.help and len(action.help) > 10, action.option_strings
        if action.dest not in fields:
            shown_default = "off" if action.default is False else shown(action.default)
            assert action.help.endswith(f" (default: {shown_default})"), action.option_strings
            continue
        default, spec = fields[action.dest]
        if spec.required:
            assert action.default is None and action.help.endswith("; " + REQUIRED_TEXT), action.option_strings
            continue
        assert default is not dataclasses.MISSING and action.default == default, action.option_strings
        if action.option_strings == [spec.negation]:
            continue
        expected = spec.default_text if default is None and spec.default_text else shown(default)
        assert action.help.endswith(f" (default: {expected})"), (action.option_strings, action.help)
    by_flag = {s: a for a in actions for s in a.option_strings}
    assert by_flag["--lr-decay-style"].help.endswith("(default: linear)")  # Megatron's default (was cosine too)
    assert by_flag["--clip-grad"].default == 1.0 and by_flag["--zero-stage"].default == 0
    assert by_flag["--lr"].default is None and by_flag["--model-parallel-size"].dest == "tensor_model_parallel_size"
    assert (by_flag["--warmup"].dest, by_flag["--batch-size"].dest, by_flag["--dataset-impl"].dest,
            by_flag["--deepspeed-config"].dest, by_flag["--local-rank"].dest) == (
        "lr_warmup_iters", "global_batch_size", "data_impl", "deepspeed_config", "local_rank")


def test_config_imports_no_torch_and_deepspeed_config_no_parser():
    """config.py is pure (no torch, nothing of megatron.core); the DeepSpeed JSON module does not import the parser
    (arguments.py imports it, never the reverse)."""
    code = ("import sys; import megatron.config; print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith('megatron.core'))); import megatron.deepspeed_config; print('torch' in sys.modules, "
            "'megatron.arguments' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env({}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "False False"]


def test_json_is_merged_into_the_flags_once(monkeypatch, tmp_path):
    from megatron import arguments
    calls = []
    merge = arguments.merge_json_flags
    monkeypatch.setattr(arguments, "merge_json_flags", lambda *a: calls.append(a) or merge(*a))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"lr_decay_style": "cosine", "gradient_clipping": 0.5}))
    config, ds_dict, _ = load_and_resolve(MOCK + ["--deepspeed_config", str(ds)], world_size=1)
    assert len(calls) == 1
    assert (config.optimizer.lr_decay_style, config.optimizer.clip_grad, ds_dict["gradient_clipping"]) == \
        ("cosine", 0.5, 0.5)
