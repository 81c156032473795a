"""`mergekit-ram demo`: three toy RL-like agents merged with RAM+, explained.

No network and no arguments: it builds a tiny Llama base and three agents
whose task vectors are sparse with overlapping supports (densities near the
paper's agents), writes a YAML, runs the stock `mergekit-yaml` command
in-process (the path users take, our methods arriving through the autoload
hook or the import above), then prints the statistics section of the merged
model's card and checks the model loads with transformers. With --out it writes only
what it creates there (MODELS, CONFIG, MERGED) and refuses a folder where any
of them already exists, or that is itself a model, before writing anything.
"""

from __future__ import annotations

import os
import time

from mergekit_ram.commands.synthetic import PAPER_LIKE, build_models, merge_yaml
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import WEIGHT_FILES
from mergekit_ram.integration.statistics import STATISTICS_FILE

# What the demo writes into its folder, and nothing else.
MODELS, CONFIG, MERGED = "models", "ramplus.yml", "merged"


def check_out_dir(root: str) -> None:
    """A RAMInputError unless the demo can write into `root` without
    touching anything there: no entry of its own exists yet, and `root` is
    not a model folder (the demo would nest its models inside it)."""
    where = f"mergekit-ram demo --out {root}"

    def there(names: tuple) -> list[str]:
        return [n for n in names if os.path.lexists(os.path.join(root, n))]

    if model := there(("config.json", *WEIGHT_FILES)):
        raise RAMInputError(
            f"{where}: {root} is a model folder (it holds {', '.join(model)}); the "
            "demo would write its own models and merge inside it. Choose a new or "
            "empty folder; nothing was written."
        )
    if present := [os.path.join(root, n) for n in there((MODELS, CONFIG, MERGED))]:
        raise RAMInputError(
            f"{where}: {', '.join(present)} already "
            f"{'exists' if len(present) == 1 else 'exist'}, and the demo writes "
            f"{MODELS}/, {CONFIG} and {MERGED}/ there and replaces nothing. Move "
            "them away or choose a new or empty folder; nothing was written."
        )


def _check_loads(path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = AutoTokenizer.from_pretrained(path)("w1 w2 w3", return_tensors="pt").input_ids
    with torch.no_grad():
        if not torch.isfinite(model(ids).logits).all():
            raise RuntimeError(f"the merged model at {path} produced non-finite logits")
    return f"{type(model).__name__}, {model.num_parameters():,} parameters"


def run_demo(root: str) -> str:
    """Build, merge and report in `root`; returns the merged model's directory."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml
    from transformers.utils import logging as transformers_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers_logging.disable_progress_bar()
    check_out_dir(root)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as error:
        raise RAMInputError(
            f"mergekit-ram demo --out {root}: the folder cannot be created "
            f"({error.strerror}). Choose a folder where you may create files; "
            "nothing was written."
        ) from None
    started = time.perf_counter()
    print(f"Building a tiny base model and three RL-like agents in {root} ...")
    paths = build_models(os.path.join(root, MODELS), PAPER_LIKE)
    config, merged = os.path.join(root, CONFIG), os.path.join(root, MERGED)
    with open(config, "x", encoding="utf-8") as handle:
        handle.write(merge_yaml(paths, "ramplus", r=0.1, alpha=2.0))
    print(f"Merging with RAM+ (paper defaults): mergekit-yaml {config} {merged}")
    mergekit_yaml([config, merged, "--quiet"], standalone_mode=False)
    # The statistics as the merged model's card (README.md) states them.
    with open(os.path.join(merged, "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    print(card[card.index("\n### RAM+ statistics") :])
    print(
        "unique = changed by this agent alone: RAM keeps it (RAM+ scales it by λ) "
        "where averaging would divide it by 3;\nshared = changed by several agents: "
        "averaged over those agents only."
    )
    print(f"Merged model: {merged} ({_check_loads(merged)}; loads with transformers)")
    print(f"Config: {config}; statistics: {os.path.join(merged, STATISTICS_FILE)}")
    print(f"Built, merged and checked in {time.perf_counter() - started:.1f} s.")
    return merged
