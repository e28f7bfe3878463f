#!/usr/bin/env bash
# The image's smoke test (`docker run --gpus all gnmr-dist smoke`), also run by CI on CPU with
# the repository's .venv (tests/docker/test_image.py):
#
#   bash docker/smoke.sh
#
# 1. versions of python, torch, deepspeed, megatron.core, transformers and gnmr_dist;
# 2. Transformer Engine, when a CUDA device is visible (the image promises it: missing is a
#    failure); without CUDA it is skipped;
# 3. imports gnmr_dist.deepspeed and megatron_patches, and builds every precision backend this
#    host can run with gnmr_dist.backends.get_backend (te_fp8 only on a GPU with FP8, sm_89+);
# 4. a real 2-process DeepSpeed training of a tiny Llama under GNMR (gloo on CPU, NCCL on GPU;
#    one process per GPU, so 1 on a single-GPU host), then checks its summary.json and
#    checkpoint/latest, and draws its report with gnmr-report.
#
# Environment: PYTHON (the interpreter; default: this checkout's .venv/bin/python if there is
# one, else python3), SMOKE_NPROC (processes; default 2, at most the GPUs on a GPU host),
# SMOKE_STEPS (default 6), SMOKE_KEEP=1 (keep the temporary run folder and say where).
# Exits non-zero on the first failure, with the reason on stderr.
set -euo pipefail

say() { printf '[smoke] %s\n' "$*"; }
fail() {
    printf '[smoke] FAIL: %s\n' "$*" >&2
    exit 1
}

if [[ $# -gt 0 ]]; then
    case "$1" in
        -h | --help)
            sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) fail "takes no arguments (got: $*); see --help" ;;
    esac
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# PY: $PYTHON, else this checkout's .venv/bin/python, else python3 (the image has launch/ too)
# shellcheck source=launch/common.sh
source "$root/launch/common.sh"
command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter '$PY' (set PYTHON)"
steps="${SMOKE_STEPS:-6}"
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || fail "SMOKE_STEPS must be a positive integer, got '$steps'"
start=$SECONDS

tmp="$(mktemp -d "${TMPDIR:-/tmp}/gnmr-smoke.XXXXXX")"
cleanup() {
    if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then
        say "kept $tmp"
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT

# ---------------------------------------------------------------- 1-3: versions, imports, backends
say "interpreter: $PY"
# The last line of this block is the number of processes to train with.
if ! "$PY" - "${SMOKE_NPROC:-}" >"$tmp/env.txt" 2>"$tmp/env.err" <<'PYEOF'; then
import importlib
import sys
import warnings

warnings.filterwarnings("ignore")  # megatron warns at import when TE/apex are absent (CPU)


def out(line):
    print(f"[smoke] {line}", flush=True)


def die(line):
    out(f"FAIL: {line}")
    sys.exit(1)


out(f"python {sys.version.split()[0]} ({sys.executable})")
try:
    import torch
except Exception as err:
    die(f"import torch: {err}")
cuda = torch.cuda.is_available()
gpus = torch.cuda.device_count() if cuda else 0
where = f"CUDA {torch.version.cuda}, {gpus} GPU(s)" if cuda else "CPU only"
out(f"torch {torch.__version__} ({where})")
for name in ("deepspeed", "megatron.core", "transformers", "gnmr_dist"):
    try:
        module = importlib.import_module(name)
    except Exception as err:
        die(f"import {name}: {type(err).__name__}: {err}")
    out(f"{name} {getattr(module, '__version__', '?')}")

fp8 = False
if cuda:
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:
        die(f"CUDA is available but Transformer Engine does not import ({err})")
    major, minor = torch.cuda.get_device_capability(0)
    fp8 = (major, minor) >= (8, 9)
    name = torch.cuda.get_device_name(0)
    out(f"transformer_engine {getattr(te, '__version__', '?')} ({name}, sm_{major}{minor})")
else:
    out("transformer_engine: skipped (no CUDA device)")

for name in ("gnmr_dist.deepspeed", "megatron_patches"):
    try:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):  # megatron_patches loads its modules lazily
            getattr(module, public)
    except Exception as err:
        die(f"import {name}: {type(err).__name__}: {err}")
    out(f"import {name}: ok")

from gnmr_dist.backends import BACKENDS, get_backend

for name in sorted(BACKENDS):
    if name == "te_fp8" and not fp8:
        why = "no CUDA device" if not cuda else "this GPU has no FP8 (needs sm_89+)"
        out(f"backend {name}: skipped ({why})")
        continue
    try:
        backend = get_backend(name)
    except Exception as err:
        die(f"backend {name}: {type(err).__name__}: {err}")
    out(f"backend {name}: ok ({type(backend).__name__})")

want = sys.argv[1]
if want and not (want.isdigit() and int(want) > 0):
    die(f"SMOKE_NPROC must be a positive integer, got {want!r}")
nproc = int(want) if want else (min(2, gpus) if cuda else 2)
if cuda and nproc > gpus:
    die(f"SMOKE_NPROC={nproc} but only {gpus} GPU(s): one process per GPU")
print(nproc)
PYEOF
    cat "$tmp/env.txt"
    tail -n 20 "$tmp/env.err" >&2
    fail "environment check (its output above)"
fi
sed '$d' "$tmp/env.txt"
nproc="$(tail -n 1 "$tmp/env.txt")"

# ---------------------------------------------------------------- 4: a real training run
run="$tmp/run"
say "training: $nproc processes, $steps steps (log: $tmp/train.log)"
if ! "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
    -m gnmr_dist.cli.ds_pretrain --config configs/demo_deepspeed.hjson --run-dir "$run" \
    --steps "$steps" --layers 2 --hidden 64 --seq-len 32 --max-bytes 200000 --no-progress \
    >"$tmp/train.log" 2>&1; then
    tail -n 40 "$tmp/train.log" >&2
    fail "training exited non-zero (last 40 lines of its log above)"
fi
grep -A 3 '^gnmr-ds-pretrain:' "$tmp/train.log" | sed 's/^/[smoke]   /' || true

[[ -f "$run/summary.json" ]] || fail "no $run/summary.json"
[[ -f "$run/checkpoint/latest" ]] || fail "no $run/checkpoint/latest"
"$PY" - "$run/summary.json" "$steps" "$nproc" <<'PYEOF' || fail "summary.json: not this run's"
import json
import math
import sys

s = json.load(open(sys.argv[1]))
steps, world = int(sys.argv[2]), int(sys.argv[3])
problems = []
if s.get("steps") != steps:
    problems.append(f"steps {s.get('steps')} != {steps}")
if s.get("world_size") != world:
    problems.append(f"world_size {s.get('world_size')} != {world}")
for key in ("first_loss", "last_loss", "heldout_loss"):
    if not isinstance(s.get(key), (int, float)) or not math.isfinite(s[key]):
        problems.append(f"{key} is {s.get(key)!r}")
if problems:
    print("[smoke] FAIL: summary.json: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"[smoke] summary.json: {steps} steps on {world} processes, backend {s.get('backend')}, "
      f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}")
PYEOF
say "checkpoint/latest: $(cat "$run/checkpoint/latest")"

"$PY" -m gnmr_dist.cli.report "$run" --out "$tmp/report.png" --title "gnmr-dist smoke" \
    >"$tmp/report.log" 2>&1 || {
    cat "$tmp/report.log" >&2
    fail "gnmr-report failed (output above)"
}
[[ -s "$tmp/report.png" ]] || fail "gnmr-report wrote no $tmp/report.png"
say "$(cat "$tmp/report.log")"

say "OK in $((SECONDS - start)) s"
