#!/bin/bash
# The same two-node run without SLURM: start this on each node with NODE_RANK 0 and 1
# and MASTER_ADDR the first node's address; torchrun's c10d rendezvous joins them.
#
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 bash examples/multinode/torchrun_rendezvous.sh
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 bash examples/multinode/torchrun_rendezvous.sh
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"
: "${NODE_RANK:?set NODE_RANK: 0 on the first node, 1 on the second}"
export OMP_NUM_THREADS=1

torchrun --nnodes=2 --nproc_per_node=8 --node_rank="$NODE_RANK" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:29500" --rdzv_id=recipes-llama-1b \
  -m recipes_lib.cli recipe=pretrain/llama_1b \
  strategy=hsdp trainer.devices=8 trainer.num_nodes=2 \
  run.dir=outputs/llama-1b-2x8
