"""Tensor-parallel generation on 2 GPUs (NCCL): CUDA-graph decode steps, whose captured forward holds the TP
all-reduces, equal the eager steps token for token (bf16 and fp32, greedy and sampled), and TP 2 equals TP 1 in fp32
over the first 8 greedy tokens (later, the two reduction orders' rounding flips near-ties of this random model: on
the CPU two of the six rows part at tokens 11 and 33)."""
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.model import BloomModel
from tests.distributed import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
VOCAB = 4096
CONFIG = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=VOCAB, seq_length=512,
                     attention_impl="torch", init_method_std=0.15)  # a large init: logits far apart
GREEDY = SamplingParams(greedy=True, max_new_tokens=48)
SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=48)


def full_model():
    torch.manual_seed(0)
    return BloomModel(CONFIG, parallel_output=False).eval()


def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(4, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(5, 40, (6,),
                                                                                               generator=gen)]


def generate_all(rank, world, port, out, backend="nccl"):
    """One rank: its TP slice of full_model(), generated with and without CUDA graphs in bf16 and fp32."""
    from megatron.checkpoint.convert import as_reader, read_shard_for, stage_names
    from megatron.core import parallel_state
    from megatron.inference.loading import tp_token_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    state = parallel_state.initialize_model_parallel(world, 1)
    names = stage_names(CONFIG, world, 1)[0]
    weights = read_shard_for(as_reader(full_model().state_dict()), names, rank, world)["weights"]
    model = BloomModel(dataclasses.replace(CONFIG, tensor_model_parallel_size=world), parallel_output=False,
                       tp_group=state.tp_group)
    model.load_state_dict(weights, strict=True)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = model.to(device=device, dtype=dtype).eval()
        for graphs in ((True, False) if backend == "nccl" else (False,)):
            engine = InferenceEngine(model, max_batch_size=4, max_seq_len=128, kv_bucket=32, cuda_graphs=graphs,
                                     sync_tokens=tp_token_sync(state))
            engine.warmup(every_bucket=True)
            results[(str(dtype), graphs, "greedy")] = engine.generate(prompts(), GREEDY)
            results[(str(dtype), graphs, "sampled")] = engine.generate(prompts(), SAMPLED, seed=5)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_tensor_parallel_cuda_graphs_equal_eager_and_tp1(tmp_path):
    out = tmp_path / "tp2.pt"
    mp.spawn(generate_all, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    bf16, fp32 = str(torch.bfloat16), str(torch.float32)
    for kind in ("greedy", "sampled"):
        assert got[(bf16, True, kind)] == got[(bf16, False, kind)], kind
        assert got[(fp32, True, kind)] == got[(fp32, False, kind)], kind
    one = InferenceEngine(full_model().cuda(), max_batch_size=4, max_seq_len=128, kv_bucket=32, cuda_graphs=False)
    assert [g[:8] for g in got[(fp32, True, "greedy")]] == [g[:8] for g in one.generate(prompts(), GREEDY)]
