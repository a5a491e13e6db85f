"""Sum py-spy's raw collapsed stacks: the share of samples in which each function appears.

    python bench/probes/stacks.py FILE... [--top 60] [--under FRAME] [--self] [--tree FRAME --depth 4]

Each line of a raw file is `frame;frame;... count`, outermost first. Prints the functions
(`name (file)`, line numbers dropped) by inclusive share of the samples, or by self share with
`--self`; `--under SUBSTRING` keeps only the samples with a frame containing it, and shares are then
of those samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_LINE = re.compile(r":\d+\)")


def frames_of(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rstrip("\n").rpartition(" ")
    return [_LINE.sub(")", f) for f in stack.split(";") if f], int(count or 0)


def summarise(paths: list[str], under: str, own: bool) -> tuple[int, collections.Counter[str]]:
    total, shares = 0, collections.Counter[str]()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            frames, count = frames_of(line)
            if not frames or (under and not any(under in f for f in frames)):
                continue
            total += count
            if own:
                shares[frames[-1]] += count
            else:
                for f in set(frames):
                    shares[f] += count
    return total, shares


def tree(paths: list[str], root: str, depth: int, floor: float) -> list[str]:
    """The calls under the first frame containing `root`, `depth` levels deep, as indented lines
    with their share of all samples (those under `floor` % left out)."""
    total, nodes = 0, collections.Counter[tuple[str, ...]]()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            frames, count = frames_of(line)
            total += count
            at = next((i for i, f in enumerate(frames) if root in f), None)
            if at is None:
                continue
            below = frames[at : at + depth + 1]
            for k in range(1, len(below) + 1):
                nodes[tuple(below[:k])] += count
    out = []

    def walk(prefix: tuple[str, ...]) -> None:
        kids = sorted((n for n in nodes if len(n) == len(prefix) + 1 and n[: len(prefix)] == prefix), key=nodes.get)
        for node in reversed(kids):
            share = 100 * nodes[node] / max(total, 1)
            if share >= floor:
                out.append(f"{share:6.1f} %  {'  ' * len(prefix)}{node[-1]}")
                walk(node)

    walk(())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--under", default="")
    parser.add_argument("--self", dest="own", action="store_true")
    parser.add_argument("--tree", default="", help="print the calls under the first frame containing this")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--floor", type=float, default=0.5, help="with --tree: leave out calls under this share")
    args = parser.parse_args()
    if args.tree:
        print("\n".join(tree(args.files, args.tree, args.depth, args.floor)))
        return 0
    total, shares = summarise(args.files, args.under, args.own)
    print(f"{total} samples")
    for frame, n in shares.most_common(args.top):
        print(f"{100 * n / max(total, 1):6.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
