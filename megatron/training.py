"""The train/eval loop on DeepSpeed: engine set-up, iterations, evaluation, logging, checkpoints, exits.

Fault handling (docs/FAULTS.md): SIGTERM/SIGINT and the exit flags save at an iteration boundary and return;
a non-finite loss or gradient norm skips that iteration's update (NonFiniteGuard) and --max-nan-iterations in a
row stop the run (NonFiniteError) without saving; TestFaults injects faults in tests (MEGATRON_TEST_FAULT).
"""
import json
import logging
import math
import os
import signal
import time

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.core import parallel_state
from megatron.fault_injection import TestFaults
from megatron.metrics import format_log_line, measure_matmul_tflops, model_flops_per_iteration, peak_memory_gib
from megatron.optimizer import AnnealingLR, build_optimizer, get_param_groups

logger = logging.getLogger(__name__)

OOM_HINT = ("CUDA out of memory: lower --micro-batch-size (raise gradient accumulation through "
            "--global-batch-size to keep the batch), add --checkpoint-activations, raise --zero-stage, "
            "add --cpu-offload, or use more tensor/pipeline parallelism")


class FatalTrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to change. pretrain_bloom.py exits 1 with it."""


class NonFiniteError(FatalTrainingError):
    """--max-nan-iterations iterations in a row had a non-finite loss or gradient norm."""


def device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_model(config, state):
    """BloomModel for PP = 1, a PipelineModule over DeepSpeed's topology for PP > 1."""
    if state.pipeline_model_parallel_size == 1:
        from megatron.model import BloomModel
        return BloomModel(config.model)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron.model.pipeline import build_pipeline_model
    topology = PipeModelDataParallelTopology(num_pp=state.pipeline_model_parallel_size,
                                             num_mp=state.tensor_model_parallel_size,
                                             num_dp=state.data_parallel_size)
    with torch.no_grad():  # PipelineModule broadcasts the tied embedding; with grad on, torch warns at backward
        return build_pipeline_model(config.model, topology, config.training.checkpoint_activations)


def setup_engine(config, ds_config, state):
    """(engine, lr_scheduler): our model, param groups, optimizer and schedule inside deepspeed.initialize."""
    import deepspeed
    from megatron.core.parallel_state import DeepSpeedMPU

    if config.training.partition_activations:
        from megatron.core.tensor_parallel.random import use_deepspeed_checkpointing
        from megatron.initialize import set_random_seeds
        deepspeed.checkpointing.configure(DeepSpeedMPU(), partition_activations=True)
        use_deepspeed_checkpointing()
        set_random_seeds(config.training.seed, state)  # seeds DeepSpeed's tracker, now ours
        logger.info("activation checkpointing: DeepSpeed's, saved activations partitioned across TP ranks")
    model = build_model(config, state)
    opt = config.optimizer
    optimizer = build_optimizer(get_param_groups(model, opt.weight_decay), opt, config.training.cpu_offload)
    scheduler = AnnealingLR(optimizer, opt.lr, opt.min_lr, opt.lr_warmup_iters, opt.lr_decay_iters,
                            opt.lr_decay_style)
    if ds_config.get("bf16", {}).get("enabled"):
        # DeepSpeed's ZeRO optimizers skip a bf16 step with a non-finite gradient only with this set
        ds_config = {**ds_config, "bf16": {"check_grad_overflow": True, **ds_config["bf16"]}}
        if not ds_config["bf16"]["check_grad_overflow"]:
            logger.warning("DeepSpeed config bf16.check_grad_overflow is false: with ZeRO a non-finite gradient "
                           "is applied to the weights instead of skipped")
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        mpu=DeepSpeedMPU() if state.pipeline_model_parallel_size == 1 else None, dist_init_required=False)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters on this rank (%d in the whole model), %s, ZeRO %d", n_params,
                config.model.num_parameters(), config.precision.name, config.training.zero_stage)
    return engine, scheduler


def _split(tokens):
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class PipeBatches:
    """Adapts {"text": (B, S+1)} batches to the (inputs, labels) pairs DeepSpeed's pipeline engine reads."""

    def __init__(self, loader_iter):
        self.it = loader_iter

    def __iter__(self):
        return self

    def __next__(self):
        return _split(next(self.it)["text"])


def _dp_mean(value):
    tensor = torch.tensor([value], dtype=torch.float64, device=device())
    group = parallel_state.get_data_parallel_group()
    if group is not None:
        dist.all_reduce(tensor, group=group)
        tensor /= parallel_state.get_data_parallel_world_size()
    return tensor.item()


def train_step(engine, data_iter, gradient_accumulation_steps, pipelined, guard=None, fire=None):
    """One optimizer step over the global batch; returns the mean LM loss (same on every rank).

    guard: NonFiniteGuard, told whether any micro batch's loss was non-finite before the boundary step.
    fire(phase): the test-only fault hook ("forward", "backward", "step").
    """
    fire = fire or (lambda phase: None)
    if pipelined:
        fire("forward")
        return engine.train_batch(data_iter=data_iter).item()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    for micro in range(gradient_accumulation_steps):
        inputs, labels = _split(next(data_iter)["text"].to(engine.device, non_blocking=True))
        fire("forward")
        loss = engine(inputs, labels=labels).mean()
        if guard is not None:
            guard.note_loss(loss)
        fire("backward")
        engine.backward(loss)
        if micro == gradient_accumulation_steps - 1:
            fire("step")
        engine.step()
        total += loss.detach()  # no host sync inside the accumulation loop
    return _dp_mean(total.item() / gradient_accumulation_steps)


@torch.no_grad()
def evaluate(engine, data_iter, eval_iters, pipelined):
    """Mean LM loss over eval_iters global batches (eval_iters micro batches per DP rank without PP)."""
    engine.eval()
    losses = []
    for _ in range(eval_iters):
        if pipelined:
            losses.append(engine.eval_batch(data_iter=data_iter).item())
        else:
            inputs, labels = _split(next(data_iter)["text"].to(engine.device))
            losses.append(engine(inputs, labels=labels).mean().item())
    engine.train()
    return _dp_mean(sum(losses) / len(losses)) if not pipelined else sum(losses) / len(losses)


class MetricsWriter:
    """Rank 0's tensorboard scalars and metrics JSON lines."""

    def __init__(self, logging_config, rank):
        self.tb = self.jsonl = None
        if rank != 0:
            return
        if logging_config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(logging_config.tensorboard_dir)
        if logging_config.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(logging_config.metrics_file)), exist_ok=True)
            self.jsonl = open(logging_config.metrics_file, "a")

    def write(self, kind, metrics):
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": kind, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            step = metrics["iteration"]
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "iteration" and value is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
            self.tb.flush()  # on disk at each log line, like the JSON lines, whatever ends the process

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


class ExitSignal:
    """Records SIGTERM/SIGINT; the loop saves at the next iteration boundary (all ranks agree via all-reduce)."""

    def __init__(self, enabled):
        self.received = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self):
        flag = torch.tensor([1.0 if self.received else 0.0], device=device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


class NonFiniteGuard:
    """Keeps the update of an iteration with a non-finite loss or gradient out of the weights (bf16, fp32).

    DeepSpeed's own optimizer wrappers (ZeRO 1-3, BF16_Optimizer, FP16_Optimizer) already skip such a step:
    they set optimizer.overflow, and the engine then counts engine.skipped_steps, zeroes the gradients and
    holds the LR schedule. The bare torch optimizer DeepSpeed uses in fp32 without ZeRO (PP = 1 and the
    PipelineEngine) checks nothing, and DeepSpeed discards the gradient norm it computes there
    (engine.get_global_grad_norm() is None). For that optimizer this class replaces
    engine.clip_fp32_gradients and wraps optimizer.step so that the norm is measured (and logged), and a
    non-finite norm or loss on any rank (one all-reduce over the world) turns the step into the same skip.

    The norm: sqrt(sum of squared gradients), each TP-replicated parameter counted once per TP group and the
    pipeline's tied word embedding once (on the first stage), summed over the TP x PP group.
    """

    def __init__(self, engine, state, clip_grad):
        self.engine, self.clip_grad = engine, clip_grad
        self.last_grad_norm = None
        self.active = isinstance(engine.optimizer, torch.optim.Optimizer)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device())
        if not self.active:
            return
        from deepspeed.runtime.utils import is_model_parallel_parameter
        self._params = list(engine.module.parameters())
        self._counted = [p for name, p in engine.module.named_parameters()
                         if (state.tp_rank == 0 or is_model_parallel_parameter(p))
                         and not (state.pp_rank > 0 and name.startswith("tied_modules."))]
        self._mpu = _ModelParallelGroup(state.mp_group) if state.mp_group is not None else None
        self._norm = None
        self._optimizer_step = engine.optimizer.step
        engine.optimizer.overflow = False
        engine.optimizer.step = self._guarded_step
        engine.clip_fp32_gradients = self._clip

    def note_loss(self, loss):
        """Records (on the device, no sync) whether a micro batch's loss was non-finite."""
        self._loss_bad |= ~torch.isfinite(loss.detach()).all()

    def grad_norm(self):
        """The gradient norm of the last step (None where DeepSpeed's optimizer keeps it instead)."""
        if self.active:
            return self.last_grad_norm
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def _measure(self):
        from deepspeed.runtime.utils import get_global_norm_of_tensors
        grads = [p.grad for p in self._counted if p.grad is not None] or [torch.zeros(1, device=device())]
        value = float(get_global_norm_of_tensors(grads, mpu=self._mpu))
        return value if math.isfinite(value) and value >= 0 else float("inf")  # DeepSpeed masks inf/nan as -1

    def _clip(self):
        """Replaces DeepSpeed's clip_fp32_gradients (which discards the norm): same clipping rule."""
        self._norm = self._measure()
        if math.isfinite(self._norm):
            coef = self.clip_grad / (self._norm + 1e-6)
            if coef < 1.0:
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(coef)

    def _guarded_step(self, *args, **kwargs):
        norm = self._measure() if self._norm is None else self._norm
        self._norm = None
        self.last_grad_norm = norm
        bad = (self._loss_bad | (not math.isfinite(norm))).to(torch.float32).reshape(1)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device())
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        optimizer = self.engine.optimizer
        optimizer.overflow = bool(bad.item() > 0)
        if optimizer.overflow:
            return None  # the engine counts a skipped step, zeroes the gradients, holds the LR schedule
        return self._optimizer_step(*args, **kwargs)


class _ModelParallelGroup:
    """The `mpu` deepspeed.runtime.utils' norm helpers read: sums over our TP x PP group."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


def _loss_scale(engine):
    optimizer = getattr(engine, "optimizer", None)
    scale = getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)
    return float(scale) if isinstance(scale, (int, float)) and engine.fp16_enabled() else None


def _peak_tflops(config):
    if config.logging.peak_tflops:
        return config.logging.peak_tflops
    return measure_matmul_tflops(device()) if torch.cuda.is_available() else None


def pretrain(config, engine, scheduler, datasets, tokenizer=None, start=None, step_hook=None):
    """Runs the loop. datasets: (train, valid, test) data loaders' iterables factory results; returns a summary.

    step_hook(iteration, loss) is called after each iteration (tests use it to inject faults).
    """
    from megatron.data.samplers import build_pretraining_data_loader

    state = parallel_state.get_parallel_state()
    training, ckpt = config.training, config.checkpoint
    pipelined = state.pipeline_model_parallel_size > 1
    start = start or checkpointing.ResumeState()
    iteration, consumed = start.iteration, start.consumed_samples
    train_ds, valid_ds, _ = datasets
    loader = build_pretraining_data_loader(train_ds, consumed, training.micro_batch_size, state.dp_rank,
                                           state.data_parallel_size, config.data.num_workers)
    data_iter = PipeBatches(iter(loader)) if pipelined else iter(loader)

    def valid_iter():
        if valid_ds is None:
            return None
        it = iter(build_pretraining_data_loader(valid_ds, 0, training.micro_batch_size, state.dp_rank,
                                                state.data_parallel_size, 0))
        return PipeBatches(it) if pipelined else it

    if start.rng_state is not None:
        checkpointing.set_rng_state(start.rng_state)  # after iter(loader), which draws from the generator
    writer = MetricsWriter(config.logging, state.rank)
    exit_signal = ExitSignal(training.exit_signal_handler)
    flops = model_flops_per_iteration(training.global_batch_size, config.model.seq_length, config.model.num_layers,
                                      config.model.hidden_size, config.model.vocab_size,
                                      training.checkpoint_activations)
    peak = _peak_tflops(config)
    tokens_per_iter = training.global_batch_size * config.model.seq_length
    start_time = time.time()
    window_loss, window_iters, window_start = 0.0, 0, time.perf_counter()
    nan_streak = nan_total = 0
    losses = {}
    last_saved = None
    last_good = (start.iteration, ckpt.load) if ckpt.load and start.iteration else None  # (iteration, root)
    guard = NonFiniteGuard(engine, state, config.optimizer.clip_grad)
    faults = TestFaults.from_env(state.rank)

    def save():
        nonlocal last_saved, last_good
        if ckpt.save and last_saved != iteration:
            checkpointing.save_checkpoint(engine, config, iteration, consumed, tokenizer,
                                          fault_hook=lambda phase: faults.fire(iteration, "save"))
            last_saved = iteration
            last_good = (iteration, ckpt.save)

    exit_reason = "finished"
    while iteration < training.train_iters:
        faults.start_iteration(engine, iteration + 1)
        skipped_before = int(getattr(engine, "skipped_steps", 0))
        try:
            loss = train_step(engine, data_iter, training.gradient_accumulation_steps, pipelined, guard,
                              fire=lambda phase: faults.fire(iteration + 1, phase))
        except torch.cuda.OutOfMemoryError as err:
            raise RuntimeError(OOM_HINT) from err
        iteration += 1
        consumed += training.global_batch_size
        losses[iteration] = loss
        if step_hook is not None:
            step_hook(iteration, loss)

        skipped = int(getattr(engine, "skipped_steps", 0)) - skipped_before
        nonfinite = _any_rank_over(0.0 if math.isfinite(loss) else 1.0, 0.5) or \
            (skipped > 0 and not config.precision.fp16)  # bf16/fp32 skip only a non-finite gradient
        if nonfinite:
            nan_total += 1
            nan_streak += 1
            if skipped == 0:
                raise NonFiniteError(
                    f"lm loss is {loss} at iteration {iteration} and the optimizer applied the update (is "
                    "bf16.check_grad_overflow false in the DeepSpeed config?); stopping without saving. "
                    + _where_to_resume(ckpt, last_good))
            logger.warning("iteration %d: lm loss %s, gradient norm %s: update skipped (%d in a row)", iteration,
                           loss, guard.grad_norm(), nan_streak)
        else:
            nan_streak = 0
            window_loss += loss
            window_iters += 1

        if iteration % config.logging.log_interval == 0 or iteration == training.train_iters:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start
            n = iteration % config.logging.log_interval or config.logging.log_interval
            per_iter = elapsed / n
            # per GPU; without CUDA (tests, the quickstart on a laptop) a TFLOP/s figure means nothing: left out
            tflops = flops / per_iter / state.world_size / 1e12 if torch.cuda.is_available() else None
            metrics = dict(
                iteration=iteration, train_iters=training.train_iters, consumed_samples=consumed,
                consumed_tokens=consumed * config.model.seq_length, ms_per_iteration=1000 * per_iter,
                lr=scheduler.get_lr(), global_batch_size=training.global_batch_size,
                lm_loss=window_loss / window_iters if window_iters else float("nan"),
                loss_scale=_loss_scale(engine), grad_norm=guard.grad_norm(),
                skipped_iterations=int(getattr(engine, "skipped_steps", 0)), nan_iterations=nan_total,
                samples_per_second=training.global_batch_size / per_iter, tokens_per_second=tokens_per_iter / per_iter,
                tflops=tflops, mfu=tflops / peak if peak and tflops is not None else None, **peak_memory_gib())
            logger.info(format_log_line(metrics))
            writer.write("train", metrics)
            window_loss, window_iters, window_start = 0.0, 0, time.perf_counter()

        at_min_scale = config.precision.fp16 and (_loss_scale(engine) or 0) <= config.precision.min_loss_scale
        if nan_streak >= training.max_nan_iterations and (not config.precision.fp16 or at_min_scale):
            raise NonFiniteError(
                f"lm loss or gradient norm not finite at iteration {iteration}, {nan_streak} iterations in a "
                f"row (--max-nan-iterations {training.max_nan_iterations}); their updates were skipped. "
                "Usual causes: learning rate too high (--lr, --lr-warmup-iters), precision (fp16 overflows: "
                "use --bf16; check --loss-scale), no or loose clipping (--clip-grad), bad data. "
                + _where_to_resume(ckpt, last_good))
        if training.eval_interval and iteration % training.eval_interval == 0 and valid_ds is not None:
            _log_eval(engine, valid_iter(), training.eval_iters, pipelined, iteration, writer)
        if ckpt.save_interval and iteration % ckpt.save_interval == 0:
            if nonfinite:
                logger.warning("iteration %d: not saving a checkpoint after a non-finite iteration", iteration)
            else:
                save()
        if training.exit_interval and iteration % training.exit_interval == 0:
            exit_reason = f"--exit-interval {training.exit_interval}"
        elif training.exit_duration_in_mins and _any_rank_over(time.time() - start_time,
                                                               60 * training.exit_duration_in_mins):
            exit_reason = f"--exit-duration-in-mins {training.exit_duration_in_mins}"
        elif training.exit_signal_handler and exit_signal.any_rank():
            exit_reason = "exit signal"
        if exit_reason != "finished":
            break

    evaluated_last = training.eval_interval and iteration % training.eval_interval == 0
    if valid_ds is not None and exit_reason == "finished" and training.eval_iters > 0 and not evaluated_last:
        _log_eval(engine, valid_iter(), training.eval_iters, pipelined, iteration, writer)
    save()
    writer.close()
    logger.info("training stopped at iteration %d (%s)", iteration, exit_reason)
    return {"iteration": iteration, "consumed_samples": consumed, "losses": losses, "exit_reason": exit_reason}


def _where_to_resume(ckpt, last_good):
    if last_good is None:
        return f"No checkpoint was saved{' in ' + ckpt.save if ckpt.save else ''} yet."
    iteration, root = last_good
    return (f"The last good checkpoint, {checkpointing.tag_for(iteration)} in {root}, is intact: fix the cause "
            f"and relaunch with --load {root}.")


def _any_rank_over(value, limit):
    flag = torch.tensor([1.0 if value > limit else 0.0], device=device())
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _log_eval(engine, data_iter, eval_iters, pipelined, iteration, writer):
    loss = evaluate(engine, data_iter, eval_iters, pipelined)
    ppl = math.exp(min(20.0, loss))
    logger.info("validation at iteration %d | lm loss: %.6E | lm loss PPL: %.6E |", iteration, loss, ppl)
    writer.write("valid", {"iteration": iteration, "lm_loss": loss, "ppl": ppl})
