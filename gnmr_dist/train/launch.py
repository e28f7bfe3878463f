"""``gnmr-launch``: check a GNMR training job, then start it with torchrun or DeepSpeed's launcher.

    gnmr-launch torchrun  [--nproc-per-node N] [--nnodes N] ... CONFIG [EXTRA...]
    gnmr-launch deepspeed --hostfile FILE [--num-nodes N] [--num-gpus N] ... CONFIG [EXTRA...]
    gnmr-launch check     --world-size N CONFIG [EXTRA...]
    gnmr-launch list

(the scripts in ``launch/`` call these). ``CONFIG`` is a file or a name under ``configs/``
(``demo_deepspeed``, ``megatron/llama2_60m_act_quant``; the extension may be left out). Its type
picks the engine:

- ``.json`` / ``.hjson``: a DeepSpeed config with a ``"gnmr"`` block (and an optional
  ``"pretrain"`` block of defaults) for ``gnmr_dist.cli.ds_pretrain``;
- ``.args``: a Megatron-LM argument set for ``gnmr_dist.cli.megatron_pretrain`` (Megatron-LM's
  ``pretrain_gpt.py`` flags plus ``--gnmr-*``) -- the options one per line or several per line,
  ``#`` comments, ``$VAR`` / ``${VAR}`` taken from the environment (an unset variable is an
  error); input paths (``--gnmr-config``, ``--data-path``, tokenizer files: ``PATH_FLAGS``) are
  relative to the set's file, outputs to the working directory.

``EXTRA`` is passed through to the engine after the config's own arguments, so it overrides
them. Everything a user can get wrong is checked in this process, before any worker starts: the
config exists and parses, every engine option and the ``"gnmr"`` block are valid, the world size the
launch would create (``nproc x nnodes``, or the hostfile's slots) is divisible by tensor x
pipeline parallel size and agrees with DeepSpeed's batch sizes, the hostfile exists and parses,
a multi-node launch names a rendezvous. On an error it exits with status 2 and starts nothing.
Then it replaces itself (``exec``) with the launcher, so signals from a scheduler reach it.

Defaults come from the environment variables multi-node scripts already set (``NPROC_PER_NODE``,
``NNODES``, ``MASTER_ADDR``, ``RDZV_ENDPOINT``, ...: the table in docs/launch.md); ``DRY_RUN=1``
prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gnmr_dist.core.validation import did_you_mean

ENGINES = {
    "deepspeed": "gnmr_dist.cli.ds_pretrain",
    "megatron": "gnmr_dist.cli.megatron_pretrain",
}
_SUFFIX_ENGINE = {".json": "deepspeed", ".hjson": "deepspeed", ".args": "megatron"}
_LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname()}
_VAR = re.compile(r"\$(\w+|\{\w+\})")


class LaunchError(ValueError):
    """A user error found before any process started."""


@dataclass(frozen=True)
class Job:
    """What to run: the engine module and its full argument list."""

    config: Path
    engine: str
    args: tuple[str, ...]

    @property
    def module(self) -> str:
        return ENGINES[self.engine]


# ====================================================================== configs


def config_dirs() -> list[Path]:
    """Where config names are looked up: ``$GNMR_CONFIG_DIR``, ``./configs``, the repository's
    ``configs/`` (a checkout), the ``configs`` folder inside the installed package (a wheel)."""
    dirs = [Path(d) for d in os.environ.get("GNMR_CONFIG_DIR", "").split(os.pathsep) if d]
    package = Path(__file__).resolve().parents[1]
    dirs += [Path.cwd() / "configs", package.parent / "configs", package / "configs"]
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.append(d.resolve())
    return seen


def available_configs() -> list[str]:
    """Every launchable config, relative to its directory (``gnmr/`` holds blocks, not jobs)."""
    names = set()
    for d in config_dirs():
        for path in d.rglob("*"):
            rel = path.relative_to(d)
            if path.suffix in _SUFFIX_ENGINE and path.is_file() and rel.parts[0] != "gnmr":
                names.add(str(rel))
    return sorted(names)


def resolve_config(name: str) -> Path:
    """The config file ``name`` refers to: a path, or a name under a config directory."""
    candidates = [Path(name)] + [d / name for d in config_dirs()]
    for base in candidates:
        for path in (base, *(base.with_name(base.name + s) for s in _SUFFIX_ENGINE)):
            if path.is_file():
                if path.suffix not in _SUFFIX_ENGINE:
                    raise LaunchError(
                        f"config {name}: {path.suffix or 'no'} extension; expected "
                        ".json/.hjson (DeepSpeed) or .args (Megatron argument set)"
                    )
                return path
    known = available_configs()
    hint = did_you_mean(name, known, n=3, quote=False)
    raise LaunchError(
        f"unknown config {name!r}{hint} (known: {', '.join(known) or 'none'}; or give a path)"
    )


def read_args_file(path: Path) -> list[str]:
    """A Megatron argument set: shell-like words, ``#`` comments, environment variables."""
    words: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for word in shlex.split(line, comments=True):
            missing = [v.strip("{}") for v in _VAR.findall(word) if v.strip("{}") not in os.environ]
            if missing:
                raise LaunchError(
                    f"{path}:{number}: environment variable {missing[0]} is not set "
                    f"(export {missing[0]}=... before launching)"
                )
            words.append(os.path.expandvars(word))
    return words


PATH_FLAGS = frozenset(
    {
        "--gnmr-config",
        "--data-path",
        "--train-data-path",
        "--valid-data-path",
        "--test-data-path",
        "--data-args-path",
        "--per-split-data-args-path",
        "--tokenizer-model",
        "--vocab-file",
        "--merge-file",
    }
)
"""Megatron-LM / GNMR flags whose values are input files (or data prefixes): in an ``.args``
set they are relative to the set's file. Outputs (``--save``, ``--tensorboard-dir``,
``--gnmr-trace``) stay relative to the working directory, where the job runs."""


def resolve_paths(words: Sequence[str], base: Path) -> list[str]:
    """``words`` with every relative value of a :data:`PATH_FLAGS` flag joined to ``base``.

    A flag's values are the words up to the next ``--flag``; numbers among them are blend
    weights (``--data-path 0.7 a 0.3 b``) and stay as they are.
    """
    out, flag = [], None
    for word in words:
        if word.startswith("--"):
            flag = word
        elif flag in PATH_FLAGS and not _is_number(word) and not Path(word).is_absolute():
            word = os.path.normpath(base.resolve() / word)
        out.append(word)
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def build_job(config: str, extra: Sequence[str]) -> Job:
    path = resolve_config(config)
    engine = _SUFFIX_ENGINE[path.suffix]
    if engine == "megatron":
        return Job(path, engine, (*resolve_paths(read_args_file(path), path.parent), *extra))
    return Job(path, engine, ("--config", str(path), *extra))


def check_job(job: Job, world_size: int, check_host: bool = True) -> None:
    """Run the engine's own argument checks for ``world_size`` processes, in this process.

    ``check_host=False`` leaves out what depends on this machine (CUDA, Transformer Engine), for
    checking a GPU job on a login node. Besides the arguments, what the run refuses when it
    builds its model is checked on a model built on the meta device (no memory, no weights):
    the units ``include``/``exclude`` select (:func:`check_ds_units`; Megatron-LM:
    :func:`~gnmr_dist.train.megatron_flags.check_units`). Installed backend plug-ins are loaded
    first, as every run loads them, so one that fails to import is warned about here too.
    """
    from gnmr_dist.backends.registry import load_entry_points

    load_entry_points()  # outside the redirect: its warning reaches the terminal
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            if job.engine == "megatron":
                from gnmr_dist.train.megatron_lm import check_args

                check_args(list(job.args), world_size=world_size, check_host=check_host)
            else:
                from gnmr_dist.train.ds_pretrain import parse_args as ds_args

                check_ds_units(
                    ds_args(list(job.args), world_size=world_size, check_host=check_host)
                )
    except ValueError as err:
        raise LaunchError(f"{job.config} ({job.engine}): {err}") from None
    except SystemExit as stop:
        if stop.code:
            lines = [x for x in stderr.getvalue().splitlines() if x.strip()]
            message = lines[-1] if lines else f"exit status {stop.code}"
            raise LaunchError(f"{job.config} ({job.engine}): {message}") from None


def check_ds_units(args: argparse.Namespace) -> None:
    """``ValueError`` when the ``"gnmr"`` block selects no unit of the model
    ``gnmr-ds-pretrain`` builds from ``args`` (its parsed options), with the message
    ``gnmr_dist.deepspeed.initialize`` refuses the run with.

    The model is built on the meta device from the shape options (``--init-from``: from the
    directory's ``config.json``; ``--lora-rank``: with its adapters), so a 13B config is checked
    in a second; unit names do not depend on the vocabulary size.
    """
    block = args.gnmr_block
    if not block.enabled or not (block.include or block.exclude):
        return  # the default selection is every unit inside a layer: a Llama has them
    import torch

    from gnmr_dist.train.ds_pretrain import build_model

    shape, vocab = args, args.vocab_size or 256
    if args.init_from is not None:  # from_pretrained refuses the meta device: its config's shape
        from transformers import LlamaConfig

        cfg = LlamaConfig.from_pretrained(args.init_from, local_files_only=True)
        shape = argparse.Namespace(
            **{
                **vars(args),
                "init_from": None,
                "layers": cfg.num_hidden_layers,
                "hidden": cfg.hidden_size,
                "heads": cfg.num_attention_heads,
                "kv_heads": cfg.num_key_value_heads,
                "ffn": cfg.intermediate_size,
            }
        )
        vocab = cfg.vocab_size
    with torch.device("meta"):
        model = build_model(shape, vocab)
    block.check_units(model)


# ====================================================================== launchers


def parse_hostfile(path: str) -> dict[str, int]:
    """Hosts and slots, read with DeepSpeed's own parser (its launcher warns and runs locally)."""
    if not Path(path).is_file():
        raise LaunchError(
            f"hostfile {path} does not exist; write one line per node, e.g. "
            "'node-1 slots=8' (the DeepSpeed launcher would silently run on this host only)"
        )
    from deepspeed.launcher.runner import _parse_hostfile

    try:
        return dict(_parse_hostfile(Path(path).read_text().splitlines()))
    except ValueError as err:
        raise LaunchError(f"hostfile {path}: {err}") from None


def _nnodes_range(nnodes: str) -> tuple[int, int]:
    try:
        low, _, high = nnodes.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise LaunchError(f"--nnodes {nnodes!r}: expected N or MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise LaunchError(f"--nnodes {nnodes!r}: need 1 <= MIN <= MAX")
    return lo, hi


def torchrun_command(a: argparse.Namespace, job: Job) -> tuple[list[str], list[int]]:
    """The torchrun command and the world sizes it may create (elastic: min and max)."""
    lo, hi = _nnodes_range(a.nnodes)
    nproc = a.nproc_per_node or _local_devices()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--nnodes", a.nnodes, "--max_restarts", str(a.max_restarts)]
    endpoint = a.rdzv_endpoint
    if not endpoint and a.max_restarts > 0 and (a.master_addr or a.master_port):
        # a static rendezvous hands a restarted group the store of the failed attempt (stale
        # keys: the restart can hang); a c10d rendezvous starts a fresh round per restart
        endpoint = f"{a.master_addr or '127.0.0.1'}:{a.master_port or 29500}"
    if a.rdzv_conf and not endpoint:
        raise LaunchError(
            f"RDZV_CONF={a.rdzv_conf!r} configures a c10d rendezvous, but this launch has none: "
            "set RDZV_ENDPOINT=host:port, or drop RDZV_CONF"
        )
    if a.local_addr:
        cmd += ["--local_addr", a.local_addr]
    if endpoint:
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", a.rdzv_id]
        if a.rdzv_conf:
            cmd += ["--rdzv_conf", a.rdzv_conf]
    elif hi > 1 or a.master_addr:
        if not a.master_addr or a.node_rank is None:
            raise LaunchError(
                f"--nnodes {a.nnodes}: a multi-node launch needs RDZV_ENDPOINT=host:port "
                "(c10d rendezvous, any node order) or MASTER_ADDR and NODE_RANK (static)"
            )
        cmd += ["--master_addr", a.master_addr, "--master_port", str(a.master_port or 29500)]
        cmd += ["--node_rank", str(a.node_rank)]
    elif a.master_port:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(a.master_port)]
    else:
        cmd += ["--standalone"]
    cmd += ["-m", job.module, *job.args]
    return cmd, sorted({lo * nproc, hi * nproc})


def deepspeed_command(a: argparse.Namespace, job: Job) -> tuple[list[str], list[int]]:
    """The DeepSpeed launcher command for the hostfile, and the world size it creates."""
    if not a.hostfile:
        raise LaunchError("the deepspeed launcher needs --hostfile FILE (or HOSTFILE=...)")
    hosts = parse_hostfile(a.hostfile)
    if a.num_nodes is not None:
        if not 1 <= a.num_nodes <= len(hosts):
            raise LaunchError(
                f"--num-nodes {a.num_nodes}: the hostfile {a.hostfile} lists {len(hosts)} host(s)"
            )
        hosts = dict(list(hosts.items())[: a.num_nodes])
    slots = [min(n, a.num_gpus) if a.num_gpus else n for n in hosts.values()]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", a.hostfile]
    cmd += ["--master_port", str(a.master_port or 29500)]
    if a.num_nodes is not None:
        cmd += ["--num_nodes", str(a.num_nodes)]
    if a.num_gpus:
        cmd += ["--num_gpus", str(a.num_gpus)]
    if len(hosts) == 1 and next(iter(hosts)) in _LOCAL_HOSTS:
        cmd += ["--no_ssh_check", "--master_addr", a.master_addr or "127.0.0.1"]  # no ssh to self
    elif a.master_addr:
        cmd += ["--master_addr", a.master_addr]
    cmd += ["--no_local_rank", "--module", job.module, *job.args]
    return cmd, [sum(slots)]


def _local_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


# ====================================================================== command line


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gnmr-launch", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="launcher", required=True)
    t = sub.add_parser("torchrun", help="single node, or multi-node with a rendezvous")
    t.add_argument("--nproc-per-node", type=int, default=_int_env("NPROC_PER_NODE"))
    t.add_argument("--nnodes", default=_env("NNODES", "1"), help="N or MIN:MAX")
    t.add_argument("--node-rank", type=int, default=_int_env("NODE_RANK"))
    t.add_argument("--master-addr", default=_env("MASTER_ADDR"))
    t.add_argument("--master-port", type=int, default=_int_env("MASTER_PORT"))
    t.add_argument("--rdzv-endpoint", default=_env("RDZV_ENDPOINT"), help="host:port (c10d)")
    t.add_argument("--rdzv-id", default=_env("RDZV_ID", "gnmr"))
    t.add_argument(
        "--rdzv-conf",
        default=_env("RDZV_CONF"),
        help="torchrun's rdzv_conf, e.g. is_host=1 on the endpoint's node",
    )
    t.add_argument("--max-restarts", type=int, default=_int_env("MAX_RESTARTS") or 0)
    t.add_argument(
        "--local-addr",
        default=_env("LOCAL_ADDR"),
        help="this node's address the others reach (multi-homed nodes)",
    )
    d = sub.add_parser("deepspeed", help="the DeepSpeed launcher with a hostfile (pdsh/ssh)")
    d.add_argument("--hostfile", default=_env("HOSTFILE"))
    d.add_argument("--num-nodes", type=int, default=None)
    d.add_argument("--num-gpus", type=int, default=None, help="processes per node (slots cap)")
    d.add_argument("--master-addr", default=_env("MASTER_ADDR"))
    d.add_argument("--master-port", type=int, default=_int_env("MASTER_PORT"))
    c = sub.add_parser(
        "check", help="only check CONFIG + EXTRA for a world size (not this host's GPUs)"
    )
    c.add_argument("--world-size", type=int, required=True)
    for q in (t, d, c):
        q.add_argument("--dry-run", action="store_true", default=_env("DRY_RUN", "0") == "1")
        q.add_argument("config", help="a name under configs/ or a path")
        q.add_argument("extra", nargs=argparse.REMAINDER, help="passed to the engine")
    sub.add_parser("list", help="the configs that can be named")
    return p


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"gnmr-launch: {name}={value!r} is not an integer") from None


def plan(a: argparse.Namespace) -> list[str]:
    """Check everything and return the command to exec (raises ``LaunchError``)."""
    extra = a.extra[1:] if a.extra[:1] == ["--"] else a.extra
    job = build_job(a.config, extra)
    if job.engine == "megatron":
        # Megatron-LM's validate_args requires it with TP or CP > 1 (the kernel-ordering
        # guarantee its overlapped communication needs); its example scripts export it too.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if a.launcher == "check":
        sizes, cmd = [a.world_size], list[str]()
    elif a.launcher == "torchrun":
        cmd, sizes = torchrun_command(a, job)
    else:
        cmd, sizes = deepspeed_command(a, job)
    for world in sizes:
        if world < 1:
            raise LaunchError(f"world size {world}: need at least one process")
        check_job(job, world, check_host=a.launcher != "check")
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.launcher == "list":
        print("\n".join(available_configs()))
        return 0
    try:
        cmd = plan(a)
    except LaunchError as err:
        print(f"gnmr-launch: {err}\ngnmr-launch: nothing was started", file=sys.stderr)
        return 2
    if a.launcher == "check" or a.dry_run:
        print(shlex.join(cmd) if cmd else f"gnmr-launch: {a.config} is valid")
        return 0
    if a.launcher == "torchrun" and a.max_restarts > 0:
        # torch shares the rendezvous TCPStore with the workers, and a restarted group then
        # reads the previous attempt's addresses (pytorch/pytorch#135712, #167288): a restart
        # never connects. A separate store per attempt avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # pragma: no cover - exec does not return
