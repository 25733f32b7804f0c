"""What pretrain_bloom.py says about memory before it builds the model, and what it adds to the out-of-memory hint:
the predicted per-GPU peak of its layout and, when that exceeds the device, the planner's best layout that fits."""
import logging

from megatron.planning import memory, planner

logger = logging.getLogger("megatron.planning")


def predicted_memory_line(config, cuda, ds_config=None):
    """One line: the predicted peak per GPU of the fullest pipeline stage, with its parts."""
    par, training = config.parallel, config.training
    stages = memory.layout_memory(
        config.model, par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size,
        training.micro_batch_size, training.gradient_accumulation_steps, config.precision.name, training.zero_stage,
        config.model.checkpoint_activations, training.cpu_offload, cuda=True,
        buckets=memory.zero_buckets(ds_config))
    worst = max(stages, key=lambda stage: stage.peak)
    st = worst.states
    where = f" (pipeline stage {worst.stage} of {len(stages)})" if len(stages) > 1 else ""
    return (f"predicted peak memory per GPU{where}: {worst.peak / memory.GIB:.2f} GiB = weights "
            f"{st.weights / memory.GIB:.2f} + gradients {max(st.gradients, st.accumulating_gradients) / memory.GIB:.2f}"
            f" + optimizer {st.optimizer / memory.GIB:.2f} + activations and logits {worst.activations / memory.GIB:.2f}"
            f" + buffers {(st.comm_buffers + worst.transient) / memory.GIB:.2f} at most (on CUDA: FlexAttention, "
            f"the fused loss{'' if cuda else '; this run is on the CPU'}); tools/plan_layout.py compares layouts"), worst.peak


def suggestion(config, device_bytes, ds_config=None, device_name=None):
    """'--flags ... (predicted X GiB, Y tokens/s relative)': the planner's fastest layout that fits, or a
    sentence saying none does."""
    best = planner.best_fitting(config, device_bytes, ds_config=ds_config, device_name=device_name)
    if best is None:
        return (f"no layout of {config.parallel.world_size} GPUs fits this model and batch in "
                f"{device_bytes / memory.GIB:.1f} GiB per GPU by the planner's prediction: use more GPUs or a "
                "shorter --seq-length")
    return (f"the planner's best layout that fits is {best.layout.flags()} (predicted "
            f"{best.peak / memory.GIB:.1f} GiB per GPU); see tools/plan_layout.py")


def check_before_build(config, ds_config, state, cuda):
    """Rank 0 logs the predicted peak (on the CPU only at debug level: it is a GPU figure); on CUDA, when it
    exceeds the device's memory, one warning with the planner's suggestion. Returns the predicted peak in bytes."""
    line, peak = predicted_memory_line(config, cuda, ds_config)
    if state.rank != 0:
        return peak
    logger.log(logging.INFO if cuda else logging.DEBUG, "%s", line)
    if cuda:
        import torch
        prop = torch.cuda.get_device_properties(torch.cuda.current_device())
        if peak > prop.total_memory:
            logger.warning("the predicted peak memory per GPU, %.2f GiB, exceeds this GPU's %.2f GiB: %s",
                           peak / memory.GIB, prop.total_memory / memory.GIB,
                           suggestion(config, prop.total_memory, ds_config, prop.name))
    return peak


def oom_suggestion(config):
    """The sentence the out-of-memory hint adds (needs CUDA: the device's memory)."""
    import torch
    try:
        prop = torch.cuda.get_device_properties(torch.cuda.current_device())
    except (RuntimeError, AssertionError):
        return ""
    return "; " + suggestion(config, prop.total_memory, device_name=prop.name)
