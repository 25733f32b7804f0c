"""Model-parallel RNG: dropout inside the TP region differs across TP ranks, outside it agrees.

Megatron's scheme: the default generator is seeded with `seed` on every TP rank of a replica (so
dropout on replicated activations agrees), and a tracked generator 'model-parallel-rng' is seeded with
`seed + 2718 + tp_rank` for dropout on split activations (attention probabilities of this rank's heads).
The tracker works on CUDA when it is available and on the CPU generator otherwise.

`checkpoint(fn, *args)` is activation checkpointing that restores the default and tracked RNG states
before recomputing, so recomputed dropout masks equal the original ones.
"""
import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718


def _use_cuda():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state():
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_state(state):
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in for the duration of a block."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def add(self, name, seed):
        if name in self.states:
            raise RuntimeError(f"RNG state {name!r} already exists")
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    def get_states(self):
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states):
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} is not added; call model_parallel_manual_seed(seed) first")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()
_CHECKPOINT_IMPL = None  # None: our _CheckpointFunction; else DeepSpeed's (see use_deepspeed_checkpointing)


def get_rng_tracker():
    return _TRACKER


def use_deepspeed_checkpointing():
    """Routes checkpoint() through deepspeed.checkpointing (which partitions the saved activations across TP
    ranks with partition_activations) and makes its RNG tracker ours, so the dropout it replays is ours.
    Call deepspeed.checkpointing.configure(...) first, and seed again afterwards."""
    import deepspeed
    global _TRACKER, _CHECKPOINT_IMPL
    _TRACKER = deepspeed.checkpointing.get_cuda_rng_tracker()
    _CHECKPOINT_IMPL = deepspeed.checkpointing.checkpoint


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_manual_seed(seed, tp_rank=0):
    """Seeds the default generators with `seed` and the tracked one with seed + 2718 + tp_rank."""
    torch.manual_seed(seed)  # seeds CPU and every CUDA device
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + tp_rank)


model_parallel_cuda_manual_seed = model_parallel_manual_seed  # Megatron's name


def _rng_snapshot():
    snap = {"cpu": torch.get_rng_state(), "tracker": _TRACKER.get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["cuda"] = torch.cuda.get_rng_state()
    return snap


def _rng_restore(snap):
    torch.set_rng_state(snap["cpu"])
    if "cuda" in snap:
        torch.cuda.set_rng_state(snap["cuda"])
    _TRACKER.set_states(snap["tracker"])


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.rng = _rng_snapshot()
        with torch.no_grad():
            outputs = fn(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        after = _rng_snapshot()
        _rng_restore(ctx.rng)
        with torch.enable_grad():
            outputs = ctx.fn(*inputs)
        _rng_restore(after)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(x.grad if x.requires_grad else None for x in inputs)


def checkpoint(fn, *args):
    """Runs fn(*args) without keeping activations; recomputes them (same RNG) in backward. Tensor args only."""
    if _CHECKPOINT_IMPL is not None:
        return _CHECKPOINT_IMPL(fn, *args)
    return _CheckpointFunction.apply(fn, *args)
