"""How long a publish takes next to the user's files: none, 2,000, 20,000.

A merge publishes file by file inside OUT and never walks the user's files,
so its time should not depend on how many there are (the old protocol
carried every one of them into the new folder). This times
`output_folder.staged_merge` with a stand-in merge that writes the files a
sharded merge writes (config, index, card, recipe, four 1 MiB shards) into
an OUT that already holds a previous merge and N user files laid out like a
git clone (`.git/objects/xx/...` and a worktree folder). Rounds interleave
the sizes; medians are printed. Standard library and this package only:

    python benchmarks/publish.py --files 0 2000 20000 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from mergekit_ram.integration.output_folder import staged_merge

SHARD = 1 << 20  # bytes per stand-in weight shard


def user_files(out: Path, count: int) -> None:
    """`count` files shaped like a git clone's: objects in 256 folders, a worktree."""
    for i in range(count):
        folder = out / ".git" / "objects" / f"{i % 256:02x}"
        if i < 256:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:038x}").write_bytes(b"x" * (i % 97))
    (out / "docs").mkdir(exist_ok=True)
    for i in range(count // 10):
        (out / "docs" / f"page{i}.md").write_text(str(i))


def merge_writer(label: str):
    def write(staged: str) -> None:
        for index in range(1, 5):
            name = f"model-{index:05d}-of-00004.safetensors"
            Path(staged, name).write_bytes(label.encode() * (SHARD // len(label)))
        for name in ("config.json", "model.safetensors.index.json", "README.md"):
            Path(staged, name).write_text(f"{label} {name}")
        Path(staged, "mergekit_config.yml").write_text(label)

    return write


def timed_publish(out: Path, label: str) -> float:
    """Seconds for one staged_merge whose merge is the stand-in writer; the
    writer's own time is measured apart and left out."""
    spent = []
    write = merge_writer(label)

    def timed_write(staged: str) -> None:
        start = time.perf_counter()
        write(staged)
        spent.append(time.perf_counter() - start)

    start = time.perf_counter()
    staged_merge(str(out), timed_write)
    return time.perf_counter() - start - spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, nargs="+", default=[0, 2000, 20000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where OUT folders go (a disk)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="publish-bench-", dir=args.dir))
    try:
        outs = {}
        for count in args.files:
            out = root / f"out-{count}"
            out.mkdir()
            user_files(out, count)
            staged_merge(str(out), merge_writer("first"))  # a previous merge
            outs[count] = out
        times: dict[int, list[float]] = {count: [] for count in args.files}
        for round_ in range(args.rounds):
            for count in args.files:
                times[count].append(timed_publish(outs[count], f"round{round_}"))
        base = statistics.median(times[args.files[0]])
        print(f"publish over a previous merge, {args.rounds} rounds, in {root}")
        print("| user files | median s | min s | max s | vs first row |")
        print("|---|---|---|---|---|")
        for count in args.files:
            median = statistics.median(times[count])
            print(
                f"| {count:,} | {median:.4f} | {min(times[count]):.4f} "
                f"| {max(times[count]):.4f} | {median / base:.2f}x |"
            )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
