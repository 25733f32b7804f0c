"""Benchmark: the MLP's dgrad GEMM with GeLU's gradient in its cuBLASLt epilogue (megatron::gemm_dgelu) against the
ATen ops it replaces (mm, then gelu_backward), at the document's shapes: micro batch 4 x sequence 2048 = 8192 tokens,
hidden 2048, 4h 8192, bf16. Times are medians of CUDA-event timings (GPU time per call, microseconds); the last line
is what one training step's 8 micro batches x 24 layers would save. (In the training step the unfused side's
GeLU backward is a compiled-block kernel that also recomputes the GeLU; `tools/benchmark_training.py
--no-gemm-epilogues` is the A/B there.)

Run on a CUDA machine from the repo root: PYTHONPATH=$PWD python benchmarks/gemm_epilogues.py
"""
import argparse
import json

import torch

from benchmarks.fused_kernels import cuda_time_ms
from megatron.fused_kernels import gemm_epilogue, load_fused_kernels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers-x-micro-batches", type=int, default=24 * 8)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    load_fused_kernels(abort_on_unmet_constraints=True)
    m, h, f = args.tokens, args.hidden, 4 * args.hidden
    dy, w2, pre = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((m, h), (h, f), (m, f)))
    before = gemm_epilogue.fallbacks()
    unfused = 1e3 * cuda_time_ms(lambda: torch.ops.aten.gelu_backward(dy.mm(w2), pre, approximate="tanh"), 10, 50)
    fused = 1e3 * cuda_time_ms(lambda: torch.ops.megatron.gemm_dgelu(dy, w2, pre), 10, 50)
    assert gemm_epilogue.fallbacks() == before, "the epilogue fell back to ATen"
    saved_ms = (unfused - fused) * args.layers_x_micro_batches / 1e3
    print(f"4h->h dgrad + GeLU': mm + gelu_backward {unfused:.1f} us, DGELU epilogue {fused:.1f} us, "
          f"saved {unfused - fused:.1f} us per call, {saved_ms:.1f} ms per step "
          f"({args.layers_x_micro_batches} layer x micro-batch passes)")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "unfused_us": unfused, "epilogue_us": fused,
                       "step_saved_ms": saved_ms}, fh, indent=1)


if __name__ == "__main__":
    main()
