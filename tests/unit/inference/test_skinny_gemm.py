"""The decode GEMM kernel (megatron/inference/skinny_gemm.py) under Triton's interpreter, in a fresh process
(TRITON_INTERPRET must be set before triton is first imported): against torch in fp32 and bf16 with every
epilogue and split-K; the fused step with every GEMM on the kernel gives torch's tokens, eager and traced by
dynamo (the custom op inside a fullgraph compile); the plans the kernel times."""
import os
import subprocess
import sys

import pytest

_GEMM_CHECK = """
import torch
import torch.nn.functional as F
from megatron.inference import skinny_gemm
from megatron.inference.skinny_gemm import layer_norm, linear, skinny_linear_triton

gen = torch.Generator().manual_seed(0)
def want(x, w, b, gelu, r):  # in fp32 from the same (rounded) inputs
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    y = F.gelu(y, approximate="tanh") if gelu else y
    return y if r is None else r.float() + y
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    # one row, several row blocks, K not a multiple of the split or the block, N not a multiple of block_n
    for m, n, k, split, block_n, block_k in ((1, 96, 256, 1, 32, 64), (5, 100, 200, 2, 32, 32),
                                             (17, 64, 512, 4, 64, 64), (40, 70, 96, 3, 32, 32)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        b, r = torch.randn(n, generator=gen).to(dtype), torch.randn(m, n, generator=gen).to(dtype)
        ln = (1 + torch.randn(k, generator=gen) / 4).to(dtype), torch.randn(k, generator=gen).to(dtype), 1e-5
        x_ln = layer_norm(3 * x + 1, *ln)  # the LayerNorm's output in x's dtype, what the kernel's prologue makes
        for bias, gelu, res, norm in ((None, False, None, None), (b, False, None, None), (b, True, None, None),
                                      (b, False, r, None), (b, True, None, ln), (None, False, r, ln)):
            xin = x if norm is None else 3 * x + 1  # the LayerNorm sees a mean and scale to remove
            for gemv in (False, True) if m <= skinny_gemm.GEMV_ROWS else (False,):  # a dot, or CUDA-core products
                got = skinny_linear_triton(xin, w, bias, res, gelu, block_n, block_k, split, gemv=gemv,
                                           **({} if norm is None else dict(zip(("ln_weight", "ln_bias", "eps"), ln))))
                assert got.dtype == dtype and got.shape == (m, n)
                # bf16: the kernel's and torch's LayerNorm statistics differ in the last fp32 bits, which can round
                # an element of the LayerNorm's output one bf16 step the other way (up to 3 tol on a sum of K)
                ln_tol = tol if norm is None or dtype == torch.float32 else 3 * tol
                torch.testing.assert_close(got.float(), want(x if norm is None else x_ln, w, bias, gelu, res),
                                           rtol=ln_tol, atol=ln_tol, msg=lambda e: f"{dtype} {m}x{n}x{k}: {e}")
                for last in (False, True):  # the splits summed by a second kernel or by each tile's last split
                    assert torch.equal(torch.ops.megatron.skinny_linear(xin, w, bias, res, gelu, block_n, block_k,
                                                                        split, last, gemv, 4,
                                                                        *(norm or (None, None, 0.0))), got)
                assert not skinny_gemm._LOCKS or not skinny_gemm._LOCKS[x.device].any()  # the counters back at 0
                torch.testing.assert_close(got.float(), linear(xin, w, bias, None, gelu, res, norm).float(),
                                           rtol=2 * tol, atol=2 * tol)
# choose_plan: torch and each plan timed (a stand-in clock), a plan that disagrees with torch dropped untimed
x = torch.randn(2, 512, generator=gen)
ws, bs = [torch.randn(64, 512, generator=gen) / 20 for _ in range(2)], [torch.randn(64, generator=gen)] * 2
real = skinny_gemm.skinny_linear_triton
def broken(*args):  # the splits summed in the kernel (last_reduces, the 9th argument) come out wrong
    y = real(*args)
    return y + 1 if args[8] else y
skinny_gemm.skinny_linear_triton = broken
clock = [6e-6, 4e-6, 2e-6, 8e-6, 3e-6]  # torch, then the four plans that agree
plan, seconds = skinny_gemm.choose_plan(2, ws, bs, gelu=True, sms=4, timer=lambda fn: fn() or clock.pop(0))
assert skinny_gemm.candidates(2, 64, 512, 4) == [(64, 128, 2, True, False, 4), (32, 256, 1, False, False, 4),
                                                 (64, 128, 2, False, False, 4), (8, 512, 1, False, True, 4),
                                                 (16, 512, 1, False, True, 8)]
assert plan == (64, 128, 2, False, False, 4) and not clock, (plan, clock)
assert seconds == {"torch": 3e-6, "triton dot 32x256 split 1": 2e-6, "triton dot 64x128 split 2": 1e-6,
                   "triton gemv 8x512 split 1": 4e-6, "triton gemv 16x512 split 1 8 warps": 1.5e-6}, seconds
# pdl: the fastest plan timed once more as a programmatic dependent launch, chosen if faster (the interpreter has no
# PDL: the stand-in runs it as a plain launch and records that it was asked for one)
asked = []
def plain(*args):
    asked.append(args[14])
    return real(*args[:14])
skinny_gemm.skinny_linear_triton = plain
clock = [6e-6, 4e-6, 2e-6, 8e-6, 3e-6, 5e-6, 1e-6]  # torch, the five plans, then the fastest (2e-6) as a PDL
plan, seconds = skinny_gemm.choose_plan(2, ws, bs, gelu=True, sms=4, timer=lambda fn: fn() or clock.pop(0), pdl=True)
assert plan == (32, 256, 1, False, False, 4, True) and not clock, (plan, clock)
assert seconds["triton dot 32x256 split 1 pdl"] == 1e-6 / len(ws) and len(seconds) == 7, seconds
assert asked.count(True) == 1 + len(ws), asked  # its check against torch, then the timed chain
skinny_gemm.skinny_linear_triton = real
print("gemm ok")
"""

_DECODER_CHECK = """
import torch
from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.inference.decode import mid_segment
from megatron.model import BloomModel

config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                     attention_impl="torch", init_method_std=0.5)
torch.manual_seed(0)
model = BloomModel(config, parallel_output=False).eval()
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(4, 250, (n,), generator=gen).tolist() for n in (5, 11, 3)]
params = SamplingParams(greedy=True, max_new_tokens=8)
kwargs = dict(max_batch_size=4, max_seq_len=32, decode="fused", vocab_limit=250)
want = InferenceEngine(model, gemm="torch", **kwargs).generate(prompts, params, steps_per_sync=3)
eng = InferenceEngine(model, gemm="triton", **kwargs)
got = eng.generate(prompts, params, steps_per_sync=3)
assert got == want, (got, want)
plans = eng.decoder.plans
assert list(plans) == [4] and all(p is not None for p in plans[4]), plans  # every GEMM on the kernel
# dynamo traces the custom op in a fullgraph compile (aot_eager: its fake implementation gives the shapes)
d = eng.decoder
residual, context = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
args = (residual, context, *d.post[0], *d.pre[1], d.eps, d.post_ln, False, plans[4])
compiled = torch.compile(mid_segment, backend="aot_eager", fullgraph=True)
for a, b in zip(compiled(*args), mid_segment(*args)):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
for a, b in zip(mid_segment(*args), mid_segment(*args[:-1])):  # the kernel against torch's GEMMs
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
gemv = tuple(plan[:4] + (True, 8) for plan in plans[4])  # the same tiles with CUDA-core products, 8 warps
for a, b in zip(mid_segment(*args[:-1], gemv), mid_segment(*args[:-1])):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
print("decoder ok")
"""


def _interpreted(code, marker):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and marker in done.stdout, done.stderr[-3000:]


def test_kernel_equals_torch_under_the_interpreter():
    _interpreted(_GEMM_CHECK, "gemm ok")


def test_fused_step_on_the_kernel_gives_torchs_tokens_under_the_interpreter():
    _interpreted(_DECODER_CHECK, "decoder ok")


def test_candidate_plans_split_k_to_about_two_programs_per_sm():
    from megatron.inference.skinny_gemm import candidates
    # (block_n, block_k, split, summed in the kernel, gemv, warps): the dot tiles split until tiles x split reaches
    # 2 x 132 programs unless a split would hold < 2 blocks of K; the first dot tiling also summed by a second
    # kernel; at <= 8 rows the GEMV tiles (4 and 8 warps, 64 fp32 products a thread: 2048 x warps / (rows' power
    # of two x block_k)) split until 4 x 132 programs with >= 1 block of K a split; at more rows 8-warp dot tiles
    # split until 132 programs
    dot = [(64, 128, 4, True, False, 4), (32, 256, 2, True, False, 4), (64, 128, 4, False, False, 4)]
    # 384 GEMV tiles of 16 rows -> split 2 (768 >= 528); 192 tiles of 32 -> split 4 (768)
    assert candidates(1, 6144, 2048, 132) == dot + [(16, 512, 2, True, True, 4), (32, 512, 4, True, True, 8)]
    assert candidates(1, 2048, 2048, 132) == [(64, 128, 8, True, False, 4), (32, 256, 4, True, False, 4),
                                              (64, 128, 8, False, False, 4), (16, 512, 4, True, True, 4),
                                              (32, 512, 4, True, True, 8)]  # 4 blocks of 512: split 4 at most
    # 4 rows: block_k 256, block_n 2048 x 4 / (4 x 256) = 8; 256 tiles -> split 4 (1024 >= 528)
    assert candidates(4, 2048, 8192, 132)[3:] == [(8, 256, 4, True, True, 4), (16, 256, 8, True, True, 8)]
    # 64 rows: 16 tiles of 128 -> split 16 (256 >= 132); 32 tiles of 64 -> split 8 (256)
    assert candidates(64, 2048, 8192, 132) == [(64, 128, 16, True, False, 4), (32, 256, 8, True, False, 4),
                                               (64, 128, 16, False, False, 4), (128, 64, 16, True, False, 8),
                                               (64, 128, 8, True, False, 8)]
    assert candidates(8, 250880, 2048, 132) == [(64, 128, 1, False, False, 4), (32, 256, 1, False, False, 4),
                                                (4, 256, 1, False, True, 4), (8, 256, 1, False, True, 8)]
    # K 256: the 64-wide blocks split once (two blocks a split), the 128-wide ones not at all
    assert candidates(64, 256, 256, 132) == [(64, 128, 1, False, False, 4), (32, 256, 1, False, False, 4),
                                             (128, 64, 2, True, False, 8), (64, 128, 1, False, False, 8)]


def test_bad_gemm_choices_are_named():
    from megatron.config import ModelConfig
    from megatron.inference import InferenceEngine
    from megatron.model import BloomModel
    model = BloomModel(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                   seq_length=16, attention_impl="torch"), parallel_output=False).eval()
    with pytest.raises(ValueError, match=r"^gemm='cublas' is not one of torch, triton, auto$"):
        InferenceEngine(model, max_batch_size=1, decode="fused", gemm="cublas")
    with pytest.raises(ValueError, match=r"^gemm='triton' needs decode='fused'"):
        InferenceEngine(model, max_batch_size=1, decode="unfused", gemm="triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match=r"^gemm='triton' needs CUDA and the triton package"):
            InferenceEngine(model, max_batch_size=1, decode="fused", gemm="triton")
    assert InferenceEngine(model, max_batch_size=1, decode="fused", gemm="auto").decoder.gemm == "torch"
    with pytest.raises(ValueError, match=r"^graph_step=True cannot capture sync_tokens"):
        InferenceEngine(model, max_batch_size=1, graph_step=True, sync_tokens=lambda t: t)
