"""DeepSpeed engine set-up: the model (BloomModel, or a PipelineModule for PP > 1), its parameter groups, the
optimizer and LR schedule, all handed to deepspeed.initialize."""
import logging

import torch

from megatron.checkpoint.adapters import adapter_for
from megatron.optimizer import AnnealingLR, build_optimizer, get_param_groups

logger = logging.getLogger("megatron.training")


def build_model(config, state):
    """BloomModel for PP = 1, a PipelineModule over DeepSpeed's topology for PP > 1."""
    if state.pipeline_model_parallel_size == 1:
        from megatron.model import BloomModel
        return BloomModel(config.model, tp_group=state.tp_group)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron.model.pipeline import build_pipeline_model
    topology = PipeModelDataParallelTopology(num_pp=state.pipeline_model_parallel_size,
                                             num_mp=state.tensor_model_parallel_size,
                                             num_dp=state.data_parallel_size)
    with torch.no_grad():  # PipelineModule broadcasts the tied embedding; with grad on, torch warns at backward
        from megatron.upstream_compat import pipeline_partition_method
        return build_pipeline_model(config.model, topology, config.model.checkpoint_activations,
                                    tp_group=state.tp_group,
                                    partition_method=pipeline_partition_method(config.upstream.pp_partition_method))


def _with_bf16_overflow_check(ds_config):
    """DeepSpeed's ZeRO optimizers skip a bf16 step with a non-finite gradient only with check_grad_overflow."""
    if not ds_config.get("bf16", {}).get("enabled"):
        return ds_config
    ds_config = {**ds_config, "bf16": {"check_grad_overflow": True, **ds_config["bf16"]}}
    if not ds_config["bf16"]["check_grad_overflow"]:
        logger.warning("DeepSpeed config bf16.check_grad_overflow is false: with ZeRO a non-finite gradient "
                       "is applied to the weights instead of skipped")
    return ds_config


def _throughput_timer_unsynchronized(ds_config):
    """DeepSpeed's throughput timer synchronizes the device in every micro batch's engine.forward and engine.step()
    (timers.throughput.synchronized, on by default; it times micro batches when no training_data was handed to
    deepspeed.initialize, as here): two host syncs per micro batch that drain the launch queue. Our log line times
    the iterations itself, so the timer runs unsynchronized unless the JSON sets the key."""
    timers = ds_config.get("timers", {})
    throughput = timers.get("throughput", {})
    if "synchronized" in throughput:
        return ds_config
    return {**ds_config, "timers": {**timers, "throughput": {**throughput, "synchronized": False}}}


def skip_identity_allreduce(engine):
    """Turns off DeepSpeed's backward gradient all-reduce where it is an identity: one data-parallel rank (the
    sequence-data-parallel group DeepSpeed reduces over has one member), no ZeRO partitioning, no MoE and no
    pipeline engine (which reduces in its own schedule). There DeepSpeed 0.19.8 still flattens every gradient into
    500M-element buckets, launches the collective and copies each bucket back into the gradients (on the H200 a
    cat, ~300 device-to-device copies and the idle time around them, every step) to leave the same values.
    Returns whether it was turned off."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    if (engine.pipeline_parallelism or engine.zero_optimization_stage() != 0 or engine.has_moe_layers
            or not engine.enable_backward_allreduce
            or dist.get_world_size(group=groups._get_sequence_data_parallel_group()) != 1):
        return False
    engine.enable_backward_allreduce = False
    return True


def setup_engine(config, ds_config, state):
    """(engine, lr_scheduler): our model, param groups, optimizer and schedule inside deepspeed.initialize."""
    import deepspeed
    from megatron.core.parallel_state import DeepSpeedMPU

    if config.training.partition_activations:
        from megatron.core.tensor_parallel.random import use_deepspeed_checkpointing
        from megatron.initialize import set_random_seeds
        deepspeed.checkpointing.configure(DeepSpeedMPU(), partition_activations=True)
        use_deepspeed_checkpointing()
        set_random_seeds(config.model.seed, state)  # seeds DeepSpeed's tracker, now ours
        logger.info("activation checkpointing: DeepSpeed's, saved activations partitioned across TP ranks")
    model = build_model(config, state)
    opt = config.optimizer
    optimizer = build_optimizer(get_param_groups(model, opt.weight_decay), opt, config.training.cpu_offload)
    from megatron.upstream_compat import schedule_lengths
    warmup, decay, unit = schedule_lengths(config.upstream, opt, config.training)
    rampup = config.upstream.rampup_batch_size
    increment = 1 if unit == "iterations" else (rampup[0] if rampup else config.training.global_batch_size)
    scheduler = AnnealingLR(optimizer, opt.lr, opt.min_lr, warmup, decay, opt.lr_decay_style, increment=increment,
                            use_checkpoint_schedule=config.upstream.use_checkpoint_lr_scheduler)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=_throughput_timer_unsynchronized(_with_bf16_overflow_check(ds_config)),
        mpu=DeepSpeedMPU() if state.pipeline_model_parallel_size == 1 else None, dist_init_required=False)
    skip_identity_allreduce(engine)
    adapter_for(engine)  # the wrapper's adapter; the unfused one makes DeepSpeed report the true gradient norm
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters on this rank (%d in the whole model), %s, ZeRO %d", n_params,
                config.model.num_parameters(), config.precision.name, config.training.zero_stage)
    return engine, scheduler
