# shellcheck shell=bash
# Sourced by the launch scripts: picks the Python that has gnmr_dist installed.
# $PYTHON wins; else this checkout's .venv (made by `make test` / `make demo`); else python3.
_gnmr_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$_gnmr_root/.venv/bin/python" ]]; then
    PY="$_gnmr_root/.venv/bin/python"
else
    PY="python3"
fi
export PY
export GNMR_CONFIG_DIR="${GNMR_CONFIG_DIR:-$_gnmr_root/configs}"
