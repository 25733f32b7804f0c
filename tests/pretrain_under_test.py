"""pretrain_bloom.py as the tests launch it (tests only): pretrain_bloom.main with the faults MEGATRON_TEST_FAULT
names passed in as a training callback (tests/faults.py), and, under MEGATRON_TEST_FP16_ON_CPU=1, DeepSpeed's CPU
fp16 check answered yes.

    MEGATRON_TEST_FAULT="kill_at=3:rank=1" deepspeed --num_gpus 2 tests/pretrain_under_test.py <pretrain_bloom.py's flags>

fp16 on CPU: DeepSpeed's CPU accelerator refuses fp16 when oneDNN does not report fp16 support
(torch.ops.mkldnn._is_mkldnn_fp16_supported() is False on CPUs without AVX512-FP16/AMX-FP16, as CI's), although
torch runs fp16 on any CPU; everything but that capability answer is the real run.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FP16_ON_CPU_ENV = "MEGATRON_TEST_FP16_ON_CPU"


def main(argv):
    if os.environ.get(FP16_ON_CPU_ENV) == "1":
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    import pretrain_bloom
    from tests.faults import TestFaults
    return pretrain_bloom.main(argv, callbacks=[TestFaults.from_env()])


if __name__ == "__main__":
    main(sys.argv[1:])
