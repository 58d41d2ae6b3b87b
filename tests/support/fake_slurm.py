"""Stand-ins for Slurm's `srun` and `scontrol`, so that an sbatch script runs on one machine as it would on
a cluster: `scontrol show hostnames` prints the comma-separated `$SLURM_JOB_NODELIST` one per line, and
`srun --ntasks=N ... CMD` starts N copies of CMD at once, each with its `SLURM_PROCID` (0 .. N-1),
forwards SIGTERM and SIGINT to them, and exits with the first non-zero status of theirs (or 0).

`srun` runs every task on this machine whatever `--nodelist` says: the "nodes" of a test share it, their
addresses are loopback."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

SRUN = """\
import os, signal, subprocess, sys
args = sys.argv[1:]
ntasks = 1
while args and args[0].startswith("-"):
    option = args.pop(0)
    if option.startswith("--ntasks="):
        ntasks = int(option.split("=", 1)[1])
children = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(i)}) for i in range(ntasks)]
def forward(sig, _):
    for child in children:
        if child.poll() is None:
            child.send_signal(sig)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
codes = [child.wait() for child in children]
sys.exit(next((c for c in codes if c != 0), 0))
"""

SCONTROL = """\
import os, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(os.environ["SLURM_JOB_NODELIST"].split(",")))
"""


def fake_slurm_bin(directory: Path) -> Path:
    """A directory holding executable `srun` and `scontrol` stand-ins (put it first on `PATH`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = directory / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


def slurm_env(bin_dir: Path, nodes: list[str], **extra: str) -> dict[str, str]:
    """This process's environment as an sbatch job on `nodes` sees it, with the stand-ins first on `PATH`."""
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SLURM_JOB_ID": "1",
        "SLURM_NNODES": str(len(nodes)),
        **extra,
    }
