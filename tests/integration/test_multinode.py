"""Two nodes of two processes each, simulated on this machine, train exactly as one node of four.

The two-node job is what examples/multinode/ shows: one deepspeed launcher per node with the same hostfile,
`--no_ssh --node_rank N` and the rendezvous on node 0 (here 127.0.0.1). TP 2 x DP 2: each TP group must lie
inside a node (ranks 0-1 on node 0, 2-3 on node 1) and DP runs across the nodes. Each node has LOCAL_SIZE 2 of a
world of 4, the case in which DeepSpeed's CPU shared-memory all-reduce stays off (it needs every rank on one
host). A probe wraps pretrain_bloom.main to record, after iteration 1, each rank's node (the launcher's
CROSS_RANK) and its TP and DP groups with the nodes of their members (gathered over those groups). The example
scripts' flags are checked too: they resolve into a valid job for the example hostfile's 2 nodes of 8.

Not covered here: resuming a one-node checkpoint on two nodes (it depends on the optimizer-state layout of
megatron/checkpoint/optimizer_state.py).
"""
import glob
import json
import os
import subprocess

import pytest

from megatron.core.parallel_state import group_layout
from tests.launch import DEEPSPEED, ROOT, TINY_MODEL, TOKENIZER, _cleanup_shm, _free_port, env, read_losses, \
    run_pretrain

EXAMPLES = ROOT / "examples" / "multinode"

ITERS = 4
PROBE = """
import json, os, sys
import torch.distributed as dist
import pretrain_bloom
from megatron.training import Callback

class Probe(Callback):  # where each rank runs and who its TP and DP peers are, at iteration 1
    def on_iteration_end(self, trainer, iteration, loss):
        if iteration != 1:
            return
        state = trainer.state
        node = int(os.environ["CROSS_RANK"])
        tp_nodes, dp_nodes = [None] * state.tensor_model_parallel_size, [None] * state.data_parallel_size
        dist.all_gather_object(tp_nodes, node, group=state.tp_group)
        dist.all_gather_object(dp_nodes, node, group=state.dp_group)
        with open(os.path.join(os.environ["PROBE_DIR"], f"rank{state.rank}.json"), "w") as f:
            json.dump({"rank": state.rank, "node": node, "local_rank": int(os.environ["LOCAL_RANK"]),
                       "local_size": int(os.environ["LOCAL_SIZE"]), "world_size": dist.get_world_size(),
                       "tp_ranks": list(state.tp_ranks), "dp_ranks": list(state.dp_ranks),
                       "tp_nodes": tp_nodes, "dp_nodes": dp_nodes}, f)

pretrain_bloom.main(sys.argv[1:], callbacks=[Probe()])
"""


def train_args(sample_data, metrics):
    return TINY_MODEL + [
        "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(ITERS), "--lr", "1e-3", "--clip-grad", "1.0", "--data-path", sample_data,
        "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
        "--log-interval", "1", "--eval-iters", "0", "--metrics-file", str(metrics),
        "--deepspeed"]


def launch_two_nodes(tmp_path, args):
    """Both nodes' launchers at once, as `deepspeed --hostfile H --no_ssh --node_rank N` on each node would run."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (tmp_path / "probe").mkdir()
    port = _free_port()
    procs = []
    try:
        for node in (0, 1):
            cmd = [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
                   "127.0.0.1", "--master_port", str(port), str(probe)] + args
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env({"PROBE_DIR": str(tmp_path / "probe")}),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    shm_left = _cleanup_shm(port)
    for node, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return shm_left


@pytest.mark.slow
def test_two_nodes_train_like_one_node(tmp_path, sample_data):
    one_node = tmp_path / "one_node.jsonl"
    run_pretrain(train_args(sample_data, one_node), nproc=4)
    two_nodes = tmp_path / "two_nodes.jsonl"
    shm_left = launch_two_nodes(tmp_path, train_args(sample_data, two_nodes))

    expected, got = read_losses(one_node), read_losses(two_nodes)
    assert sorted(expected) == list(range(1, ITERS + 1))
    assert got == expected  # the same ranks, groups and data: bit for bit

    ranks = {}
    for path in glob.glob(str(tmp_path / "probe" / "rank*.json")):
        with open(path) as f:
            record = json.load(f)
        ranks[record["rank"]] = record
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, record in ranks.items():
        node = rank // 2
        assert (record["node"], record["local_rank"]) == (node, rank % 2), record
        assert (record["local_size"], record["world_size"]) == (2, 4), record
        assert record["tp_ranks"] == [2 * node, 2 * node + 1] and record["tp_nodes"] == [node, node], record
        assert record["dp_ranks"] == [rank % 2, rank % 2 + 2] and record["dp_nodes"] == [0, 1], record
    assert shm_left == []  # no shared-memory all-reduce buffers across "hosts"


@pytest.mark.slow
def test_one_node_checkpoint_resumes_on_two_nodes(tmp_path, sample_data):
    """Trained on one node (TP 2, DP 1: 2 processes) to iteration 2, resumed on two nodes (TP 2 inside a node, DP 2
    across them): the continuation equals the one-node TP 2 x DP 2 run within the layouts' tolerance."""
    straight = tmp_path / "straight.jsonl"
    run_pretrain(train_args(sample_data, straight), nproc=4)
    ckpt = str(tmp_path / "ckpt")
    first = tmp_path / "first.jsonl"
    run_pretrain(train_args(sample_data, first) + ["--save", ckpt, "--exit-interval", "2"], nproc=2)
    resumed = tmp_path / "resumed.jsonl"
    launch_two_nodes(tmp_path, train_args(sample_data, resumed) + ["--load", ckpt])

    expected, before, after = read_losses(straight), read_losses(first), read_losses(resumed)
    assert sorted(before) == [1, 2] and sorted(after) == [3, 4]
    for iteration, loss in {**before, **after}.items():  # TP 2 x DP 1 and TP 2 x DP 2 agree within 2e-5
        assert loss == pytest.approx(expected[iteration], abs=2e-5), (iteration, loss, expected[iteration])


def example_flags(extra_env):
    """TRAIN_FLAGS of examples/multinode/train_flags.sh under extra_env."""
    script = 'source examples/multinode/train_flags.sh && printf "%s\\0" "${TRAIN_FLAGS[@]}"'
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**os.environ, **extra_env}, capture_output=True,
                          text=True, check=True)
    return proc.stdout.split("\0")[:-1]


@pytest.mark.parametrize("tp, pp", [(4, 1), (4, 2)])
def test_example_flags_resolve_for_two_nodes_of_eight(sample_data, monkeypatch, tp, pp):
    """The examples' flags make a valid 16-process job (batch arithmetic, DeepSpeed JSON, layout) in which every
    TP group lies inside one node of examples/multinode/hostfile; the scripts are valid bash."""
    from megatron.arguments import load_and_resolve
    from deepspeed.launcher.runner import fetch_hostfile

    for script in ("train_flags.sh", "pretrain_pdsh.sh", "pretrain_no_ssh.sh", "pretrain_slurm.sbatch"):
        subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)
    hosts = fetch_hostfile(str(EXAMPLES / "hostfile"))
    assert dict(hosts) == {"node1": 8, "node2": 8}
    flags = example_flags({"TP": str(tp), "PP": str(pp), "DATA_PATH": sample_data, "TOKENIZER": str(TOKENIZER)})
    monkeypatch.setenv("WORLD_SIZE", "16")
    config, ds_config, _ = load_and_resolve(flags)
    dp = 16 // (tp * pp)
    assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size) == (tp, pp)
    assert ds_config["train_batch_size"] == 256 == ds_config["train_micro_batch_size_per_gpu"] * \
        ds_config["gradient_accumulation_steps"] * dp
    assert config.model.vocab_size == 250880 and config.model.num_layers == 24
    node_of = [node for node, slots in enumerate(hosts.values()) for _ in range(slots)]
    layout = group_layout(16, tp, pp)
    assert all(len({node_of[rank] for rank in group}) == 1 for group in layout["tp"])
    assert all(len({node_of[rank] for rank in group}) == 2 for group in layout["dp" if pp == 1 else "pp"])
