"""The exported Hugging Face folder carries the trained sequence length as the tokenizer's model_max_length and a
model card written from the checkpoint (megatron/checkpoint/model_card.py)."""
import dataclasses
import json
import types

import torch

from megatron.arguments import load_and_resolve
from megatron.checkpoint import hf
from megatron.checkpoint.model_card import UNSET_MODEL_MAX_LENGTH
from megatron.model.bloom import BloomModel
from tests.launch import TOKENIZER


def test_hf_folder_gets_model_max_length_and_a_model_card(tmp_path):
    config, _, _ = load_and_resolve(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "48",
         "--max-position-embeddings", "48", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "30", "--lr", "3e-4", "--min-lr", "3e-5", "--bf16", "--mock-data",
         "--tokenizer-name-or-path", str(TOKENIZER)], world_size=2)
    weights = {name: t.clone() for name, t in BloomModel(config.model).state_dict().items()}
    save = tmp_path / "save"
    (save / "iter_0000020").mkdir(parents=True)
    lines = [{"kind": "train", "iteration": 10, "lm_loss": 7.5}, {"kind": "valid", "iteration": 10, "lm_loss": 7.25,
                                                                   "ppl": 1408.1},
             {"kind": "train", "iteration": 20, "lm_loss": 6.123456}, {"kind": "valid", "iteration": 20,
                                                                        "lm_loss": 6.5, "ppl": 665.14},
             {"kind": "train", "iteration": 30, "lm_loss": 1.0}]  # after the checkpoint: not its metrics
    (save / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = types.SimpleNamespace(run_config=json.loads(json.dumps(dataclasses.asdict(config))), iteration=20,
                                   consumed_samples=80, folder=str(save / "iter_0000020"))
    assert json.loads((TOKENIZER / "tokenizer_config.json").read_text())["model_max_length"] == UNSET_MODEL_MAX_LENGTH
    out = hf.write_hf_folder(str(tmp_path / "hf"), weights, config.model, torch.bfloat16, str(TOKENIZER),
                             source=source)

    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(out).model_max_length == 48
    card = (tmp_path / "hf" / "README.md").read_text()
    parameters = sum(t.numel() for t in weights.values())
    for row in (f"| parameters | {parameters:,} ({parameters / 1e6:.1f}M, LM head tied to the embedding) |",
                "| layers | 2 |", "| hidden size | 32 |", "| attention heads | 4 |", "| FFN size | 128 |",
                "| vocabulary (padded) | 8064 |", "| trained sequence length | 48 (the tokenizer's model_max_length) |",
                "| weights dtype | bf16 |", f"| tokenizer | `{TOKENIZER}` |", "| consumed samples | 80 |",
                "| consumed tokens | 3,840 |", "| iteration | 20 |", "| --train-iters | 30 |",
                "| --global-batch-size | 4 |", "| --lr | 0.0003 |", "| --min-lr | 3e-05 |",
                "| --tensor-model-parallel-size | 1 |", "| processes | 2 |", "| precision | bf16 |",
                "| training LM loss (iteration 20) | 6.1235 |", "| validation LM loss (iteration 20) | 6.5000 |",
                "| validation perplexity (iteration 20) | 665.14 |"):
        assert row in card.splitlines(), row
    assert card.startswith("---\nlibrary_name: transformers\n")
    bare = hf.write_hf_folder(str(tmp_path / "bare"), weights, config.model, torch.float32)  # no source, no tokenizer
    assert "| metrics | no metrics.jsonl was found beside the checkpoint |" in open(bare + "/README.md").read()
