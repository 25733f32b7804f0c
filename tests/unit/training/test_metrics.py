"""The FLOPs formula, the per-iteration log line and the LR schedule."""
import math

import pytest
import torch

from megatron.training.metrics import format_log_line, model_flops_per_iteration, peak_memory_gib
from megatron.optimizer import AnnealingLR, get_param_groups


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "activation-recompute"])
def test_flops_formula_equals_the_matmul_flops_torch_counts(recompute):
    """The formula against an independent count: torch's FlopCounterMode over one forward and backward of the real
    model (the torch attention backend, whose QK^T and AV are plain bmm; with activation checkpointing the
    recomputed forward is counted too). Eq. 3 counts exactly the matmuls, so the two are equal."""
    from torch.utils.flop_counter import FlopCounterMode
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    b, s, l, h, v = 2, 32, 2, 64, 512
    config = ModelConfig(num_layers=l, hidden_size=h, num_attention_heads=4, vocab_size=v, seq_length=s,
                         attention_impl="torch", checkpoint_activations=recompute)
    model = BloomModel(config).train()
    ids = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).float().sum().backward()
    assert counter.get_total_flops() > 0
    assert model_flops_per_iteration(b, s, l, h, v, activation_recompute=recompute) == pytest.approx(
        counter.get_total_flops(), rel=1e-12)


def test_flops_of_the_documents_model():
    # 0.756 PFLOP per global batch of 32 x 2048 tokens (221 TFLOP/s at 19.2k tokens/s).
    assert model_flops_per_iteration(32, 2048, 24, 2048, 250880) / 1e15 == pytest.approx(0.75619, abs=1e-5)


def test_log_line():
    line = format_log_line(dict(
        iteration=10, train_iters=100, consumed_samples=320, consumed_tokens=655360, ms_per_iteration=1234.5,
        lr=6e-5, global_batch_size=32, lm_loss=7.25, loss_scale=65536.0, grad_norm=1.5, skipped_iterations=1,
        nan_iterations=0, samples_per_second=25.92, tokens_per_second=53084.2, tflops=421.3, mfu=0.532,
        peak_allocated_gib=42.7049, peak_reserved_gib=48.0))
    assert line == (
        "iteration       10/     100 | consumed samples:          320 | consumed tokens:         655360 | "
        "elapsed time per iteration (ms): 1234.5 | learning rate: 6.000E-05 | global batch size:    32 | "
        "lm loss: 7.250000E+00 | loss scale: 65536.0 | grad norm: 1.500 | number of skipped iterations:   1 | "
        "number of nan iterations:   0 | samples per second: 25.920 | tokens per second: 53084.2 | "
        "TFLOP/s per GPU: 421.30 | MFU: 53.2% | peak allocated (GiB): 42.70 | peak reserved (GiB): 48.00 |")


def test_log_line_on_cpu_has_no_tflops_mfu_or_gpu_memory():
    line = format_log_line(dict(
        iteration=1, train_iters=2, consumed_samples=4, consumed_tokens=8, ms_per_iteration=1.0, lr=0.0,
        global_batch_size=4, lm_loss=1.0, loss_scale=None, grad_norm=None, skipped_iterations=0, nan_iterations=0,
        samples_per_second=1.0, tokens_per_second=2.0, tflops=None, mfu=None))
    assert line == (
        "iteration        1/       2 | consumed samples:            4 | consumed tokens:              8 | "
        "elapsed time per iteration (ms): 1.0 | learning rate: 0.000E+00 | global batch size:     4 | "
        "lm loss: 1.000000E+00 | number of skipped iterations:   0 | number of nan iterations:   0 | "
        "samples per second: 1.000 | tokens per second: 2.0 |")


def test_peak_memory_is_left_out_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert peak_memory_gib() == {}


@pytest.mark.gpu
def test_peak_memory_on_cuda():
    torch.cuda.reset_peak_memory_stats()
    block = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    peaks = peak_memory_gib()
    assert peaks["peak_allocated_gib"] >= 1.0 and peaks["peak_reserved_gib"] >= peaks["peak_allocated_gib"]
    assert peaks["peak_allocated_gib"] == torch.cuda.max_memory_allocated() / 2 ** 30
    del block


@pytest.mark.parametrize("style,step,expected", [
    ("cosine", 0, 0.0), ("cosine", 5, 5e-4), ("cosine", 10, 1e-3), ("cosine", 55, 1e-4 + 9e-4 * 0.5),
    ("cosine", 100, 1e-4), ("cosine", 150, 1e-4), ("linear", 55, 1e-4 + 9e-4 * 0.5), ("linear", 100, 1e-4),
    ("constant", 80, 1e-3),
])
def test_lr_schedule(style, step, expected):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = AnnealingLR(optimizer, lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=100, decay_style=style)
    schedule.step(step)
    assert schedule.get_lr() == pytest.approx(expected, abs=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-12)
    restored = AnnealingLR(optimizer, lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=100, decay_style=style)
    restored.load_state_dict(schedule.state_dict())
    assert restored.get_lr() == schedule.get_lr()



def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = get_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
