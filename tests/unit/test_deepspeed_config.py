"""The DeepSpeed JSON against the flags: keys naming flags, contradictions, unknown keys, the dict DeepSpeed gets."""
import logging

import pytest

from megatron.arguments import parse_args, resolve
from megatron.deepspeed_config import log_notes, merge_json_flags, reconcile

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]


def test_json_key_naming_a_flag_sets_it():
    args = parse_args([a for a in FLAGS if a not in ("--lr", "1e-3")] + ["--deepspeed_config", "ds.json"])
    values, notes = merge_json_flags(args, {"lr": 6e-5, "warmup_iters": 100, "seed": 7}, "ds.json")
    assert (values["lr"], values["lr_warmup_iters"], values["seed"]) == (6e-5, 100.0, 7)
    assert (args.lr, args.lr_warmup_iters, args.seed) == (None, 0, 1234)  # the Namespace is not changed
    assert notes == [(logging.INFO, "DeepSpeed config ds.json sets --lr 6e-05, --lr-warmup-iters 100.0, --seed 7")]
    config, _ = resolve(args, 1, {"lr": 6e-5, "warmup_iters": 100, "seed": 7}, None, None)
    assert (config.optimizer.lr, config.optimizer.lr_warmup_iters, config.model.seed) == (6e-5, 100, 7)


def test_json_key_equal_to_a_command_line_flag_is_accepted():
    values, notes = merge_json_flags(parse_args(FLAGS), {"lr": 1e-3}, "ds.json")
    assert (values["lr"], notes) == (1e-3, [])


@pytest.mark.parametrize("user,message", [
    ({"lr": 6e-5}, "DeepSpeed config lr=6e-05 contradicts --lr 0.001; make them equal or drop the key from the JSON"),
    ({"micro_batch_size": 4}, "DeepSpeed config micro_batch_size=4 contradicts --micro-batch-size 2; make them "
                              "equal or drop the key from the JSON"),
], ids=["lr", "micro-batch"])
def test_json_key_contradicting_a_command_line_flag(user, message):
    with pytest.raises(ValueError) as err:
        merge_json_flags(parse_args(FLAGS), user, "ds.json")
    assert str(err.value) == message


@pytest.mark.parametrize("extra,user,message", [
    (["--zero-stage", "1"], {"zero_optimization": {"stage": 2}},
     "DeepSpeed config zero_optimization.stage=2 contradicts --zero-stage 1; make them equal or drop one"),
    (["--clip-grad", "0.5"], {"gradient_clipping": 1.0},
     "DeepSpeed config gradient_clipping=1.0 contradicts --clip-grad 0.5; make them equal or drop one"),
    (["--global-batch-size", "4"], {"train_batch_size": 8},
     "DeepSpeed config train_batch_size=8 contradicts --global-batch-size 4; make them equal or drop "
     "train_batch_size from the JSON"),
    ([], {"train_micro_batch_size_per_gpu": 4},
     "DeepSpeed config train_micro_batch_size_per_gpu=4 contradicts --micro-batch-size 2; make them equal or drop "
     "the key from the JSON"),
    ([], {"optimizer": {"type": "Adam", "params": {"lr": 0.1}}},
     "DeepSpeed config optimizer.params.lr=0.1 contradicts --lr 0.001; the optimizer is built from the flags: make "
     "them equal or drop the optimizer section"),
    (["--bf16"], {"bf16": {"enabled": False}},
     "DeepSpeed config bf16.enabled=false contradicts --bf16 (set); drop --bf16 or set bf16.enabled to true (or "
     "remove it) in the JSON"),
    (["--fp16"], {"fp16": {"enabled": False}},
     "DeepSpeed config fp16.enabled=false contradicts --fp16 (set); drop --fp16 or set fp16.enabled to true (or "
     "remove it) in the JSON"),
    ([], {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}},
     "DeepSpeed config zero_optimization.offload_optimizer.device=nvme is not supported: the optimizer is built "
     "from the flags (torch's AdamW), which ZeRO can offload to the CPU only; set the device to cpu (or pass "
     "--cpu-offload and drop offload_optimizer)"),
    (["--cpu-offload"], {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}},
     "DeepSpeed config zero_optimization.offload_optimizer.device=none contradicts --cpu-offload (set); drop "
     "--cpu-offload or set the device to cpu"),
    (["--fp16", "--loss-scale-window", "500"], {"fp16": {"loss_scale_window": 1000}},
     "DeepSpeed config fp16.loss_scale_window=1000 contradicts --loss-scale-window 500; make them equal or drop one"),
    (["--initial-loss-scale", "65536"], {"fp16": {"initial_scale_power": 12}},
     "DeepSpeed config fp16.initial_scale_power=12 contradicts --initial-loss-scale 65536.0; make them equal or "
     "drop one"),
    (["--loss-scale", "128"], {"fp16": {"loss_scale": 0}},
     "DeepSpeed config fp16.loss_scale=0 contradicts --loss-scale 128.0; make them equal or drop one"),
    (["--optimizer", "sgd"], {"optimizer": {"type": "AdamW"}},
     "DeepSpeed config optimizer.type=AdamW contradicts --optimizer sgd; the optimizer is built from the flags (adam: "
     "AdamW, sgd): make them equal or drop the optimizer section"),
    ([], {"optimizer": {"type": "Lamb"}},
     "DeepSpeed config optimizer.type=Lamb contradicts --optimizer adam; the optimizer is built from the flags (adam: "
     "AdamW, sgd): make them equal or drop the optimizer section"),
    (["--partition-activations"], {"activation_checkpointing": {"partition_activations": False}},
     "DeepSpeed config activation_checkpointing.partition_activations=false contradicts --partition-activations "
     "(set); make them equal or drop one"),
], ids=["zero", "clip", "global-batch", "micro-batch", "optimizer", "bf16-disabled", "fp16-disabled", "nvme",
        "offload-none", "optimizer-type", "optimizer-unknown", "loss-scale-window", "initial-scale-power",
        "static-scale", "partition-activations"])
def test_deepspeed_key_contradicting_a_flag(extra, user, message):
    values, _ = merge_json_flags(parse_args(FLAGS + extra), user, "ds.json")
    with pytest.raises(ValueError) as err:
        reconcile(values, user, 1)
    assert str(err.value) == message


def test_unknown_key_warns_once_with_a_close_match(caplog, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    _, notes = merge_json_flags(parse_args(FLAGS), {"gradient_cliping": 1.0, "steps_per_print": 5}, "ds.json")
    with caplog.at_level(logging.WARNING, logger="megatron"):
        log_notes(notes)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "DeepSpeed config ds.json: key gradient_cliping is neither DeepSpeed's nor a flag's; "
                          "ignored (did you mean gradient_clipping?)")]
    caplog.clear()
    monkeypatch.setenv("LOCAL_RANK", "1")  # the other processes of the host stay quiet
    with caplog.at_level(logging.WARNING, logger="megatron"):
        log_notes(notes)
    assert caplog.records == []


def test_json_precision_auto_follows_the_flags():
    for flags, want in (([], ("fp32", False)), (["--bf16"], ("bf16", True))):
        config, ds = resolve(parse_args(FLAGS + flags), 1, {"bf16": {"enabled": "auto"}}, None, None)
        assert (config.precision.name, ds["bf16"]["enabled"]) == want


def test_built_dict_from_flags_and_json():
    args = parse_args(FLAGS + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--bf16"])
    user = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.25, "steps_per_print": 10}
    config, ds = resolve(args, 4, user, None, None)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["gradient_clipping"], ds["steps_per_print"]) == (16, 2, 4, 0.25, 10)
    assert (ds["bf16"], ds["fp16"], ds["zero_optimization"]) == ({"enabled": True}, {"enabled": False}, {"stage": 1})
    assert (config.training.zero_stage, config.optimizer.clip_grad, config.precision.name) == (1, 0.25, "bf16")


def test_built_dict_fp16_and_offload():
    args = parse_args(FLAGS + ["--fp16", "--loss-scale-window", "500"])
    user = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    config, ds = resolve(args, 2, user, None, None)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (8, 2, 1.0)
    assert ds["bf16"] == {"enabled": False}
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 500,
                          "hysteresis": 2, "min_loss_scale": 1.0}
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert (config.training.cpu_offload, config.training.global_batch_size) == (True, 8)


def test_json_precision_with_the_other_flag_is_one_clash():
    with pytest.raises(ValueError) as err:
        resolve(parse_args(FLAGS + ["--fp16"]), 1, {"bf16": {"enabled": True}}, None, None)
    assert str(err.value) == ("--bf16 and --fp16 are both set (as flags or as bf16.enabled and fp16.enabled in the "
                              "DeepSpeed JSON); choose one")


def test_offload_without_zero_is_refused():
    with pytest.raises(ValueError) as err:
        resolve(parse_args(FLAGS), 1, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, None, None)
    assert str(err.value) == "--cpu-offload needs ZeRO stage 1, 2 or 3 (got 0); add --zero-stage 2"


def test_json_optimizer_type_sets_the_flag_not_given():
    config, ds = resolve(parse_args(FLAGS), 1, {"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}, None, None)
    assert config.optimizer.optimizer == "sgd" and "optimizer" not in ds


def test_json_fp16_settings_set_the_flags_not_given():
    """DeepSpeed's fp16 keys hold the loss-scale flags' settings: the Config and the built dict agree with them."""
    user = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 200,
                     "hysteresis": 4, "min_loss_scale": 2}}
    config, ds = resolve(parse_args(FLAGS + ["--min-loss-scale", "2"]), 1, user, None, None)
    p = config.precision
    assert (p.fp16, p.loss_scale, p.initial_loss_scale, p.loss_scale_window, p.hysteresis, p.min_loss_scale) == \
        (True, None, 4096.0, 200, 4, 2.0)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 200,
                          "hysteresis": 4, "min_loss_scale": 2.0}
