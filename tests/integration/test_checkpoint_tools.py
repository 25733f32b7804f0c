"""Checkpoint tools end to end: train tiny BLOOMs (TP2 x PP2, ZeRO-3 bf16), merge to HF, reshard, resume, generate.

Each training run happens once per module (fixtures); the bad-input cases call the tools' main() in-process.
"""
import errno
import glob
import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import torch

from megatron.checkpoint import convert, hf
from megatron.checkpoint.format import read_meta, shard_name, verify_checkpoint
from megatron.checkpoint.io import write_manifest
from tests.launch import PYTHON, ROOT, TINY_MODEL, TOKENIZER, env, read_losses, run_pretrain, run_tool

TRAIN = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
                      "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
                      "--log-interval", "1", "--deepspeed"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2"]
PROMPTS = ["The cat sat on the", "Once upon a time there was a little girl who lived in"]
# examples/tokenizer has 8000 tokens: padded to a multiple of 128 x TP, 8192 at TP 2 but 8064 at TP 1; a TP 1
# run resuming the TP 2 weights keeps the checkpoint's 8192 (pretrain_bloom reads it from the saved config).
PADDED_VOCAB = {"tp2pp2": 8192, "zero3": 8064}


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool(capsys, name, args):
    """Runs tools/<name>.py's main(args) in this process (no start-up cost); returns its stdout."""
    capsys.readouterr()
    code = load_tool(name).main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def tp2pp2(sample_data, tmp_path_factory):
    """TP2 x PP2 trained for 5 iterations, saved at 4 and 5 (latest); metrics of the uninterrupted run."""
    save = tmp_path_factory.mktemp("tp2pp2") / "ckpt"
    run_pretrain(TRAIN + TP2PP2 + ["--train-iters", "5", "--save-interval", "4", "--data-path", sample_data,
                                   "--save", str(save)], nproc=4)
    return save


@pytest.fixture(scope="module")
def zero3(sample_data, tmp_path_factory):
    """ZeRO-3, DP 2, bf16, 2 iterations."""
    save = tmp_path_factory.mktemp("zero3") / "ckpt"
    run_pretrain(TRAIN + ["--train-iters", "2", "--save-interval", "2", "--zero-stage", "3", "--bf16",
                          "--data-path", sample_data, "--save", str(save)], nproc=2)
    return save


def hf_generate(model, prompt_ids, max_new_tokens, eos, vocab_limit, vocab_size):
    """HF greedy continuation of one prompt, cut after the first eos (the ids our tool would print)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=3, suppress_tokens=list(range(vocab_limit, vocab_size)))
    new = out[0, len(prompt_ids):].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("run", ["tp2pp2", "zero3"])
def test_merge_to_hf_matches_our_model_and_generation(run, request, tmp_path, capsys):
    from transformers import AutoTokenizer, BloomForCausalLM

    ckpt = request.getfixturevalue(run)
    out = tmp_path / "bloom_final"
    args = ["--model-type", "bloom", "--model-path", ckpt, "--output-path", out]
    if run == "tp2pp2":
        args += ["--num-partitions", "2"]
    tool(capsys, "merge_mp_partitions", args)
    assert os.path.isfile(out / "model.safetensors") and os.path.isfile(out / "generation_config.json")
    with open(out / "config.json") as f:
        hf_config = json.load(f)
    assert hf_config["vocab_size"] == PADDED_VOCAB[run] and hf_config["n_layer"] == 4
    assert hf_config["dtype"] == ("bfloat16" if run == "zero3" else "float32")

    hf = BloomForCausalLM.from_pretrained(out, torch_dtype="auto").eval()
    assert hf.dtype == (torch.bfloat16 if run == "zero3" else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if run == "zero3":  # compare in fp32: bf16 -> fp32 is exact
        hf = BloomForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours = convert.build_model(convert.load_merged_checkpoint(str(ckpt)), torch.float32)
    ids = torch.tensor([tokenizer(" ".join(PROMPTS))["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=0)

    gen_file = tmp_path / "gen.jsonl"
    stdout = tool(capsys, "generate_text", ["--load", ckpt, "--greedy", "--max-new-tokens", "12", "--batch-size",
                                               "2", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                                               "--output-file", gen_file])
    assert "tokens/s" in stdout and PROMPTS[1] in stdout
    with open(gen_file) as f:
        records = [json.loads(line) for line in f]
    for prompt, record in zip(PROMPTS, records):
        assert record["prompt_ids"] == tokenizer(prompt)["input_ids"]
        expected = hf_generate(hf, record["prompt_ids"], 12, tokenizer.eos_token_id, len(tokenizer), PADDED_VOCAB[run])
        assert record["generated_ids"] == expected, prompt


def test_generation_tensor_parallel_under_torchrun_equals_one_process(tp2pp2, tmp_path, capsys):
    common = ["--load", str(tp2pp2), "--greedy", "--max-new-tokens", "8", "--batch-size", "2",
              "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    tool(capsys, "generate_text", common + ["--output-file", tmp_path / "one.jsonl"])
    from tests.distributed import free_port
    cmd = [str(os.path.join(os.path.dirname(PYTHON), "torchrun")), "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tools" / "generate_text.py")] + common + [
        "--output-file", str(tmp_path / "tp2.jsonl")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TP 2" in proc.stdout
    with open(tmp_path / "one.jsonl") as a, open(tmp_path / "tp2.jsonl") as b:
        assert [json.loads(x)["generated_ids"] for x in a] == [json.loads(x)["generated_ids"] for x in b]


def test_hf_to_megatron_to_hf_round_trip_is_identical(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=PADDED_VOCAB["tp2pp2"], hidden_size=64, n_layer=4, n_head=4, tie_word_embeddings=True)
    BloomForCausalLM(config).save_pretrained(tmp_path / "hf")
    for name in convert.TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, tmp_path / "hf" / name)
    tool(capsys, "convert_hf_to_megatron", ["--hf-model-path", tmp_path / "hf", "--output-path",
                                                 tmp_path / "ours", "--target-tensor-parallel-size", "2",
                                                 "--target-pipeline-parallel-size", "2"])
    folder = tmp_path / "ours" / "iter_0000000"
    assert (tmp_path / "ours" / "latest").read_text() == "iter_0000000"
    assert verify_checkpoint(str(folder)) is None
    assert sorted(os.listdir(folder / "tokenizer")) == sorted(convert.TOKENIZER_FILES)
    meta = read_meta(str(folder))
    assert meta["deepspeed_state"] is False and meta["iteration"] == 0
    assert meta["tensor_model_parallel_size"] == 2 and meta["pipeline_model_parallel_size"] == 2
    # the layout matches what training saves: embedding only in pp000, layers 0-1 / 2-3 per stage
    stage1 = torch.load(folder / "model_tp01_pp001.pt", weights_only=True)
    assert "final_layernorm.weight" in stage1["weights"] and "layers.2.input_layernorm.weight" in stage1["weights"]
    assert not any(n.startswith(("embedding.", "layers.0.", "layers.1.")) for n in stage1["weights"])
    assert stage1["weights"]["layers.2.self_attention.query_key_value.weight"].shape == (96, 64)

    tool(capsys, "merge_mp_partitions", ["--model-path", tmp_path / "ours", "--output-path", tmp_path / "back",
                                              "--max-shard-size", "300KB"])
    original = load_file(tmp_path / "hf" / "model.safetensors")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded past --max-shard-size
    back = {}
    for file in set(index["weight_map"].values()):
        back.update(load_file(tmp_path / "back" / file))
    original.pop("lm_head.weight", None)
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    reloaded = BloomForCausalLM.from_pretrained(tmp_path / "back")
    assert torch.equal(reloaded.lm_head.weight, original["transformer.word_embeddings.weight"])


def test_reshard_tp2_to_tp1_resumes_with_the_same_loss(tp2pp2, sample_data, tmp_path, capsys):
    uninterrupted = read_losses(tp2pp2 / "metrics.jsonl")
    source = tp2pp2 / "iter_0000004"
    tool(capsys, "merge_mp_partitions", ["--model-path", source, "--output-format", "megatron",
                                              "--target-tensor-parallel-size", "1", "--output-path", tmp_path / "tp1"])
    folder = tmp_path / "tp1" / "iter_0000004"
    meta = read_meta(str(folder))
    assert meta["consumed_samples"] == 16 and meta["deepspeed_state"] is False
    assert verify_checkpoint(str(folder)) is None
    assert json.loads((folder / "config.json").read_text())["model"]["tensor_model_parallel_size"] == 1
    # same weights after the round trip through TP 1
    a = convert.load_merged_checkpoint(str(source)).weights
    b = convert.load_merged_checkpoint(str(tmp_path / "tp1")).weights
    assert all(torch.equal(a[n], b[n]) for n in a)

    resume = TRAIN + ["--train-iters", "5", "--data-path", sample_data]
    tp1_run = run_pretrain(resume + ["--load", str(tmp_path / "tp1"), "--metrics-file", str(tmp_path / "tp1.jsonl")],
                           nproc=1)
    assert "keeping the checkpoint's padded vocabulary of 8192" in tp1_run.stderr
    run_pretrain(resume + TP2PP2 + ["--load", str(source), "--metrics-file", str(tmp_path / "tp2.jsonl")], nproc=4)
    tp1, tp2 = read_losses(tmp_path / "tp1.jsonl"), read_losses(tmp_path / "tp2.jsonl")
    assert min(tp1) == min(tp2) == 5
    assert abs(tp1[5] - tp2[5]) < 1e-5, (tp1, tp2)
    assert abs(tp2[5] - uninterrupted[5]) < 1e-5, (tp2, uninterrupted)


def test_megatron_output_named_like_a_checkpoint_and_tp2pp2_reshard(tp2pp2, tmp_path):
    out = tmp_path / "iter_0000005"
    merge = load_tool("merge_mp_partitions")
    assert merge.main(["--model-path", str(tp2pp2), "--output-format", "megatron", "--target-tensor-parallel-size",
                       "4", "--target-pipeline-parallel-size", "2", "--dtype", "bf16", "--output-path", str(out)]) == 0
    assert not (tmp_path / "latest").exists() and (out / "model_tp03_pp001.pt").is_file()
    merged = convert.load_merged_checkpoint(str(out), num_partitions=4)
    original = convert.load_merged_checkpoint(str(tp2pp2)).weights
    assert merged.dtype == torch.bfloat16 and merged.iteration == 5
    assert all(torch.equal(merged.weights[n], original[n].to(torch.bfloat16)) for n in original)


@pytest.mark.parametrize("tp, pp, dtype", [(1, 1, "fp32"), (4, 2, "fp16"), (2, 4, "bf16")])
def test_split_then_merge_gives_the_same_tensors(tp, pp, dtype, tmp_path):
    """No training: random full weights -> write_megatron_checkpoint (TP x PP) -> load_merged_checkpoint."""
    from megatron.config import ModelConfig
    from megatron.model import BloomModel

    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=16)
    torch_dtype = convert.DTYPES[dtype]
    weights = convert.cast_weights(BloomModel(config).state_dict(), torch_dtype)
    folder = convert.write_megatron_checkpoint(str(tmp_path / "out"), weights, config, tp, pp,
                                                        iteration=7, precision=dtype)
    assert sorted(n for n in os.listdir(folder) if n.startswith("model_")) == sorted(
        shard_name(t, p) for t in range(tp) for p in range(pp))
    merged = convert.load_merged_checkpoint(str(tmp_path / "out"), num_partitions=tp)
    assert merged.iteration == 7 and merged.dtype == torch_dtype and merged.tokenizer_dir is None
    assert sorted(merged.weights) == sorted(weights)
    assert all(torch.equal(merged.weights[n], weights[n]) for n in weights)


def test_parse_size():
    assert hf.parse_size("5GB") == 5 * 10 ** 9
    assert hf.parse_size("2GiB") == 2 * 2 ** 30
    assert hf.parse_size("300kb") == 300_000
    assert hf.parse_size("1234") == 1234
    with pytest.raises(ValueError, match="--max-shard-size"):
        hf.parse_size("five gigs")


# ---------------------------------------------------------------- bad input


@pytest.fixture
def small_copy(tp2pp2, tmp_path):
    """iter_0000004's shards, meta, config and tokenizer (no engine files), with a fresh manifest."""
    src, dst = tp2pp2 / "iter_0000004", tmp_path / "iter_0000004"
    dst.mkdir()
    for name in os.listdir(src):
        if name.startswith("model_tp") or name in ("meta.json", "config.json"):
            shutil.copy(src / name, dst / name)
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    write_manifest(str(dst), 4)
    return dst


def run_merge_expecting_error(capsys, args, *fragments):
    out = os.path.join(os.path.dirname(str(args[1])), "merged_out")
    code = load_tool("merge_mp_partitions").main([str(a) for a in args] + ["--output-path", out])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert not os.path.exists(out) and not glob.glob(os.path.join(os.path.dirname(out), ".merged_out.tmp*"))
    return err


def test_missing_shard(small_copy, capsys):
    os.remove(small_copy / "model_tp01_pp001.pt")
    run_merge_expecting_error(capsys, ["--model-path", small_copy], "model_tp01_pp001.pt is missing")


def test_wrong_num_partitions(small_copy, capsys):
    run_merge_expecting_error(capsys, ["--model-path", small_copy, "--num-partitions", "4"],
                              "--num-partitions 4", "holds 2 tensor-parallel partitions")


def test_truncated_shard_fails_the_manifest(small_copy, capsys):
    os.truncate(small_copy / "model_tp00_pp001.pt", 1000)
    run_merge_expecting_error(capsys, ["--model-path", small_copy], "model_tp00_pp001.pt has 1000 bytes",
                              "truncated")


def test_corrupt_byte_fails_the_checksum(small_copy, capsys):
    path = small_copy / "model_tp01_pp000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    run_merge_expecting_error(capsys, ["--model-path", small_copy], "model_tp01_pp000.pt does not match its checksum")


def test_foreign_file_named_like_a_shard(small_copy, capsys):
    (small_copy / "model_tp00_pp000.pt").write_text("not a checkpoint\n")
    write_manifest(str(small_copy), 4)  # the manifest agrees: the shard reader must catch it
    run_merge_expecting_error(capsys, ["--model-path", small_copy], "model_tp00_pp000.pt is not a readable weight shard")
    torch.save({"something": torch.zeros(2)}, small_copy / "model_tp00_pp000.pt")
    run_merge_expecting_error(capsys, ["--model-path", small_copy, "--no-verify"],
                              "model_tp00_pp000.pt is not a weight shard of this project")


def test_not_a_checkpoint_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    run_merge_expecting_error(capsys, ["--model-path", tmp_path / "empty"], "no `latest` file")
    run_merge_expecting_error(capsys, ["--model-path", tmp_path / "nowhere"], "no such folder")


def test_existing_output_needs_force(small_copy, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    merge = load_tool("merge_mp_partitions")
    assert merge.main(["--model-path", str(small_copy), "--output-path", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--output-path" in err and "already exists" in err and "--force" in err
    assert (out / "keep.txt").exists()
    assert merge.main(["--model-path", str(small_copy), "--output-path", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_failure_while_writing_leaves_nothing(small_copy, tmp_path, capsys, monkeypatch):
    """The disk fills up after the first tensor of the safetensors file: one error line, nothing left behind."""
    write = hf.SafetensorsWriter.write

    def fills_up(self, block):
        if self.index > 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, block)

    monkeypatch.setattr(hf.SafetensorsWriter, "write", fills_up)
    out = tmp_path / "half"
    assert load_tool("merge_mp_partitions").main(["--model-path", str(small_copy), "--output-path", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --output-path {out}: writing failed ([Errno 28] No space left on device); check the free "
                   "space and permissions there or choose another folder"), err
    assert not out.exists() and not glob.glob(str(tmp_path / ".half.tmp*"))


def test_bad_target_layout(small_copy, capsys):
    run_merge_expecting_error(capsys, ["--model-path", small_copy, "--output-format", "megatron",
                                       "--target-tensor-parallel-size", "3"], "--target-tensor-parallel-size 3")
    run_merge_expecting_error(capsys, ["--model-path", small_copy, "--output-format", "megatron",
                                       "--target-pipeline-parallel-size", "8"], "--target-pipeline-parallel-size 8")


def test_cli_prints_one_line_and_exits_nonzero(small_copy, tmp_path):
    proc = run_tool("tools/merge_mp_partitions.py", ["--model-path", small_copy, "--num-partitions", "8",
                                                     "--output-path", tmp_path / "o"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --num-partitions 8")


def test_convert_bad_input(tmp_path, capsys):
    convert = load_tool("convert_hf_to_megatron")
    (tmp_path / "notbloom").mkdir()
    (tmp_path / "notbloom" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for folder, fragment in ((tmp_path / "nowhere", "no such folder"),
                             (tmp_path / "notbloom", "is not a BLOOM config")):
        assert convert.main(["--hf-model-path", str(folder), "--output-path", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "o").exists()


def test_generate_bad_input(small_copy, capsys):
    generate = load_tool("generate_text")
    assert generate.main(["--load", str(small_copy), "--num-partitions", "8", "--prompt", "x"]) == 2
    assert "error: --num-partitions 8" in capsys.readouterr().err
    assert generate.main(["--load", str(small_copy)]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert generate.main(["--load", str(small_copy), "--prompt", "x", "--temperature", "0"]) == 2
    assert "--temperature 0" in capsys.readouterr().err


def test_output_that_holds_the_input_is_refused(small_copy, capsys):
    merge = load_tool("merge_mp_partitions")
    assert merge.main(["--model-path", str(small_copy), "--output-path", str(small_copy.parent), "--force"]) == 2
    assert "would delete the input" in capsys.readouterr().err
    assert (small_copy / "model_tp00_pp000.pt").is_file()
