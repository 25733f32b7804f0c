"""The README's main job (examples/quickstart.sh) runs end to end: preprocess, train, save, export, generate."""
import json
import subprocess

from transformers import BloomForCausalLM

from tests.launch import ROOT, env


def test_quickstart(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "examples" / "quickstart.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=env({"QUICKSTART_ITERS": "20", "WORK": str(tmp_path)}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "generated 40 tokens" in proc.stdout
    assert (tmp_path / "metrics.png").is_file()
    model = BloomForCausalLM.from_pretrained(tmp_path / "hf_model")
    assert model.config.n_layer == 4 and model.config.hidden_size == 128
    losses = [json.loads(line)["lm_loss"] for line in open(tmp_path / "tensorboard" / "metrics.jsonl")
              if json.loads(line)["kind"] == "train"]
    assert losses[-1] < losses[0]
