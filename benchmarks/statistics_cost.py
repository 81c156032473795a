"""What the global RAM+ statistics pass costs, measured side by side.

Builds a base Llama of about --params parameters (bf16) and three sparse
"RL-like" agents, then times, interleaved over --repeats rounds:
  ram              RAM (r = 0): no statistics pass, the merge alone
  ramplus-tensor   tensor-local RAM+: no pass
  ramplus-global   global RAM+: statistics pass + merge
and prints each mode's median time and its ratio to `ram`.

    python benchmarks/statistics_cost.py --params 110e6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mergekit.config import MergeConfiguration  # noqa: E402
from mergekit.options import MergeOptions  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

import mergekit_ram  # noqa: E402,F401
from mergekit_ram.commands.synthetic import PAPER_LIKE, build_models  # noqa: E402

MODES = {
    "ram": ("ram", {}),
    "ramplus-tensor": ("ramplus", {"statistics": "tensor"}),
    "ramplus-global": ("ramplus", {"statistics": "global"}),
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=110e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", default=None, help="build/reuse models here")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()

    root = args.keep or tempfile.mkdtemp(prefix="ram-bench-")
    overrides, total = model_shape(args.params)
    marker = os.path.join(root, "models", "paths.json")
    if os.path.exists(marker):
        paths = json.load(open(marker))
    else:
        paths = build_models(
            os.path.join(root, "models"), PAPER_LIKE, config_overrides=overrides
        )
        json.dump(paths, open(marker, "w"))
    print(f"model: {total / 1e6:.0f}M parameters, bf16, 1 base + 3 agents in {root}")

    times = {mode: [] for mode in MODES}
    for round_index in range(args.repeats):
        for mode, (method, params) in MODES.items():
            config = MergeConfiguration.model_validate(
                {
                    "merge_method": method,
                    "base_model": paths["base"],
                    "models": [{"model": p} for n, p in paths.items() if n != "base"],
                    "parameters": params,
                }
            )
            out = os.path.join(root, f"out-{mode}")
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            mergekit_ram.run_merge(
                config,
                out,
                MergeOptions(quiet=True, write_model_card=False, copy_tokenizer=False),
            )
            times[mode].append(time.perf_counter() - started)
            print(f"round {round_index + 1} {mode:<15} {times[mode][-1]:7.2f} s")
    baseline = statistics.median(times["ram"])
    print(f"\n{'mode':<15} {'median s':>9} {'÷ ram':>7}")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"{mode:<15} {median:9.2f} {median / baseline:7.2f}")
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
