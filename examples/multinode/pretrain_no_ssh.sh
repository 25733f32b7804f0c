#!/usr/bin/env bash
# BLOOM 1.7B on several nodes without ssh: run this on every node (by hand, or from a scheduler as
# pretrain_slurm.sbatch does), each with its own NODE_RANK; all read the same hostfile and meet at MASTER_ADDR.
#
#   node1$ NODE_RANK=0 MASTER_ADDR=node1 DATA_PATH=... TOKENIZER=... bash examples/multinode/pretrain_no_ssh.sh
#   node2$ NODE_RANK=1 MASTER_ADDR=node1 DATA_PATH=... TOKENIZER=... bash examples/multinode/pretrain_no_ssh.sh
#
# NODE_RANK is the node's line in HOSTFILE (default examples/multinode/hostfile), counting from 0 (under SLURM,
# $SLURM_NODEID); its launcher starts that line's slots as ranks slots*NODE_RANK... (LOCAL_RANK 0..slots-1).
# tests/integration/test_multinode.py runs this launch with two simulated nodes on one machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/multinode/train_flags.sh
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK to the line of this node in the hostfile, counting from 0}}
exec "${DEEPSPEED:-deepspeed}" --hostfile "${HOSTFILE:-examples/multinode/hostfile}" --no_ssh \
  --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}" \
  --master_port "${MASTER_PORT:-29500}" pretrain_bloom.py "${TRAIN_FLAGS[@]}" "$@"
