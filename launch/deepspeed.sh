#!/usr/bin/env bash
# Launch a GNMR job with the DeepSpeed launcher over the nodes of a hostfile (pdsh/ssh).
#
#   launch/deepspeed.sh HOSTFILE CONFIG [EXTRA...]
#
# HOSTFILE: DeepSpeed's format, one line per node: "node-1 slots=8". A single local host
# ("localhost slots=2") runs on this machine without ssh. CONFIG and EXTRA as in torchrun.sh.
# Environment: MASTER_ADDR, MASTER_PORT (default 29500), NUM_NODES / NUM_GPUS (use the first N
# hosts / at most N processes per host), DRY_RUN=1. Errors (missing or malformed hostfile,
# unknown config, world size vs TP x PP, batch sizes) are reported before anything starts.
#
# Example:
#   launch/deepspeed.sh hostfile deepspeed/llama2_60m_act_quant --steps 20000
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: launch/deepspeed.sh HOSTFILE CONFIG [EXTRA...]" >&2
    exit 2
fi
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
hostfile="$1"
shift
opts=(--hostfile "$hostfile")
[[ -n "${NUM_NODES:-}" ]] && opts+=(--num-nodes "$NUM_NODES")
[[ -n "${NUM_GPUS:-}" ]] && opts+=(--num-gpus "$NUM_GPUS")
exec "$PY" -m gnmr_dist.cli.launch deepspeed "${opts[@]}" "$@"
