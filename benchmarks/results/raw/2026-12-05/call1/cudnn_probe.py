"""cuDNN ALiBi attention on the GPU: accuracy against the fp32 reference (beside FlexAttention's), and speed."""
import json, sys, time
import torch
from megatron.model import attention, cudnn_attention
from megatron.model.alibi import get_alibi_slopes

print("torch", torch.__version__, "cudnn backend", torch.backends.cudnn.version(), flush=True)
import cudnn
print("cudnn frontend", cudnn.__version__, "backend", cudnn.backend_version(), flush=True)
dev = torch.device("cuda")
res = {"accuracy": [], "timing": {}}

def split(qkv):
    return [t.transpose(1, 2) for t in qkv.unbind(3)]

def run_cudnn(qkv):
    return cudnn_attention.attention(qkv, qkv.shape[-1] ** -0.5)

def run_flex(qkv, slopes):
    q, k, v = split(qkv)
    return attention.flex_attention(q, k, v, slopes, qkv.shape[-1] ** -0.5, 0.0).transpose(1, 2)

def run_ref(qkv, slopes):
    q, k, v = split(qkv.float())
    return attention.torch_attention(q, k, v, slopes, qkv.shape[-1] ** -0.5, 0.0).transpose(1, 2)

def grads(fn, qkv, g):
    x = qkv.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(g.to(out.dtype))
    return out.detach().float(), x.grad.float()

torch.manual_seed(0)
for (b, s, h, d, dtype) in [(2, 256, 16, 128, torch.bfloat16), (1, 1000, 16, 128, torch.bfloat16),
                            (2, 384, 12, 64, torch.float16), (4, 2048, 16, 128, torch.bfloat16)]:
    slopes = get_alibi_slopes(h).to(dev)
    qkv = torch.randn(b, s, h, 3, d, device=dev, dtype=dtype)
    g = torch.randn(b, s, h, d, device=dev)
    ro, rg = grads(lambda x: run_ref(x, slopes), qkv, g)
    row = {"shape": [b, s, h, d], "dtype": str(dtype)}
    sides = [("cudnn", run_cudnn)]
    if s % 128 == 0:
        sides.append(("flex", lambda x: run_flex(x, slopes)))
    for name, fn in sides:
        try:
            o, gr = grads(fn, qkv, g)
            row[name] = {"out_max": (o - ro).abs().max().item(), "out_rel": ((o - ro).norm() / ro.norm()).item(),
                         "grad_max": (gr - rg).abs().max().item(), "grad_rel": ((gr - rg).norm() / rg.norm()).item(),
                         "dq_rel": ((gr[:, :, :, 0] - rg[:, :, :, 0]).norm() / rg[:, :, :, 0].norm()).item(),
                         "dk_rel": ((gr[:, :, :, 1] - rg[:, :, :, 1]).norm() / rg[:, :, :, 1].norm()).item(),
                         "dv_rel": ((gr[:, :, :, 2] - rg[:, :, :, 2]).norm() / rg[:, :, :, 2].norm()).item()}
        except Exception as e:
            row[name] = repr(e)[:500]
    print(json.dumps(row), flush=True)
    res["accuracy"].append(row)
    del ro, rg

def time_ms(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    z.record(); torch.cuda.synchronize()
    return a.elapsed_time(z) / iters

b, s, h, d = 4, 2048, 16, 128
slopes = get_alibi_slopes(h).to(dev)
qkv = torch.randn(b, s, h, 3, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)

def floor(x):
    q, k, v = split(x)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

for name, fn in [("cudnn", run_cudnn), ("flex", lambda x: run_flex(x, slopes)), ("sdpa_causal_no_alibi", floor)]:
    with torch.no_grad():
        fwd = time_ms(lambda: fn(qkv))
    both = time_ms(lambda: fn(qkv).backward(g))
    qkv.grad = None
    res["timing"][name] = {"fwd_ms": fwd, "fwd_bwd_ms": both}
    print(name, res["timing"][name], flush=True)
cudnn_attention.DETERMINISTIC = False
both = time_ms(lambda: run_cudnn(qkv).backward(g))
res["timing"]["cudnn_nondeterministic"] = {"fwd_bwd_ms": both}
print("cudnn nondeterministic", both, flush=True)
cudnn_attention.DETERMINISTIC = True
# determinism: two backward passes bit-equal
outs = []
for _ in range(2):
    qkv.grad = None
    run_cudnn(qkv).backward(g)
    outs.append(qkv.grad.clone())
res["deterministic_equal"] = bool(torch.equal(outs[0], outs[1]))
print("deterministic backward bit-equal:", res["deterministic_equal"], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
