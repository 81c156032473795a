"""How the statistics pass's chunk size affects counting one tensor group.

`core.counting` counts a group's joint change pattern COUNT_CHUNK elements at
a time, in reused float32 buffers, the chunks shared out among --threads
workers (default: torch's thread count, as the pass does). This times that
count in-process for several chunk sizes and the whole-tensor count (every
task's τ and mask made at full size first, as before chunking), on a
bf16 base and three sparse bf16 agents changing about 3 / 46 / 54 % of the
elements (the paper's densities). Settings are interleaved over --repeats
rounds; the table gives each one's median and its ratio to the shipped size.
Every setting must give the same counts, or the script fails.

    python benchmarks/count_chunk.py --elements 16777216 --repeats 5
    python benchmarks/count_chunk.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mergekit_ram.core import counting
from mergekit_ram.core.kernel import change_masks

DENSITIES = (0.03, 0.46, 0.54)
EPSILON = 1e-5


def group(elements: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bf16 base and sparse bf16 agents (deltas large enough to survive bf16)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(elements, generator=generator).to(torch.bfloat16)
    tasks = []
    for density in DENSITIES:
        changed = torch.rand(elements, generator=generator) < density
        delta = torch.randn(elements, generator=generator) * 0.05 * changed
        tasks.append((base.float() + delta).to(torch.bfloat16))
    return base, tasks


def chunked(chunk: int) -> Callable[[torch.Tensor, list[torch.Tensor]], tuple]:
    def count(base: torch.Tensor, tasks: list[torch.Tensor]) -> tuple:
        shipped = counting.COUNT_CHUNK
        counting.COUNT_CHUNK = chunk
        try:
            return counting.tensor_overlaps(base, tasks, EPSILON)
        finally:
            counting.COUNT_CHUNK = shipped

    return count


def whole_tensor(base: torch.Tensor, tasks: list[torch.Tensor]) -> tuple:
    base32 = base.to(torch.float32)
    return counting.overlaps_of(change_masks(base32, tasks, EPSILON), base32)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[1 << 14, 1 << 16, 1 << 18, 1 << 20]
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, tasks = group(args.elements)
    settings = {f"chunk 2^{c.bit_length() - 1}": chunked(c) for c in args.chunks}
    settings["whole tensor"] = whole_tensor
    shipped = f"chunk 2^{counting.COUNT_CHUNK.bit_length() - 1}"
    settings.setdefault(shipped, chunked(counting.COUNT_CHUNK))
    times: dict[str, list[float]] = {name: [] for name in settings}
    results = {}
    for _ in range(args.repeats):
        for name, count in settings.items():
            started = time.perf_counter()
            results[name] = count(base, tasks)
            times[name].append(time.perf_counter() - started)
    reference = results["whole tensor"]
    for name, result in results.items():
        if result != reference:
            raise SystemExit(f"{name} counted differently from the whole-tensor count")
    medians = {name: statistics.median(values) for name, values in times.items()}
    lines = [
        f"{args.elements} elements, base + {len(tasks)} bf16 agents, "
        f"{args.threads} thread(s), median of {args.repeats}; counts identical "
        "in every setting",
        "",
        "| setting | seconds | × shipped |",
        "|---|---|---|",
    ]
    for name, seconds in medians.items():
        mark = " (shipped)" if name == shipped else ""
        lines.append(
            f"| {name}{mark} | {seconds:.3f} | {seconds / medians[shipped]:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
