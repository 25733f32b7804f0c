"""Resuming training from an upstream Megatron-DeepSpeed checkpoint (megatron/checkpoint/upstream.py) on any layout.

Each rank reads its own TP slice of its stage's weights from the upstream layer files (mapped, a tensor at a time),
then, where the checkpoint names its optimizer state per parameter (ZeRO's param_slice_mappings, or a universal
checkpoint), the fp32 master weights and Adam's moments through optimizer_state.restore_from_parameters, the same
path a layout change of this project's own checkpoints takes; the iteration, consumed samples, step counters and
LR schedule position come from mp_rank_00_model_states.pt. The RNG states are not carried (upstream's belong to
its ranks and its generator layout). Without per-parameter optimizer state the weights load and the optimizer
restarts, with one warning saying so.
"""
import logging

import torch.distributed as dist

from megatron.checkpoint import optimizer_state
from megatron.checkpoint.convert import read_shard_for, stage_names
from megatron.checkpoint.format import CheckpointError
from megatron.upstream_compat import pipeline_partition_method

logger = logging.getLogger(__name__)
_SHAPE_FLAGS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                ("num_attention_heads", "--num-attention-heads"), ("ffn_dim", "--ffn-hidden-size"),
                ("vocab_size", "padded vocabulary (--pad-vocab-size-to)"), ("embed_layernorm", "--embed-layernorm"))


def _rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def check_model(checkpoint, model_config, flag="--load"):
    """CheckpointError naming the first flag whose value differs from the upstream checkpoint's model."""
    for field, name in _SHAPE_FLAGS:
        saved, ours = getattr(checkpoint.config, field), getattr(model_config, field)
        if saved != ours:
            raise CheckpointError(f"{flag} {checkpoint.folder}: the checkpoint's model has {name} {saved}, this run "
                                  f"{ours}; pass {name.split(' ')[-1].strip('()')} {saved}")


def schedule_position(checkpoint, sample_based):
    """The LR scheduler's num_steps to continue from: the saved scheduler's position (iterations, or samples for
    upstream's sample-based schedule), else the iteration or consumed samples."""
    saved = checkpoint.lr_scheduler
    if isinstance(saved, dict) and saved.get("num_steps") is not None:
        return int(saved["num_steps"])
    return checkpoint.consumed_samples if sample_based else checkpoint.iteration


def resume(engine, config, state, folder):
    """Loads the upstream checkpoint in `folder` into this rank's engine; returns (iteration, consumed samples)."""
    from megatron.checkpoint.upstream import UpstreamCheckpoint
    from megatron.model.pipeline import load_canonical_state_dict
    ckpt = config.checkpoint
    checkpoint = UpstreamCheckpoint(folder)
    try:
        check_model(checkpoint, config.model)
        tp, pp = state.tensor_model_parallel_size, state.pipeline_model_parallel_size
        stages = stage_names(config.model, tp, pp, "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                             pipeline_partition_method(config.upstream.pp_partition_method))  # as engine.py builds
        names = list(dict.fromkeys(stages[0] + stages[state.pp_rank]))  # the tied embedding lives on stage 0's list
        weights = read_shard_for(checkpoint, names, state.tp_rank, tp)["weights"]
        if config.training.zero_stage == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
                load_canonical_state_dict(engine.module, weights, config.model.num_layers)
        else:
            load_canonical_state_dict(engine.module, weights, config.model.num_layers)
        del weights
        source = None if ckpt.no_load_optim or ckpt.finetune else checkpoint.optimizer()
        if source is None:
            optimizer_state.refresh_master_weights(engine)
        else:
            try:
                optimizer_state.restore_from_parameters(engine, source, config.model.num_layers, state.pp_rank, tp,
                                                        state.tp_rank)
            except ValueError as err:
                raise CheckpointError(f"--load {folder}: {err}; pass --no-load-optim to start the optimizer afresh "
                                      "from the weights") from None
    finally:
        checkpoint.close()
    what = "upstream Megatron-DeepSpeed"
    if ckpt.finetune:
        if _rank0():
            logger.info("loaded the weights of %s checkpoint %s for fine-tuning (iteration and optimizer restart)",
                        what, folder)
        return 0, 0
    sample_based = config.upstream.sample_based_schedule
    optimizer_state.restore_counters(engine, {
        "global_steps": checkpoint.global_steps, "global_samples": checkpoint.consumed_samples,
        "skipped_steps": checkpoint.skipped_steps,
        "lr_scheduler": None if ckpt.no_load_optim else {"num_steps": schedule_position(checkpoint, sample_based)}})
    if _rank0():
        if source is None and not ckpt.no_load_optim:
            logger.warning("--load %s: an %s checkpoint without per-parameter optimizer state (no ZeRO files with "
                           "param_slice_mappings): the weights, iteration %d and data position load, the optimizer "
                           "restarts", folder, what, checkpoint.iteration)
        logger.info("resumed from %s checkpoint %s (TP %d, PP %d) at iteration %d, %d consumed samples%s; the RNG "
                    "states restart", what, folder, checkpoint.tensor_model_parallel_size,
                    checkpoint.pipeline_model_parallel_size, checkpoint.iteration, checkpoint.consumed_samples,
                    ", with its optimizer state" if source is not None else "")
    return checkpoint.iteration, checkpoint.consumed_samples
