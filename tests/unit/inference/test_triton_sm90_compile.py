"""The decode kernels compiled for the H100/H200 (sm_90) on the CPU, without a GPU: Triton's front end type-checks
every branch and the back end lowers the IR to a cubin, which the interpreter the other tests use does neither of
(a variable of two shapes in two branches, a loop the pipeliner cannot lower). Every launch the engine and the
decode sweep make at the 1.72B model's shapes: each GEMM candidate plan (skinny_gemm.candidates) with its prologue
and epilogue, and the decode attention's configurations."""
import pytest

import torch

triton = pytest.importorskip("triton")

from megatron.inference.decode import triton_next_power_of_2  # noqa: E402
from megatron.inference.skinny_gemm import GEMV_ROWS, candidates, kernel_meta  # noqa: E402

SMS = 132  # the H100/H200 SXM


def compile_sm90(kernel, pointers, meta, floats=("eps", "scale")):
    """kernel compiled for sm_90: pointers {argument: Triton type}, meta: its constexprs, num_warps, num_stages;
    the other arguments are 32-bit integers (or fp32 for `floats`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = {key: meta[key] for key in ("num_warps", "num_stages") if key in meta}
    constants = {key: value for key, value in meta.items() if key not in options}
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in floats else "i32")
                 for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)


# (label, N, K, LayerNorm in the prologue up to GEMV_ROWS rows, bias, GeLU, residual): the fused step's GEMMs
SHAPES = [("qkv", 6144, 2048, True, True, False, False), ("dense", 2048, 2048, False, True, False, True),
          ("h->4h", 8192, 2048, True, True, True, False), ("4h->h", 2048, 8192, False, True, False, True),
          ("LM head", 250880, 2048, True, False, False, False)]


def gemm_launches():
    metas = {}
    for label, n, k, ln, bias, gelu, residual in SHAPES:
        for rows in (1, 8, 64):
            for plan in candidates(rows, n, k, SMS):
                meta = kernel_meta(rows, n, k, torch.bfloat16, *plan, ln=ln and rows <= GEMV_ROWS, HAS_BIAS=bias,
                                   GELU=gelu, RESIDUAL=residual, interpreted=False)
                metas.setdefault(tuple(sorted(meta.items())), f"{label} rows {rows} {plan}")
    return [pytest.param(dict(key), id=name) for key, name in metas.items()]


@pytest.mark.parametrize("meta", gemm_launches())
def test_gemm_plans_compile_for_sm90(meta):
    from megatron.inference.triton_gemm import skinny_gemm_kernel
    pointers = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr", "g_ptr", "beta_ptr"), "*bf16")
    compiled = compile_sm90(skinny_gemm_kernel, dict(pointers, part_ptr="*fp32", lock_ptr="*i32"), meta)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("label, n, k, ln, bias, gelu, residual", SHAPES[:4], ids=[s[0] for s in SHAPES[:4]])
def test_gemm_plans_compile_as_programmatic_dependent_launches(label, n, k, ln, bias, gelu, residual):
    """The PDL variant choose_plan times on Hopper (pdl=True): griddepcontrol.wait before the kernel's first global
    read, then griddepcontrol.launch_dependents."""
    from megatron.inference.triton_gemm import skinny_gemm_kernel
    pointers = dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr", "g_ptr", "beta_ptr"), "*bf16")
    for rows in (1, 64):
        plan = candidates(rows, n, k, SMS)[-1]  # a GEMV plan at 1 row, a dot at 64
        meta = kernel_meta(rows, n, k, torch.bfloat16, *plan, ln=ln and rows <= GEMV_ROWS, HAS_BIAS=bias, GELU=gelu,
                           RESIDUAL=residual, interpreted=False, pdl=True)
        ptx = compile_sm90(skinny_gemm_kernel, dict(pointers, part_ptr="*fp32", lock_ptr="*i32"), meta).asm["ptx"]
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < launch < ptx.find("ld.global"), (label, rows, plan, wait, launch)


# (keys per iteration, warps, prefetch, most splits, merged in the kernel): one split (batch 64), several merged
# by the last split or by the combine kernel, the small and prefetching launches the decode sweep times
ATTENTION = [(64, 4, False, 1, False), (64, 4, False, 5, True), (64, 4, False, 5, False), (32, 4, True, 1, False),
             (64, 4, True, 4, True), (64, 8, True, 2, True), (128, 8, False, 1, False), (16, 1, False, 1, False),
             (16, 1, False, 2, True), (16, 4, False, 1, False), (16, 2, True, 4, True)]


@pytest.mark.parametrize("block_n, warps, prefetch, splits, last_combines", ATTENTION)
def test_decode_attention_compiles_for_sm90(block_n, warps, prefetch, splits, last_combines):
    from megatron.inference.triton_decode import combine_kernel, decode_attention_kernel
    pointers = dict(qkv_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16", out_ptr="*bf16", slots_ptr="*i64",
                    pos_ptr="*i64", slopes_ptr="*fp32", part_ptr="*fp32", stat_ptr="*fp32", lock_ptr="*i32")
    sizes = dict(HD=128, MIN_KEYS=block_n, NUM_SPLITS=splits, SPLITS_P2=triton_next_power_of_2(splits))
    assert compile_sm90(decode_attention_kernel, pointers, dict(sizes, BLOCK_N=block_n, LAST_COMBINES=last_combines,
                                                                PREFETCH=prefetch, num_warps=warps)).asm["cubin"]
    if splits > 1 and not last_combines:
        assert compile_sm90(combine_kernel, pointers, sizes).asm["cubin"]
