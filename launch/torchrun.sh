#!/usr/bin/env bash
# Launch a GNMR job with torchrun: one node, or many with a rendezvous. Both engines.
#
#   launch/torchrun.sh CONFIG [EXTRA...]
#
# CONFIG: a name under configs/ (demo_deepspeed, megatron/demo_cpu, ...) or a path; .json/.hjson
# runs the DeepSpeed job, .args the Megatron one. EXTRA goes to the job and overrides the config.
# Environment (all optional):
#   NPROC_PER_NODE   processes per node (default: the GPUs, or 1 on a CPU host)
#   NNODES           N or MIN:MAX (elastic)                       default 1
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (multi-node, any node order)
#   RDZV_ID          job id shared by all nodes                   default gnmr
#   RDZV_CONF        torchrun's rdzv_conf (is_host=1 on the endpoint's node when its hostname
#                    does not resolve to the endpoint's address)
#   MASTER_ADDR, MASTER_PORT, NODE_RANK   static multi-node rendezvous instead of RDZV_*
#   MAX_RESTARTS     torchrun restarts of the whole node group on a failure (jobs resume
#                    from their last checkpoint)                  default 0
#   LOCAL_ADDR       this node's address the other nodes reach (multi-homed nodes; gloo
#                    also wants GLOO_SOCKET_IFNAME, NCCL NCCL_SOCKET_IFNAME, on that link)
#   DRY_RUN=1        check and print the command, start nothing
# Every user error (unknown config, bad option, world size vs TP x PP, batch sizes) is reported
# before any process starts.
#
# Examples:
#   NPROC_PER_NODE=2 launch/torchrun.sh demo_deepspeed --steps 100
#   NPROC_PER_NODE=8 NNODES=4 RDZV_ENDPOINT=node-1:29500 RDZV_ID=exp1 \
#       launch/torchrun.sh megatron/llama2_130m_fp6_fp8 --train-iters 20000
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$PY" -m gnmr_dist.cli.launch torchrun "$@"
