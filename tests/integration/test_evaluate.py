"""lm-evaluation-harness on a tiny trained checkpoint: our backend equals lm-eval's hf backend on the merged folder
(every request's log-likelihood and is_greedy, every generation, every metric), TP 2 and PP 2 checkpoints under
torchrun equal TP 1 request by request, lm-eval's local-completions against our server gives our metrics, and
generate_until with a stop string equals the engine's own output cut there. The training run that makes the
checkpoint also runs the --eval-harness-* hook (a working task and a broken one).

One training run (30 iterations, fp32) serves the module; requests are limited to LIMIT documents per task.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from tests.distributed import free_port
from tests.launch import PYTHON, ROOT, TINY_MODEL, TOKENIZER, env, read_losses, run_pretrain

TASKS = ["alice_cloze", "alice_choice", "alice_perplexity", "alice_continue"]
LOGLIKELIHOOD_TASKS = TASKS[:3]
LIMIT = 6
CONTEXT = 32  # the model's --seq-length: lm-eval's max_length on every side
BROKEN_TASK = """task: alice_broken
dataset_path: json
dataset_kwargs:
  data_files:
    test: examples/eval/data/no_such_file.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def at_root():
    """The task YAMLs name their data relative to the repository root (as the README runs them)."""
    before = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(before)


@pytest.fixture(scope="module")
def trained(sample_data, tmp_path_factory):
    """(run folder, finished process): PP 2 on 2 processes (the hook then runs through DeepSpeed's pipeline
    module), 30 iterations, saved at 30 (ckpt/, PP 2) and written again as TP 1 x PP 1 (tp1/), the harness hook
    every 10 iterations on alice_cloze and a task whose data file is missing."""
    out = tmp_path_factory.mktemp("evaluate")
    tasks = out / "tasks"
    shutil.copytree(ROOT / "examples" / "eval", tasks, ignore=shutil.ignore_patterns("data", "*.py"))
    (tasks / "alice_broken.yaml").write_text(BROKEN_TASK)
    proc = run_pretrain(TINY_MODEL + [
        "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "5e-3", "--train-iters", "30",
        "--log-interval", "10", "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file",
        str(TOKENIZER / "merges.txt"), "--pad-vocab-size-to", "8000", "--deepspeed", "--data-path", sample_data,
        "--save", str(out / "ckpt"), "--save-interval", "30", "--tensorboard-dir", str(out / "tb"),
        "--eval-harness-tasks", "alice_cloze,alice_broken", "--eval-harness-interval", "10",
        "--eval-harness-limit", str(LIMIT), "--eval-harness-include-path", str(tasks),
        "--pipeline-model-parallel-size", "2"], nproc=2, timeout=300)
    from megatron.checkpoint.convert import CheckpointReader, write_megatron_checkpoint
    reader = CheckpointReader(str(out / "ckpt"))
    write_megatron_checkpoint(str(out / "tp1"), reader, reader.config, 1, 1, iteration=30,
                              tokenizer_dir=reader.tokenizer_dir)
    reader.close()
    return out, proc


def samples_of(results):
    """{task: [filtered response per request, by doc id]} of lm-eval's logged samples."""
    return {task: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def assert_same_responses(ours, theirs, atol):
    assert ours.keys() == theirs.keys()
    for task in ours:
        assert len(ours[task]) == len(theirs[task]) == LIMIT, task
        for a, b in zip(ours[task], theirs[task]):
            for x, y in zip(a, b):
                if isinstance(x, str):  # a generation
                    assert x == y, task
                elif isinstance(x, (list, tuple)):  # (log-likelihood, is_greedy)
                    assert abs(x[0] - y[0]) <= atol and bool(x[1]) == bool(y[1]), (task, x, y)
                else:  # a rolling log-likelihood
                    assert abs(x - y) <= atol, (task, x, y)


def assert_same_metrics(ours, theirs, tasks, rtol):
    for task in tasks:
        for key, value in ours["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert value == pytest.approx(theirs["results"][task][key], rel=rtol, abs=1e-12), (task, key)


@pytest.fixture(scope="module")
def ours(trained, at_root):
    """(MegatronLM, lm-eval results with samples) of the TP 1 checkpoint, in this process."""
    from lm_eval.api.registry import get_model

    from megatron.evaluation.harness import run_tasks

    # through lm-eval's registry, as `--model megatron --model_args load=...` builds it
    lm = get_model("megatron").create_from_arg_string(f"load={trained[0] / 'tp1'}", {"batch_size": 8})
    assert lm.max_length == CONTEXT and lm.batch_size == 8
    return lm, run_tasks(lm, TASKS, "examples/eval", limit=LIMIT, bootstrap_iters=0, log_samples=True)


def test_matches_lm_eval_hf_backend_on_the_merged_folder(trained, ours, tmp_path):
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron.inference import SamplingParams

    from megatron.checkpoint.convert import CheckpointReader
    from megatron.checkpoint.hf import write_hf_folder
    from megatron.evaluation.harness import task_manager

    reader = CheckpointReader(str(trained[0] / "tp1"))
    folder = write_hf_folder(tmp_path / "hf", reader, reader.config, torch.float32, tokenizer_dir=reader.tokenizer_dir)
    reader.close()
    hf_lm = HFLM(pretrained=str(folder), dtype="float32", device="cpu", max_length=CONTEXT, batch_size=8)
    hf = lm_eval.simple_evaluate(model=hf_lm, tasks=TASKS, task_manager=task_manager(TASKS, "examples/eval"),
                                 limit=LIMIT, bootstrap_iters=0)
    results = ours[1]
    assert_same_responses(samples_of(results), samples_of(hf), atol=1e-4)
    assert_same_metrics(results, hf, TASKS, rtol=1e-5)
    assert results["results"]["alice_perplexity"]["word_perplexity,none"] > 1

    # is_greedy both ways: continuations the model itself chooses greedily, and ones it does not
    lm = ours[0]
    requests = []
    for context in ("Alice was beginning to get very tired", "The Queen said to the", "`Curiouser and"):
        greedy = lm.engine().generate([lm.tok_encode(context)], SamplingParams(greedy=True, max_new_tokens=3))[0]
        for continuation in (lm.tok_decode(greedy[:1]), lm.tok_decode(greedy), " Wonderland"):
            requests.append(Instance("loglikelihood", {}, (context, continuation), len(requests)))
    mine, theirs = lm.loglikelihood(requests), hf_lm.loglikelihood(requests)
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert any(g for _, g in mine) and not all(g for _, g in mine)
    torch.testing.assert_close([x for x, _ in mine], [x for x, _ in theirs], rtol=0, atol=1e-4)


def _torchrun(checkpoint, output):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tools" / "evaluate.py"), "--load", str(checkpoint), "--tasks", ",".join(TASKS),
           "--include-path", "examples/eval", "--limit", str(LIMIT), "--batch-size", "8", "--bootstrap-iters", "0",
           "--output-path", str(output), "--log-samples"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    responses = {}
    for task in TASKS:
        (path,) = glob.glob(str(output / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(path) as f:
            rows = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
        responses[task] = [[_typed(task, r) for r in s["filtered_resps"]] for s in rows]
    return proc.stdout, responses


def _typed(task, response):
    """A response as lm-eval's samples file writes it (numbers and booleans as strings) back in Python types."""
    if isinstance(response, list):
        return float(response[0]), response[1] in (True, "True")
    return response if task == "alice_continue" else float(response)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_checkpoints_equal_tp1_per_request(trained, ours, tmp_path, tp, pp):
    from megatron.checkpoint.convert import CheckpointReader, write_megatron_checkpoint

    checkpoint = trained[0] / "ckpt"  # the training run's own PP 2 checkpoint
    if tp == 2:
        reader = CheckpointReader(str(trained[0] / "tp1"))
        checkpoint = tmp_path / "ckpt"
        write_megatron_checkpoint(str(checkpoint), reader, reader.config, tp, pp, iteration=30,
                                  tokenizer_dir=reader.tokenizer_dir)
        reader.close()
    stdout, responses = _torchrun(checkpoint, tmp_path / "out")
    assert f"TP {tp} x PP {pp} x DP 1" in stdout and "alice_perplexity" in stdout
    assert_same_responses(responses, samples_of(ours[1]), atol=1e-5)


def test_local_completions_against_the_server_gives_our_metrics(trained, ours):
    import lm_eval

    from megatron.evaluation.harness import task_manager

    port = free_port()
    log = open(trained[0] / "server.log", "w+")
    # lm-eval's API backend keeps one token for the completion: its max_length 34 scores inputs of 32 + 1 tokens
    server = subprocess.Popen([PYTHON, str(ROOT / "tools" / "run_text_generation_server.py"), "--load",
                               str(trained[0] / "tp1"), "--port", str(port), "--max-seq-len", str(CONTEXT + 2),
                               "--max-batch-size", "8", "--log-level", "warning", "--served-model-name", "tiny"],
                              cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if json.loads(response.read())["status"] == "ok":
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.seek(0) or log.read()
            time.sleep(0.2)
        with urllib.request.urlopen(url + "/tokenizer_info", timeout=10) as response:
            info = json.loads(response.read())
        assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", CONTEXT + 2)
        remote = lm_eval.simple_evaluate(
            model="local-completions", model_args=f"base_url={url}/v1/completions,model=tiny,max_length={CONTEXT + 2},"
            "tokenizer_backend=remote,batch_size=4", tasks=LOGLIKELIHOOD_TASKS,
            task_manager=task_manager(LOGLIKELIHOOD_TASKS, "examples/eval"), limit=LIMIT, bootstrap_iters=0)
    finally:
        server.kill()
        server.wait(30)
        log.close()
    results = ours[1]
    expected = {task: rows for task, rows in samples_of(results).items() if task in LOGLIKELIHOOD_TASKS}
    assert_same_responses(samples_of(remote), expected, atol=1e-4)
    assert_same_metrics(results, remote, LOGLIKELIHOOD_TASKS, rtol=1e-5)


def test_generate_until_with_a_stop_string_equals_the_engine(ours):
    from lm_eval.api.instance import Instance

    from megatron.inference import SamplingParams

    lm = ours[0]
    context = "Alice was beginning to get very tired of sitting by her sister"
    ids = lm.tok_encode(context)
    engine = lm.engine()
    full = engine.generate([ids], SamplingParams(greedy=True, max_new_tokens=12))[0]
    text = lm.tok_decode([t for t in full if t != lm.eot_token_id])
    stop = lm.tok_decode(full[3:5])  # a string the greedy continuation reaches after a few tokens
    sampled = SamplingParams(greedy=False, temperature=0.9, top_p=0.95, max_new_tokens=12)
    sample = lm.tok_decode([t for t in engine.generate([ids], sampled, seed=lm.seed + 1)[0] if t != lm.eot_token_id])
    requests = [Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 12}), 0),
                Instance("generate_until", {}, (context, {"until": ["\n\n\n\n"], "max_gen_toks": 12, "do_sample": True,
                                                          "temperature": 0.9, "top_p": 0.95}), 1)]
    got = lm.generate_until(requests)
    assert stop and got[0] == text[:text.index(stop)] and len(got[0]) < len(text)
    assert got[1] == sample.split("\n\n\n\n")[0]


def test_training_hook_logs_its_metrics_at_the_interval_and_a_broken_task_only_warns(trained, ours, at_root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.evaluation.harness import run_tasks

    out, proc = trained
    log = proc.stdout + proc.stderr
    for iteration in (10, 20, 30):
        assert f"eval harness at iteration {iteration} | alice_cloze/acc: " in log
        assert f"eval harness: task alice_broken failed at iteration {iteration} (" in log
    assert "training stopped at iteration 30 (finished)" in log
    assert sorted(read_losses(out / "tb" / "metrics.jsonl")) == [10, 20, 30]  # the training lines are all there
    with open(out / "tb" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if '"eval_harness"' in line]
    assert [r["iteration"] for r in records] == [10, 20, 30]
    events = EventAccumulator(str(out / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval_harness/alice_cloze/perplexity")] == [10, 20, 30]
    # the hook's numbers at iteration 30 are those of the checkpoint saved there, evaluated on its own
    lm = ours[0]
    alone = run_tasks(lm, ["alice_cloze"], "examples/eval", limit=LIMIT, bootstrap_iters=0)["results"]["alice_cloze"]
    assert records[-1]["alice_cloze/perplexity"] == pytest.approx(alone["perplexity,none"], rel=1e-6)
    assert records[-1]["alice_cloze/acc"] == alone["acc,none"]
    assert events.Scalars("eval_harness/alice_cloze/acc")[-1].value == pytest.approx(alone["acc,none"])
    assert "alice_broken/acc" not in records[-1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
