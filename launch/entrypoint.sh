#!/usr/bin/env bash
# The container's entry point (docker/Dockerfile).
#
#   torchrun CONFIG [EXTRA...]            launch/torchrun.sh (env NPROC_PER_NODE, NNODES, ...)
#   deepspeed HOSTFILE CONFIG [EXTRA...]  launch/deepspeed.sh
#   check --world-size N CONFIG [EXTRA...]  validate only
#   list                                  the configs shipped in configs/
#   smoke                                 the image's smoke test (docker/smoke.sh)
#   anything else                         run as a command (bash, python, gnmr-report ...)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
case "${1:---help}" in
    torchrun) shift; exec "$here/torchrun.sh" "$@" ;;
    deepspeed) shift; exec "$here/deepspeed.sh" "$@" ;;
    check | list)
        # shellcheck source=launch/common.sh
        source "$here/common.sh"
        exec "$PY" -m gnmr_dist.cli.launch "$@"
        ;;
    smoke) shift; exec bash "$here/../docker/smoke.sh" "$@" ;;
    -h | --help)
        sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        ;;
    *) exec "$@" ;;
esac
