"""This rank's part of a model for evaluation: a checkpoint of any TP x PP layout or an HF folder, read per rank.

Each rank reads only its tensor-parallel slice of its pipeline stage's tensors (plus the word embeddings on the last
stage, for the tied LM head) from the mapped files: no merged copy, on disk or in memory. PP 1 builds a BloomModel
(generation then runs on the InferenceEngine); PP > 1 an EvalStage per rank.
"""
import dataclasses
import os

import torch

from megatron.checkpoint.convert import CheckpointReader, read_shard_for, stage_names
from megatron.checkpoint.hf import HFReader, is_hf_folder
from megatron.core import parallel_state
from megatron.inference.scoring import EvalStage, Scorer
from megatron.tokenizer import build_tokenizer


def open_reader(path, num_partitions=None, flag="--load"):
    """A lazy reader of --load: our checkpoint (folder or save root) or a Hugging Face BLOOM folder."""
    if os.path.isdir(path) and is_hf_folder(path):
        return HFReader(path, flag)
    return CheckpointReader(path, num_partitions, flag)


def layout_for(reader, world_size, tp=None, pp=None):
    """(TP, PP) to evaluate on: the flags, else the checkpoint's own layout when the world holds it (an HF folder:
    TP = world, PP 1). ValueError names the flags when the world does not fit."""
    saved_tp = getattr(reader, "tensor_model_parallel_size", None)
    saved_pp = getattr(reader, "pipeline_model_parallel_size", None)
    if tp is None and pp is None and saved_tp and world_size % (saved_tp * saved_pp) == 0:
        tp, pp = saved_tp, saved_pp
    tp, pp = tp or (world_size // (pp or 1)), pp or 1
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not divide "
                         f"the {world_size} processes launched; launch a multiple of TP x PP processes "
                         "(torchrun --nproc_per_node) or pick other sizes")
    return tp, pp


def load_tokenizer(reader, tokenizer_dir=None, flag="--load"):
    tokenizer_dir = tokenizer_dir or reader.tokenizer_dir
    if tokenizer_dir is None:
        raise ValueError(f"{flag} {reader.folder} has no tokenizer; pass --tokenizer-name-or-path FOLDER")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    if tokenizer.vocab_size > reader.config.vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's "
                         f"vocabulary holds {reader.config.vocab_size}; pass the tokenizer it was trained with")
    return tokenizer


def build_rank_model(reader, state, dtype, device):
    """(module, scorer) of this rank: a BloomModel (PP 1) or an EvalStage (PP > 1), holding only the rank's slice."""
    from megatron.model.bloom import BloomModel

    tp, pp = state.tensor_model_parallel_size, state.pipeline_model_parallel_size
    config = dataclasses.replace(reader.config, tensor_model_parallel_size=tp, attention_impl="sdpa",
                                 hidden_dropout=0.0, attention_dropout=0.0)
    stages = stage_names(reader.config, tp, pp, tp_flag="--tensor-model-parallel-size",
                         pp_flag="--pipeline-model-parallel-size")
    names = list(stages[state.pp_rank])
    first, last = state.pp_rank == 0, state.pp_rank == pp - 1
    if last and not first:
        names = [n for n in stages[0] if n.startswith("embedding.word_embeddings.weight")] + names
    weights = read_shard_for(reader, names, state.tp_rank, tp, dtype)["weights"]
    with torch.random.fork_rng(devices=[]):
        if pp == 1:
            module = BloomModel(config, parallel_output=False, tp_group=state.tp_group)
        else:
            layer_ids = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
            module = EvalStage(config, layer_ids, first, last, tp_group=state.tp_group)
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [n for n in missing if not (last and not first and n.startswith("embedding.word_embeddings_layernorm"))]
    if missing or unexpected:
        raise RuntimeError(f"{reader.folder}: stage {state.pp_rank} lacks {missing[:3]} or has extra {unexpected[:3]}")
    module = module.to(device=device, dtype=dtype).eval()
    vocab_limit = None  # set by the caller from its tokenizer
    if pp == 1:
        return module, Scorer.for_bloom_model(module, vocab_limit, state)
    return module, Scorer.for_stage(module, state, vocab_limit)


def setup_parallel(tp, pp):
    """The ParallelState of this process: torch.distributed over the torchrun world when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return parallel_state.ParallelState()
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return parallel_state.initialize_model_parallel(tp, pp)


def build_lm(load, world_size=1, batch_size=16, tokenizer_dir=None, dtype_flag="auto", max_length=None, tp=None,
             pp=None, seed=1234, max_batch_tokens=8192):
    """(MegatronLM, ParallelState) of --load on this rank (tools/evaluate.py's flags, as values)."""
    from megatron.checkpoint.convert import DTYPES
    from megatron.evaluation.harness import MegatronLM

    reader = open_reader(load)
    try:
        tokenizer = load_tokenizer(reader, tokenizer_dir)
        tp, pp = layout_for(reader, world_size, tp, pp)
        state = setup_parallel(tp, pp)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = DTYPES[dtype_flag] if dtype_flag != "auto" else (reader.dtype if device == "cuda" else torch.float32)
        module, scorer = build_rank_model(reader, state, dtype, device)
    finally:
        reader.close()
    scorer.vocab_limit = tokenizer.vocab_size
    lm = MegatronLM(scorer, tokenizer, max_length or reader.config.seq_length, batch_size,
                    model=module if pp == 1 else None, state=state, seed=seed, max_batch_tokens=max_batch_tokens)
    return lm, state
