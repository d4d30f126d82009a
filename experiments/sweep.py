"""Expands a grid over config fields into launch commands, one run per point.

    python experiments/sweep.py --grid grpo.mode=nodewise,trajectory grpo.topk=0,2 seed=0,1 \\
        [--config experiments/configs/assistant_tiny.py] [--launcher launch/local.sh] [--run]

Each point gets its own workdir under --root (named by its values); --run executes the
commands one after the other, otherwise they are printed (pipe them to a scheduler).
"""

import argparse
import itertools
import shlex
import subprocess
import sys


def commands(grid: list[str], config: str, root: str, launcher: str) -> list[str]:
    axes = [(key, values.split(",")) for key, _, values in (g.partition("=") for g in grid)]
    out = []
    for point in itertools.product(*[values for _, values in axes]):
        name = "_".join(f"{key.split('.')[-1]}-{v}" for (key, _), v in zip(axes, point))
        overrides = [f"--config.{key}={v}" for (key, _), v in zip(axes, point)]
        out.append(shlex.join([*shlex.split(launcher), "train", f"--config={config}",
                               f"--workdir={root}/{name}", *overrides]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", nargs="+", required=True, help="field=v1,v2,... (dotted fields)")
    p.add_argument("--config", default="experiments/configs/assistant_tiny.py")
    p.add_argument("--root", default="runs/sweep")
    p.add_argument("--launcher", default="joyagents", help="e.g. launch/local.sh")
    p.add_argument("--run", action="store_true", help="run the commands one after the other")
    args = p.parse_args(argv)
    for cmd in commands(args.grid, args.config, args.root, args.launcher):
        print(cmd, flush=True)
        if args.run and subprocess.call(cmd, shell=True):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
