"""Prefill cost by admitted-group size, cold (first time) and warm: prefill CUDA graphs (the default now) against
the eager unpadded prefill (prefill_graph_tokens=0, plan-free attention), on the 1.72B model in bf16."""
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
params = SamplingParams(greedy=True, max_new_tokens=2)
prompt = lambda i, n: [(7 * i + 13 * j) % 50000 + 4 for j in range(n)]
groups = [1, 2, 3, 5, 8, 12, 17, 24, 31, 32, 48, 64]
outputs = {}
for name, tokens in (("graphs", None), ("eager", 0)):
    engine = InferenceEngine(model, max_batch_size=64, max_seq_len=288, eod_id=None, vocab_limit=50257,
                             cuda_graphs=True, prefill_graph_tokens=tokens)
    t = time.perf_counter(); engine.warmup(every_bucket=True)
    print(f"{torch.cuda.get_device_name()} {name}: warmup {time.perf_counter() - t:.2f} s, {len(engine._graphs)} graphs "
          f"({len(engine.prefill_buckets())} prefill), {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)

    def one(n, length):
        requests = [engine.add_request(prompt(i, length), params) for i in range(n)]
        torch.cuda.synchronize(); t = time.perf_counter()
        engine.step(1)  # admit + prefill + one decode step + read-back
        torch.cuda.synchronize(); took = time.perf_counter() - t
        while engine.has_work():
            engine.step(8)
        outputs.setdefault((n, length), {})[name] = [r.output for r in requests]
        return took * 1e3

    one(8, 32); one(8, 32)
    print("group  len  cold ms  warm ms", flush=True)
    colds, warms = [], []
    for n, length in [(n, 40) for n in groups] + [(4, 17), (4, 100), (4, 200), (2, 280)]:
        cold = one(n, length); warm = one(n, length); colds.append(cold); warms.append(warm)
        print(f"{n:5d} {length:4d} {cold:8.1f} {warm:8.1f}", flush=True)
    print(f"{name}: mean cold {sum(colds) / len(colds):.1f} ms, mean warm {sum(warms) / len(warms):.1f} ms, "
          f"max cold {max(colds):.1f} ms", flush=True)
    del engine; torch.cuda.empty_cache()
same = sum(v["graphs"] == v["eager"] for v in outputs.values())
print(f"first two greedy tokens equal (graphs vs eager) in {same} of {len(outputs)} groups (bf16, different kernels)")
