"""--eval-harness-* flags: resolved into EvalHarnessConfig, contradictions and unknown tasks named before training,
and the harness log line."""
import pytest

from megatron.arguments import parse_args, resolve
from megatron.evaluation.callback import EvalHarnessCallback, format_harness_line
from megatron.tokenizer import build_tokenizer
from tests.launch import ROOT, TOKENIZER

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data"]


def config_of(*flags):
    return resolve(parse_args(BASE + list(flags)), 1)[0]


def test_flags_resolve_into_the_eval_harness_section():
    harness = config_of("--eval-harness-tasks", "alice_cloze, alice_choice", "--eval-harness-interval", "5",
                        "--eval-harness-limit", "8", "--eval-harness-include-path", "examples/eval").eval_harness
    assert harness.eval_harness_tasks == ("alice_cloze", "alice_choice") and harness.enabled
    assert (harness.eval_harness_interval, harness.eval_harness_limit) == (5, 8.0)
    assert not config_of().eval_harness.enabled


@pytest.mark.parametrize("flags,message", [
    (["--eval-harness-tasks", "alice_cloze"], "--eval-harness-tasks needs --eval-harness-interval N"),
    (["--eval-harness-interval", "5"], "--eval-harness-interval is set but --eval-harness-tasks names no task"),
    (["--eval-harness-tasks", "a", "--eval-harness-interval", "0"], "--eval-harness-interval 0 must be at least 1"),
    (["--eval-harness-tasks", "a", "--eval-harness-interval", "2", "--eval-harness-limit", "0"],
     "--eval-harness-limit 0.0 must be positive"),
])
def test_contradictions_name_the_flags(flags, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        config_of(*flags)


def test_unknown_task_stops_before_training():
    config = config_of("--eval-harness-tasks", "alice_cloze,no_such_task", "--eval-harness-interval", "5",
                       "--eval-harness-include-path", str(ROOT / "examples" / "eval"))
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(TOKENIZER))
    with pytest.raises(ValueError, match="--eval-harness-tasks: no_such_task is not one of lm-eval's tasks nor in "
                                         "--eval-harness-include-path"):
        EvalHarnessCallback(config, tokenizer)


def test_harness_line():
    line = format_harness_line(20, {"b/acc": 0.25, "a/perplexity": 123.456789}, 1.26)
    assert line == "eval harness at iteration 20 | a/perplexity: 123.457 | b/acc: 0.25 | seconds: 1.3 |"


def _evaluate_tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,message", [
    (["--load", "no/such/ckpt", "--tasks", "alice_cloze"], "error: --load no/such/ckpt: no such file or folder"),
    (["--load", ".", "--tasks", " , "], "error: --tasks is empty; name at least one lm-eval task"),
    (["--load", ".", "--tasks", "x", "--batch-size", "0"], "error: --batch-size 0 must be at least 1"),
    (["--load", ".", "--tasks", "x", "--include-path", "no/dir"], "error: --include-path no/dir: no such folder"),
])
def test_evaluate_tool_names_the_bad_flag(flags, message, capsys):
    assert _evaluate_tool().main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_zero3_is_refused_before_training():
    config = config_of("--eval-harness-tasks", "alice_cloze", "--eval-harness-interval", "5", "--zero-stage", "3")
    with pytest.raises(ValueError, match="--eval-harness-tasks does not run under --zero-stage 3"):
        EvalHarnessCallback(config, None)
