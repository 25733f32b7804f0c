"""Prefill cost by admitted-group size, cold (first time the shape is seen) and warm: SDPA's cuDNN backend (before)
against the plan-free backends the engine now prefills with (after). Distinct prompt lengths per variant, so every
shape is cold for the variant that meets it first."""
import contextlib, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import megatron.inference.engine as engine_module
from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.model import BloomModel
from megatron.model.attention import plan_free_attention

dev = torch.device("cuda")
torch.manual_seed(0)
cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=250880, seq_length=288,
                  attention_impl="torch", hidden_dropout=0.0, attention_dropout=0.0)
with torch.device(dev):
    model = BloomModel(cfg, parallel_output=False).to(torch.bfloat16).eval()
engine = InferenceEngine(model, max_batch_size=64, max_seq_len=288, eod_id=None, vocab_limit=50257, cuda_graphs=True)
t = time.perf_counter(); engine.warmup(every_bucket=True); print(f"{torch.cuda.get_device_name()} warmup {time.perf_counter() - t:.2f} s", flush=True)
params = SamplingParams(greedy=True, max_new_tokens=2)
prompt = lambda i, n: [(7 * i + 13 * j) % 50000 + 4 for j in range(n)]

def one(n, length):
    for i in range(n):
        engine.add_request(prompt(i, length), params)
    torch.cuda.synchronize(); t = time.perf_counter()
    engine.step(1)  # admit + prefill + one decode step + read-back
    torch.cuda.synchronize(); took = time.perf_counter() - t
    outs = []
    while engine.has_work():
        outs += engine.step(8) or []
    return took * 1e3

one(8, 32); one(8, 32)
variants = {"cudnn (before)": lambda device: contextlib.nullcontext(), "plan-free (after)": plan_free_attention}
groups = [1, 2, 3, 5, 8, 12, 17, 24, 31, 48, 64]
summary = {}
for k, (name, ctx) in enumerate(variants.items()):
    engine_module.plan_free_attention = ctx
    print(f"== {name}\ngroup  len  cold ms  warm ms", flush=True)
    colds, warms = [], []
    for n in groups:
        length = 40 + k
        cold = one(n, length); warm = one(n, length); colds.append(cold); warms.append(warm)
        print(f"{n:5d} {length:4d} {cold:8.1f} {warm:8.1f}", flush=True)
    for length in [17 + 2 * k, 100 + k, 200 + k]:
        cold = one(4, length); warm = one(4, length); colds.append(cold); warms.append(warm)
        print(f"{4:5d} {length:4d} {cold:8.1f} {warm:8.1f}", flush=True)
    summary[name] = (sum(colds) / len(colds), sum(warms) / len(warms), max(colds))
for name, (c, w, m) in summary.items():
    print(f"{name}: mean cold {c:.1f} ms, mean warm {w:.1f} ms, max cold {m:.1f} ms")
# the two variants' greedy tokens agree (bf16: the kernels differ, near-ties possible)
engine_module.plan_free_attention = plan_free_attention
