"""Prefill cost by admitted-group size, first (cold) and second (warm) time: per-shape set-up in the prefill path?"""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.model import BloomModel

dev = torch.device("cuda")
torch.manual_seed(0)
cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=250880, seq_length=288,
                  attention_impl="torch", hidden_dropout=0.0, attention_dropout=0.0)
with torch.device(dev):
    model = BloomModel(cfg, parallel_output=False).to(torch.bfloat16).eval()
engine = InferenceEngine(model, max_batch_size=64, max_seq_len=288, eod_id=None, vocab_limit=50257, cuda_graphs=True)
t = time.perf_counter(); engine.warmup(every_bucket=True); print(f"warmup {time.perf_counter() - t:.2f} s", flush=True)
params = SamplingParams(greedy=True, max_new_tokens=2)
prompt = lambda i, n: [(7 * i + 13 * j) % 50000 + 4 for j in range(n)]

def one(n, length):
    for i in range(n):
        engine.add_request(prompt(i, length), params)
    torch.cuda.synchronize(); t = time.perf_counter()
    engine.step(1)  # admit + prefill + one decode step + read-back
    torch.cuda.synchronize(); took = time.perf_counter() - t
    while engine.has_work():
        engine.step(8)
    return took * 1e3

one(8, 32); one(8, 32)
print("group  len  cold ms  warm ms", flush=True)
for n in [1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 17, 24, 31, 32, 48, 64]:
    for length in [32]:
        cold = one(n, length); warm = one(n, length)
        print(f"{n:5d} {length:4d} {cold:8.1f} {warm:8.1f}", flush=True)
for length in [17, 100, 200]:
    cold = one(4, length); warm = one(4, length)
    print(f"{4:5d} {length:4d} {cold:8.1f} {warm:8.1f}", flush=True)
from torch.profiler import profile, ProfilerActivity
for i in range(5):
    engine.add_request(prompt(i, 45), params)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    engine.step(1); torch.cuda.synchronize()
while engine.has_work():
    engine.step(8)
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
