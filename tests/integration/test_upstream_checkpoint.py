"""Upstream Megatron-DeepSpeed checkpoints (BigScience's BLOOM layout) resume here and convert to Hugging Face.

One real upstream-layout run (tests/upstream_writer.py, 2 processes): a BLOOM PipelineModule whose layers carry
upstream's names and indices (layer_01 embedding with word_embeddings.norm, blocks at layer_03.., the final
LayerNorm at layer_08), TP 2, fp32, ZeRO-1, saved at iteration 3 by DeepSpeed's own engine.save_checkpoint
(layer_XX-model_YY files, mp_rank_XX files with Megatron's args, zero_pp_rank_0_mp_rank_XX optimizer files), then
continued to iteration 6 uninterrupted: the reference. Then:

- `pretrain_bloom.py --load <that folder>` with the same flags continues it: iterations 4-6 give the writer's losses
  (measured bit-for-bit equal; iterations 5 and 6 depend on the restored Adam moments and step), also with
  --sync-tp-duplicated-parameters, whose averages of copies that fp32 TP keeps equal change nothing;
- tools/convert_checkpoint.py writes it as TP 1 x PP 2 in this project's format, whose optimizer state equals the
  upstream ZeRO fragments (read here from the files directly), and tools/merge_mp_partitions.py makes a Hugging Face
  folder whose fp32 logits equal the upstream model's at iteration 3 (max difference measured 2.4e-7: TP 2 vs 1);
- DeepSpeed's own ds_to_universal turns it into a universal checkpoint (latest_universal, zero/<param>/*.pt, the
  vocabulary padding stripped); tools/convert_checkpoint.py --universal-checkpoint converts that to the same
  weights and optimizer state as the direct conversion (the padding rows zero again);
- a folder in neither format stops the tool and training with one line, exit 2.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.launch import DEEPSPEED, ROOT, TINY_MODEL, TOKENIZER, _cleanup_shm, _free_port, env, read_losses, \
    run_pretrain, run_tool

AT, TOTAL = 3, 6


def flags(sample_data, *extra):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(TOTAL), "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "2", "--clip-grad", "1.0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--data-path", sample_data, "--split", "98,2,0",
        "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--tensor-model-parallel-size", "2",
        "--zero-stage", "1", "--deepspeed", *extra]


@pytest.fixture(scope="module")
def upstream_run(tmp_path_factory, sample_data):
    """(the upstream save root, the writer's output folder: losses.json, logits.pt)."""
    out = tmp_path_factory.mktemp("upstream")
    port = _free_port()
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(port), str(ROOT / "tests" / "upstream_writer.py"),
           *flags(sample_data, "--metrics-file", str(out / "writer.jsonl")), "--upstream-save", str(out / "upstream"),
           "--upstream-at", str(AT), "--upstream-out", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    finally:
        _cleanup_shm(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out / "upstream", out


def test_the_writer_wrote_upstreams_layout(upstream_run):
    root, _ = upstream_run
    assert open(root / "latest").read().strip() == f"global_step{AT}"
    names = sorted(os.listdir(root / f"global_step{AT}"))
    layers = [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in (1, 3, 4, 5, 6, 8) for t in (0, 1)]
    assert names == sorted(layers + ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                     "zero_pp_rank_0_mp_rank_01_optim_states.pt"])
    embedding = torch.load(root / f"global_step{AT}" / "layer_01-model_00-model_states.pt", weights_only=True)
    assert sorted(embedding) == ["word_embeddings.norm.bias", "word_embeddings.norm.weight", "word_embeddings.weight"]


def test_resume_continues_the_upstream_run(upstream_run, sample_data, tmp_path):
    root, out = upstream_run
    # --sync-tp-duplicated-parameters (ZeRO-1's fp32 masters too) averages copies that fp32 TP keeps equal: no change
    proc = run_pretrain(flags(sample_data, "--load", str(root), "--metrics-file", str(tmp_path / "m.jsonl"),
                              "--sync-tp-duplicated-parameters"), 2)
    with open(out / "losses.json") as f:
        reference = {int(k): v for k, v in json.load(f).items()}
    resumed = read_losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == list(range(AT + 1, TOTAL + 1))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(reference[iteration], rel=1e-6, abs=0), (iteration, loss, reference)
    log = proc.stdout + proc.stderr
    assert (f"resumed from upstream Megatron-DeepSpeed checkpoint {root}/global_step{AT} (TP 2, PP 1) at iteration "
            f"{AT}, {AT * 4} consumed samples, with its optimizer state; the RNG states restart") in log
    assert "starting from scratch" not in log


def _zero_fragment(folder, mp_rank, param, key):
    """A parameter's state straight from an upstream ZeRO file (its one DP fragment)."""
    state = torch.load(folder / f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_optim_states.pt",
                       weights_only=False)["optimizer_state_dict"]
    for group, mapping in enumerate(state["param_slice_mappings"]):
        if param in mapping:
            fragment = mapping[param]
            flat = state["single_partition_of_fp32_groups"][group] if key == "fp32" else \
                state["base_optimizer_state"]["state"][group][key]  # torch's state_dict: groups by index
            return flat[fragment.start:fragment.start + fragment.numel]
    raise KeyError(param)


def test_convert_to_our_format_and_to_hf(upstream_run, tmp_path):
    from transformers import BloomForCausalLM
    from megatron.checkpoint.format import read_meta
    from megatron.checkpoint.saved_optimizer import SavedOptimizer
    root, out = upstream_run
    proc = run_tool("tools/convert_checkpoint.py", ["--load", root, "--save", tmp_path / "ours",
                                                    "--target-tensor-parallel-size", "1",
                                                    "--target-pipeline-parallel-size", "2"])
    assert proc.stdout.strip() == (
        f"converted upstream Megatron-DeepSpeed checkpoint {root}/global_step{AT} (TP 2, PP 1) into "
        f"{tmp_path}/ours/iter_000000{AT} (TP 1 x PP 2, iteration {AT}, fp32 weights, optimizer state of 53 "
        "parameters)")
    folder = tmp_path / "ours" / f"iter_000000{AT}"
    meta = read_meta(folder)
    assert (meta["iteration"], meta["consumed_samples"], meta["optimizer_format"]) == (AT, AT * 4, "parameters")
    saved = SavedOptimizer(str(folder), {**meta, "data_parallel_size": 1})
    upstream_folder = root / f"global_step{AT}"
    hidden = 64
    for name, param, dim in (("layers.0.self_attention.dense.weight", "3.self_attention.dense.weight", 1),
                             ("layers.3.mlp.dense_h_to_4h.weight", "6.mlp.dense_h_to_4h.weight", 0),
                             ("final_layernorm.bias", "8.bias", None)):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            whole = saved.full(name, key)
            for t in (0, 1):
                expected = _zero_fragment(upstream_folder, t, param, key)
                part = whole if dim is None else whole.chunk(2, dim)[t]
                assert torch.equal(part.reshape(-1), expected), (name, key, t)
        assert tuple(whole.shape) == {1: (hidden, hidden), 0: (4 * hidden, hidden), None: (hidden,)}[dim]
    _universal_converts_the_same(root, folder, tmp_path)
    run_tool("tools/merge_mp_partitions.py", ["--model-type", "bloom", "--model-path", tmp_path / "ours",
                                              "--output-path", tmp_path / "hf"])
    model = BloomForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    reference = torch.load(out / "logits.pt")
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


def _universal_converts_the_same(root, direct, tmp_path):
    from megatron.checkpoint.convert import CheckpointReader
    from megatron.checkpoint.format import read_meta
    from megatron.checkpoint.saved_optimizer import SavedOptimizer
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / f"global_step{AT}"), "--output_folder", str(root / f"global_step{AT}_universal"),
                           "--num_extract_workers", "1", "--num_merge_workers", "1"], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_tool("tools/convert_checkpoint.py", ["--load", root, "--save", tmp_path / "universal", "--universal-checkpoint",
                                             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size",
                                             "1"])
    ours, theirs = CheckpointReader(str(tmp_path / "universal")), CheckpointReader(str(direct))
    states = [SavedOptimizer(r.folder, {**read_meta(r.folder), "data_parallel_size": 1}) for r in (ours, theirs)]
    assert states[0].names() == states[1].names() and len(states[0].names()) == 53
    vocab = 8000  # the tokenizer's: ds_to_universal keeps original_vocab_size rows of the embedding
    for name in theirs.shapes:
        pairs = [(ours.read(name), theirs.read(name))] + [
            (states[0].full(name, key), states[1].full(name, key)) for key in ("fp32", "exp_avg", "exp_avg_sq")]
        for got, expected in pairs:
            if name == "embedding.word_embeddings.weight":
                assert torch.equal(got[:vocab], expected[:vocab]) and not got[vocab:].any()
            else:
                assert torch.equal(got, expected), name


def test_a_folder_in_neither_format_is_named_in_one_line(tmp_path, sample_data):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.pt").write_bytes(b"x")
    (junk / "latest").write_text("step_10")
    message = (f"--load {junk} is neither this project's checkpoint format (iter_XXXXXXX/ with meta.json, named by "
               "`latest`) nor upstream Megatron-DeepSpeed's (global_stepN/ with mp_rank_XX_model_states.pt and "
               "layer_XX-model_YY-model_states.pt); it holds latest, model.pt; pass the folder --save wrote")
    proc = run_tool("tools/convert_checkpoint.py", ["--load", junk, "--save", tmp_path / "out",
                                                    "--target-tensor-parallel-size", "1",
                                                    "--target-pipeline-parallel-size", "1"], check=False)
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, f"error: {message}")
    assert not (tmp_path / "out").exists()
    proc = run_pretrain(flags(sample_data, "--tensor-model-parallel-size", "1", "--load", str(junk)), 1,
                        check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR" in line or "error" in line]
    assert proc.returncode == 2
    assert len(errors) == 1 and errors[0].endswith(message), errors
