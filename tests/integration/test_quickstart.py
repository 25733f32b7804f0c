"""The README's main job (examples/quickstart.sh) end to end, with fewer iterations: preprocess, evaluate the
untrained model, train, save, export, sample. One run serves every check, the file modes of its outputs included."""
import json
import os
import re
import stat
import subprocess

from transformers import BloomForCausalLM

from tests.launch import ROOT, _cleanup_shm, _free_port, env

ITERS = 20


def test_quickstart(tmp_path):
    work = tmp_path / "quickstart"
    port = _free_port()
    try:
        proc = subprocess.run(["bash", str(ROOT / "examples" / "quickstart.sh")], cwd=ROOT, capture_output=True,
                              text=True, timeout=900, preexec_fn=lambda: os.umask(0o022),
                              env=env({"QUICKSTART_ITERS": str(ITERS), "WORK": str(work), "MASTER_PORT": str(port)}))
    finally:
        _cleanup_shm(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    # Visible proof of learning: perplexity before and after (the same validation samples), read back exactly.
    summary = re.search(r"^validation perplexity: ([0-9.]+) untrained -> ([0-9.]+) after (\d+) iterations$",
                        proc.stdout, re.M)
    assert summary, proc.stdout[-3000:]
    before, after = float(summary.group(1)), float(summary.group(2))
    records = {name: [json.loads(line) for line in open(work / name / "metrics.jsonl")]
               for name in ("untrained", "tensorboard")}
    valid = {name: [r for r in rs if r["kind"] == "valid"] for name, rs in records.items()}
    assert [r["iteration"] for r in valid["untrained"]] == [1]
    assert [r["iteration"] for r in valid["tensorboard"]] == [6, 12, 18, 20]
    assert (before, after) == (round(valid["untrained"][0]["ppl"], 1), round(valid["tensorboard"][-1]["ppl"], 1))
    assert records["untrained"][0]["lr"] == 0.0  # the untrained run changed no weight
    assert int(summary.group(3)) == ITERS and after < before / 3, (before, after)
    train = [r["lm_loss"] for r in records["tensorboard"] if r["kind"] == "train"]
    assert len(train) == 10 and train[-1] < train[0]

    # Sampled continuations were printed for both prompts, and the exported model loads.
    continuations = re.findall(r"^--- continuation \((\d+) tokens[^\n]*---\n(.*?)(?=\n--- prompt|\ngenerated )",
                               proc.stdout, re.M | re.S)
    assert len(continuations) == 2 and all(int(n) > 0 and re.search(r"[A-Za-z]{2}", text)
                                           for n, text in continuations), proc.stdout[-3000:]
    assert (work / "metrics.png").is_file()
    model = BloomForCausalLM.from_pretrained(work / "hf_model")
    assert model.config.n_layer == 4 and model.config.hidden_size == 128

    # Every output (preprocessed data, index caches, checkpoint, merged folder, tokenizer files, metrics) has the
    # mode umask 022 gives: safetensors writes a 0600 temporary that merge_mp_partitions must widen.
    modes = {str(path.relative_to(work)): stat.S_IMODE(path.stat().st_mode) for path in work.rglob("*")}
    assert "hf_model/model.safetensors" in modes and "checkpoints/latest" in modes
    assert any(name.endswith(".idx") for name in modes) and any("_indexmap_" in name for name in modes)
    assert any(name.startswith("checkpoints/iter_0000020/tokenizer/") for name in modes)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != (0o755 if (work / name).is_dir() else 0o644)}
    assert wrong == {}
