"""pretrain_bloom.py with the faults MEGATRON_TEST_FAULT names passed in as a training callback (tests only).

    deepspeed --num_gpus 2 tests/train_with_faults.py <pretrain_bloom.py's flags>
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_bloom  # noqa: E402
from tests.faults import TestFaults  # noqa: E402

if __name__ == "__main__":
    pretrain_bloom.main(sys.argv[1:], callbacks=[TestFaults.from_env()])
