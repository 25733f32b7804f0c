"""What generation and serving load: a checkpoint of any layout or an HF folder, and its tokenizer; the command-line
flags tools/generate_text.py and tools/run_text_generation_server.py share to choose it and how its decode step runs
(--compile-mode, --graph-step, --gemm: InferenceEngine's compile_mode=, graph_step=, gemm=).

load_model builds this process's part of the model: under torchrun (WORLD_SIZE > 1) the model runs tensor-parallel
over every process (TP = --tensor-model-parallel-size, which must equal the number of processes; PP 1), each rank
reading only its own slices of the checkpoint's tensors (megatron/evaluation/loading.py's reader: any saved TP x PP
layout, no merged copy); one process reads the whole model.
"""
import dataclasses
import os

from megatron.checkpoint.convert import DTYPES
from megatron.checkpoint.hf import load_any
from megatron.inference.checks import check_tokenizer_fits_model
from megatron.tokenizer import build_tokenizer


def add_model_flags(parser):
    """The flags naming the model and how it runs: --load, --tokenizer-name-or-path, --num-partitions, --dtype,
    --no-cuda-graphs."""
    parser.add_argument("--load", required=True,
                        help="checkpoint folder (iter_XXXXXXX), its --save root, or a Hugging Face BLOOM folder")
    parser.add_argument("--tokenizer-name-or-path", default=None,
                        help="tokenizer folder (default: the checkpoint's tokenizer/ or the HF folder)")
    parser.add_argument("--num-partitions", type=int, default=None, help="expected TP size of --load (checked)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                        help="auto: the stored dtype on GPU, fp32 on CPU")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on a GPU")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=None,
                        help="TP size to run at: the number of processes torchrun starts (default: that number; "
                             "the checkpoint's own TP need not match, its tensors are sliced on load)")


def add_decode_flags(parser):
    """The flags choosing how the engine's decode step runs (megatron/inference/engine.py): --compile-mode,
    --graph-step, --gemm."""
    from megatron.inference.decode import COMPILE_MODES, GEMMS
    parser.add_argument("--compile-mode", choices=["none", *COMPILE_MODES], default="none",
                        help="torch.compile the fused decode step's segments with this mode (default: none, eager; "
                             "TP 1 only)")
    parser.add_argument("--graph-step", action="store_true",
                        help="capture the whole decode step (state update and sampling too) in its CUDA graph: one "
                             "replay per step (GPU, TP 1)")
    parser.add_argument("--gemm", choices=list(GEMMS), default="torch",
                        help="the fused decode step's GEMMs: torch, triton (the skinny split-K kernel) or auto (the "
                             "faster per weight shape and batch bucket, timed at capture; torch without CUDA) "
                             "(default: %(default)s; TP 1 only)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="prefill admitted prompts padded to (rows, width) buckets of up to this many tokens as "
                             "CUDA graphs, every bucket captured at start-up (default: 2048 with CUDA graphs; 0: "
                             "eager, unpadded prefill)")


def decode_options(args, device, tp, cuda_graphs):
    """InferenceEngine's compile_mode=, graph_step= and gemm= for the add_decode_flags flags; ValueError naming the
    flag and the fix for a combination that cannot run (device: "cuda" or "cpu")."""
    import torch

    from megatron.inference.skinny_gemm import triton_gemm_available
    if tp > 1:
        for flag, value, default in (("--compile-mode", args.compile_mode, "none"), ("--gemm", args.gemm, "torch")):
            if value != default:
                raise ValueError(f"{flag} {value} tunes the fused decode step, which runs at tensor-parallel size 1 "
                                 f"(this run: TP {tp}); drop {flag}")
        if args.graph_step:
            raise ValueError(f"--graph-step cannot capture the per-step token broadcast of tensor parallelism (this "
                             f"run: TP {tp}); drop --graph-step")
    if args.graph_step and not cuda_graphs:
        raise ValueError("--graph-step captures the whole decode step in a CUDA graph: it needs a GPU and CUDA graphs "
                         "(this run has none); drop --graph-step" + (" or --no-cuda-graphs" if device == "cuda"
                                                                     else ""))
    prefill_graph_tokens = args.prefill_graph_tokens
    if prefill_graph_tokens is not None and prefill_graph_tokens < 0:
        raise ValueError(f"--prefill-graph-tokens {prefill_graph_tokens} is negative; give 0 (no prefill graphs) or "
                         "a positive bound")
    if prefill_graph_tokens and not cuda_graphs:
        prefill_graph_tokens = 0  # padding without graphs only costs compute
    if args.gemm == "triton" and not triton_gemm_available(torch.device(device)):
        raise ValueError("--gemm triton needs CUDA and the triton package; use --gemm torch or --gemm auto")
    return {"compile_mode": None if args.compile_mode == "none" else args.compile_mode,
            "graph_step": args.graph_step, "gemm": args.gemm, "prefill_graph_tokens": prefill_graph_tokens}


def device_and_dtype(merged, dtype_flag):
    """(device, dtype) to run merged on: the GPU if there is one; --dtype auto is the stored dtype there, fp32 on
    the CPU."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype_flag != "auto":
        return device, DTYPES[dtype_flag]
    return device, merged.dtype if device == "cuda" else torch.float32


def load_checkpoint_and_tokenizer(path, num_partitions=None, tokenizer_dir=None):
    """(MergedCheckpoint, tokenizer) for --load path; tokenizer_dir overrides the checkpoint's own tokenizer.
    Raises ValueError naming the flag when there is no tokenizer or it does not fit the model's vocabulary."""
    merged = load_any(path, num_partitions)
    return merged, tokenizer_for(merged, path, tokenizer_dir)


def tokenizer_for(source, path, tokenizer_dir=None):
    """The tokenizer of --load path (source: its MergedCheckpoint or reader), or --tokenizer-name-or-path, checked
    against the model's vocabulary and the checkpoint's own tokenizer (ValueError naming the flag)."""
    own_dir = source.tokenizer_dir
    tokenizer_dir = tokenizer_dir or own_dir
    if tokenizer_dir is None:
        raise ValueError(f"--load {path} has no tokenizer; pass --tokenizer-name-or-path FOLDER")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=tokenizer_dir)
    overridden = own_dir is not None and os.path.realpath(own_dir) != os.path.realpath(tokenizer_dir)
    own = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=own_dir) if overridden else None
    check_tokenizer_fits_model(tokenizer, tokenizer_dir, source.config.vocab_size,
                               getattr(source, "run_config", None), own, own_dir)
    return tokenizer


def setup_tensor_parallel(tp=None):
    """This process's ParallelState: TP over the torchrun world (gloo on CPU, NCCL on GPU), or one process's
    (TP 1, no group). ValueError names the flag when --tensor-model-parallel-size is not the world size."""
    import torch

    from megatron.core import parallel_state
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp is not None and tp != world:
        raise ValueError(f"--tensor-model-parallel-size {tp} but {world} process{'es were' if world > 1 else ' was'} "
                         f"launched; start it with torchrun --nproc_per_node {tp} (PP and DP replicas are not served)")
    if world == 1:
        return parallel_state.ParallelState()
    import torch.distributed as dist
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return parallel_state.initialize_model_parallel(world, 1)


def tp_token_sync(state):
    """The engine's sync_tokens under TP: every rank uses the first TP rank's sampled tokens."""
    import torch.distributed as dist
    src, group = state.tp_ranks[0], state.tp_group

    def sync(tokens):
        dist.broadcast(tokens, src=src, group=group)
        return tokens
    return sync


def load_model(path, state, num_partitions=None, tokenizer_dir=None, dtype_flag="auto"):
    """(model, tokenizer, device, dtype) of this rank: a BloomModel (parallel_output=False, eval mode, on the device)
    holding this TP rank's slices of --load, and its tokenizer (tokenizer_for)."""
    import torch

    from megatron.checkpoint.convert import read_shard_for, stage_names
    from megatron.evaluation.loading import open_reader
    from megatron.model.bloom import BloomModel

    reader = open_reader(path, num_partitions)
    try:
        tokenizer = tokenizer_for(reader, path, tokenizer_dir)
        tp, rank = state.tensor_model_parallel_size, state.tp_rank
        device, dtype = device_and_dtype(reader, dtype_flag)
        config = dataclasses.replace(reader.config, tensor_model_parallel_size=tp, attention_impl="torch",
                                     hidden_dropout=0.0, attention_dropout=0.0)
        names = stage_names(reader.config, tp, 1, tp_flag="--tensor-model-parallel-size")[0]
        weights = read_shard_for(reader, names, rank, tp, dtype)["weights"]
    finally:
        reader.close()
    with torch.random.fork_rng(devices=[]):
        model = BloomModel(config, parallel_output=False, tp_group=state.tp_group)
    model.load_state_dict(weights, strict=True)
    return model.to(device=device, dtype=dtype).eval(), tokenizer, device, dtype
