"""Predicted step time of a training layout: compute at a stated share of the GPU's peak, the pipeline bubble of
the 1F1B schedule, and the tensor-, pipeline- and data-parallel traffic over measured or published bandwidths.

    step = (m + pp - 1) x (compute + TP all-reduces + pipeline sends of one micro batch on one stage)
           + data-parallel gradient traffic + tied-embedding all-reduce + CPU optimizer (with offload)

m = gradient accumulation steps (micro batches per step). Compute is the FLOPs of the log line
(megatron.training.metrics.model_flops_per_iteration: Megatron's eq. 3, with recomputation when checkpointing)
over all GPUs at `efficiency` x peak. A collective of S bytes over n ranks takes S x factor / busbw, with
nccl-tests' factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n; a point-to-point send S / bw.
Communication is counted as not overlapped with compute (DeepSpeed's defaults overlap little of it here).
Pure arithmetic: no torch.
"""
import dataclasses
import json

# Published dense bf16 tensor-core peaks (FP32 accumulate; NVIDIA datasheets / architecture whitepapers), memory,
# and the bus bandwidth nccl-tests typically reports inside one host of that kind (GB/s): all-reduce busbw and
# point-to-point. Consumer cards have no NVLink and no peer-to-peer over PCIe: NCCL goes through host memory.
GPUS = {
    "rtx3090": dict(name="NVIDIA GeForce RTX 3090", tflops=71.0, memory_gib=24.0, busbw=10.0, p2p=10.0),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", tflops=165.2, memory_gib=24.0, busbw=10.0, p2p=10.0),
    "a100": dict(name="NVIDIA A100 SXM 80GB", tflops=312.0, memory_gib=80.0, busbw=230.0, p2p=250.0),
    "h100": dict(name="NVIDIA H100 SXM", tflops=989.0, memory_gib=80.0, busbw=360.0, p2p=350.0),
    "h200": dict(name="NVIDIA H200", tflops=989.0, memory_gib=141.0, busbw=360.0, p2p=350.0),
}
DEFAULT_EFFICIENCY = 0.5  # this project's 1.72B run reached 0.53 of the H200's 989 TFLOP/s (README, results)
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeed's CPU Adam on a many-core host, order of magnitude
PCIE_GBPS = 20.0  # host <-> GPU copies for CPU offload


@dataclasses.dataclass(frozen=True)
class Bandwidths:
    """Bus bandwidths in GB/s (nccl-tests' busbw) and where they came from."""
    all_reduce: float
    all_gather: float
    reduce_scatter: float
    p2p: float
    source: str


def gpu_spec(kind):
    key = kind.lower().replace(" ", "").replace("-", "")
    if key not in GPUS:
        raise ValueError(f"--gpu {kind} is not one of {', '.join(GPUS)}; pass the closest one, or --peak-tflops "
                         "with --collectives-json from tools/check_environment.py --collectives")
    return GPUS[key]


def spec_for_device(device_name):
    """The GPUS entry whose name matches a torch.cuda.get_device_name() (H100's when none does)."""
    lower = (device_name or "").lower()
    for key in ("3090", "4090", "a100", "h100", "h200"):
        if key in lower:
            return GPUS[key if key.startswith(("a", "h")) else "rtx" + key]
    return GPUS["h100"]


def bandwidths_from(spec, collectives_json=None):
    """Bandwidths of the GPU kind's published figures, or the largest-message busbw of each collective in a
    tools/check_environment.py --collectives JSON file."""
    if collectives_json is None:
        return Bandwidths(spec["busbw"], spec["busbw"], spec["busbw"], spec["p2p"], f"published ({spec['name']})")
    rerun = "rerun tools/check_environment.py --collectives --json FILE under torchrun --nproc_per_node N (N >= 2)"
    try:
        with open(collectives_json) as f:
            data = json.load(f)
        ranks = data["world_size"]
        best = {}
        for row in data["results"]:
            if row["ok"] and row["bytes"] >= best.get(row["op"], (0, 0.0))[0]:
                best[row["op"]] = (row["bytes"], float(row["busbw_gbps"]))
        values = {op: best[op][1] for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--collectives-json {collectives_json}: not a tools/check_environment.py --collectives JSON "
                         f"with all_reduce, all_gather, reduce_scatter and p2p results ({type(err).__name__}: {err}); "
                         f"{rerun}") from None
    if ranks < 2:
        raise ValueError(f"--collectives-json {collectives_json} was measured by one process, which moves nothing "
                         f"between GPUs; {rerun}")
    return Bandwidths(source=f"measured ({collectives_json}, {ranks} ranks)", **values)


@dataclasses.dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float
    bubble: float  # the pipeline's idle share of the step
    tp_comm: float
    pp_comm: float
    dp_comm: float
    offload: float
    tokens_per_second: float


def step_time(model, tp, pp, dp, micro_batch, gradient_accumulation, precision, zero_stage,
              checkpoint_activations, cpu_offload, peak_tflops, efficiency, bw, rank_parameters):
    """StepTime of one optimizer step. rank_parameters: elements of the largest stage's rank (the DP traffic)."""
    from megatron.training.metrics import model_flops_per_iteration
    b, s, h, v, layers = (micro_batch, model.seq_length, model.hidden_size, model.vocab_size, model.num_layers)
    m = gradient_accumulation
    global_batch = micro_batch * m * dp
    w = 4 if precision == "fp32" else 2
    gb = 1e9
    flops = model_flops_per_iteration(global_batch, s, layers, h, v, checkpoint_activations)
    gpus = tp * pp * dp
    compute_mb = flops / gpus / m / (peak_tflops * 1e12 * efficiency)  # one micro batch on one stage
    hidden = b * s * h * w
    stage_layers = -(-layers // pp)
    tp_mb = 0.0
    if tp > 1:
        reduces = stage_layers * (6 if checkpoint_activations else 4) + 2  # + embedding forward, head backward
        tp_mb = reduces * hidden * 2 * (tp - 1) / tp / (bw.all_reduce * gb)
    pp_mb = 2 * hidden / (bw.p2p * gb) if pp > 1 else 0.0
    per_mb = compute_mb + tp_mb + pp_mb
    pipeline = (m + pp - 1) * per_mb
    grad_bytes = rank_parameters * w
    ring = (dp - 1) / dp
    if dp == 1:
        dp_comm = 0.0
    elif zero_stage in (0, 1):
        dp_comm = grad_bytes * 2 * ring / (bw.all_reduce * gb)
    elif zero_stage == 2:  # reduce-scatter in every micro batch's backward, all-gather of the weights per step
        dp_comm = m * grad_bytes * ring / (bw.reduce_scatter * gb) + grad_bytes * ring / (bw.all_gather * gb)
    else:  # weights all-gathered in forward and backward, gradients reduce-scattered, every micro batch
        dp_comm = m * (2 * grad_bytes * ring / (bw.all_gather * gb) + grad_bytes * ring / (bw.reduce_scatter * gb))
    if pp > 1:  # the tied embedding's gradient between the first and the last stage
        dp_comm += 2 * v // tp * h * w / (bw.p2p * gb)
    offload = 0.0
    if cpu_offload:
        shard = rank_parameters / dp
        offload = shard / CPU_ADAM_PARAMS_PER_S + shard * (4 + w) / (PCIE_GBPS * gb)
    seconds = pipeline + dp_comm + offload
    return StepTime(seconds, compute_mb * m, (pp - 1) / (m + pp - 1), tp_mb * (m + pp - 1),
                    pp_mb * (m + pp - 1), dp_comm, offload, global_batch * s / seconds)
