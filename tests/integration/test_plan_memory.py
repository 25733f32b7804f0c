"""The planner's parameter, gradient and optimizer bytes per rank equal what real engines hold.

One 4-process torchrun launch (gloo, CPU) builds pretrain_bloom.py's engine for each layout in turn
(tests/engine_state_bytes.py: load_and_resolve -> setup_engine -> one training step) and reports the bytes of
every storage each rank holds at the optimizer step, sorted into weights, gradients and optimizer state.
"""
import json
import subprocess

import pytest

from megatron.arguments import parse_args, resolve
from megatron.planning import memory
from tests.distributed import free_port
from tests.launch import ROOT, env

LAYOUTS = [f"{layout} --micro-batch-size 2{precision}"
           for precision in ("", " --bf16")
           for layout in ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 0",
                          "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1",
                          "--zero-stage 2", "--zero-stage 3")]


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    out = tmp_path_factory.mktemp("held") / "held.json"
    cmd = [str(ROOT / ".venv" / "bin" / "torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(ROOT / "tests" / "engine_state_bytes.py"), str(out), *LAYOUTS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def predicted(flags, stage, dp_rank):
    from tests.engine_state_bytes import TINY
    args = parse_args(TINY + flags.split())
    config, _ = resolve(args, 4, None, None, None)
    return memory.rank_model_states(config, stage, dp_rank)


@pytest.mark.parametrize("flags", LAYOUTS)
def test_model_state_bytes_per_rank(held, flags):
    ranks = held[flags]
    assert len(ranks) == 4
    for rank in ranks:
        states = predicted(flags, rank["pp_rank"], rank["dp_rank"])
        assert (rank["parameters"], rank["gradients"], rank["optimizer"]) == \
            (states.weights, states.gradients, states.optimizer), f"rank {rank['rank']} of {flags}"
