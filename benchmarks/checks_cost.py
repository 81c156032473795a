"""What the input-header check and the output finiteness check cost.

Builds (or reuses, --keep) a base Llama of about --params parameters (bf16)
and three sparse agents, then runs whole `mergekit-ram merge` processes
(global RAM+, under /usr/bin/time -v), interleaved over --repeats rounds:
  checks       as shipped
  no-headers   with the header check replaced by a no-op
  no-output    with the output finiteness check replaced by a no-op
and prints each mode's median wall time, peak RSS and ratio to `checks`.
The checks alone are also timed in-process: the header check (median of
20 calls) and the output check over every tensor of the base (median of 5),
since on a busy machine the whole-process differences drown in noise.

    python benchmarks/checks_cost.py --params 110e6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from safetensors.torch import load_file  # noqa: E402

from mergekit_ram.commands.synthetic import (  # noqa: E402
    PAPER_LIKE,
    build_models,
    merge_yaml,
)
from mergekit_ram.core.checks import finite_output  # noqa: E402
from mergekit_ram.integration.checkpoints import check_models  # noqa: E402


def model_shape(params: float) -> dict:
    """A Llama shape of roughly `params` parameters (12 layers, 32k vocab)."""
    hidden = 768
    while True:
        layer = 4 * hidden * hidden + 3 * hidden * (8 * hidden // 3)
        total = 12 * layer + 2 * 32000 * hidden
        if total >= params:
            return dict(
                hidden_size=hidden,
                intermediate_size=8 * hidden // 3,
                num_hidden_layers=12,
                num_attention_heads=hidden // 64,
                num_key_value_heads=hidden // 64,
                vocab_size=32000,
            ), total
        hidden += 64


def arguments(doc: str) -> argparse.Namespace:
    """--params, --repeats and --keep."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--params", type=float, default=110e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", default=None, help="build/reuse models here")
    return parser.parse_args()


def bench_models(root: str, params: float) -> tuple[dict[str, str], int]:
    """The base and PAPER_LIKE agents under root/models (built once), and the size."""
    overrides, total = model_shape(params)
    marker = os.path.join(root, "models", "paths.json")
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            return json.load(handle), total
    paths = build_models(
        os.path.join(root, "models"), PAPER_LIKE, config_overrides=overrides
    )
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(paths, handle)
    return paths, total


DRIVER = """
import sys
import mergekit_ram.integration.methods as methods
import mergekit_ram.integration.validation as validation
def skip(*args, **kwargs):
    return None
if sys.argv[1] == "no-headers":
    validation.check_models = skip
if sys.argv[1] == "no-output":
    methods.finite_output = skip
from mergekit_ram.commands.cli import main
main(["merge", *sys.argv[2:]])
"""
MODES = ("checks", "no-headers", "no-output")


def run(mode: str, config: str, out: str) -> tuple[float, float]:
    """(wall seconds, peak RSS GiB) of one whole merge process."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-c", DRIVER, mode, config, out, "--quiet"]
    command += ["--no-write-model-card", "--no-copy-tokenizer"]
    started = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-v", *command], capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return wall, int(rss.group(1)) / 2**20


def main() -> None:
    args = arguments(__doc__)
    root = args.keep or tempfile.mkdtemp(prefix="ram-checks-")
    paths, total = bench_models(root, args.params)
    print(f"model: {total / 1e6:.0f}M parameters, bf16, 1 base + 3 agents in {root}")
    config = os.path.join(root, "ramplus.yml")
    with open(config, "w", encoding="utf-8") as handle:
        handle.write(merge_yaml(paths, "ramplus"))

    tasks = [(name, path) for name, path in paths.items() if name != "base"]
    header_times = []
    for _ in range(20):
        started = time.perf_counter()
        check_models(
            ("base", paths["base"]), tasks, compare=True, vocabulary_free=False
        )
        header_times.append(time.perf_counter() - started)
    print(f"header check alone: {statistics.median(header_times) * 1e3:.1f} ms")
    state = load_file(os.path.join(paths["base"], "model.safetensors"))
    output_times = []
    for _ in range(5):
        started = time.perf_counter()
        for name, tensor in state.items():
            finite_output(name, tensor, tensor)  # the merge calls it once per tensor
        output_times.append(time.perf_counter() - started)
    print(f"output check alone, all tensors: {statistics.median(output_times):.3f} s")

    results = {mode: [] for mode in MODES}
    for round_index in range(args.repeats):
        for mode in MODES:
            wall, rss = run(mode, config, os.path.join(root, f"out-{mode}"))
            results[mode].append((wall, rss))
            print(f"round {round_index + 1} {mode:<11} {wall:7.2f} s {rss:5.2f} GiB")
    baseline = statistics.median(w for w, _ in results["checks"])
    print(f"\n{'mode':<11} {'median s':>9} {'÷ checks':>9} {'peak GiB':>9}")
    for mode, values in results.items():
        median = statistics.median(w for w, _ in values)
        rss = statistics.median(r for _, r in values)
        print(f"{mode:<11} {median:9.2f} {median / baseline:9.3f} {rss:9.2f}")
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
