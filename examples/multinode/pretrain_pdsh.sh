#!/usr/bin/env bash
# BLOOM 1.7B on several nodes with one command, run on the first node of the hostfile: DeepSpeed's launcher
# starts every node's processes over passwordless ssh (pdsh must be installed on this node; the repository, its
# venv and the data at the same path on every node).
#
#   MASTER_ADDR=node1 DATA_PATH=/shared/c4_en_text_document TOKENIZER=/shared/bloom_tokenizer \
#       bash examples/multinode/pretrain_pdsh.sh [more pretrain_bloom.py flags]
#
# HOSTFILE (default examples/multinode/hostfile) lists the nodes; MASTER_ADDR is the first one's address as the
# others reach it; MASTER_PORT defaults to 29500. Environment variables reach the other nodes only through
# ./.deepspeed_env (NAME=value lines) or the launcher's own list (NCCL_*, PYTHON*, UCX_*, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/multinode/train_flags.sh
exec "${DEEPSPEED:-deepspeed}" --hostfile "${HOSTFILE:-examples/multinode/hostfile}" \
  --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}" \
  --master_port "${MASTER_PORT:-29500}" pretrain_bloom.py "${TRAIN_FLAGS[@]}" "$@"
