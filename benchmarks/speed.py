"""Wall time and peak memory of our merges against stock mergekit's, side by side.

Builds deterministic bf16 Llama checkpoints, or for `moe` a Qwen3-MoE one
saved one expert per tensor (random base, sparse "RL-like" agents changing
about 3 / 46 / 54 % of the elements, like the paper's), then
runs the real `mergekit-yaml` once per method per round, methods interleaved,
each under `/usr/bin/time -v`:

  stock ram, stock ramplus_tl, stock task_arithmetic   (MERGEKIT_RAM_AUTOLOAD=0)
  our ram, our ramplus (global statistics), our ramplus statistics: tensor

and writes a markdown table of median wall time, median peak RSS, median
bytes read from disk and their ratios to stock `ram` (stock `ram` is replaced
by ours when our autoload hook is on, so stock runs switch it off). Nothing is
downloaded. Before building, it checks that the work folder has room for the
models and one merge output. `--drop-caches` (root) empties the page cache
before every run, so each starts cold, as on inputs larger than memory.

    python benchmarks/speed.py --sizes 135m 1b --rounds 3
    python benchmarks/speed.py --sizes 135m --agents 6 --rounds 3
    python benchmarks/speed.py --sizes moe --rounds 1   # per-expert Qwen3-MoE
    python benchmarks/speed.py --sizes 3b --rounds 3 --workdir /big/disk \
        --drop-caches --methods 'stock ram' 'our ram' 'our ramplus (global)'
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# Llama shapes: hidden, intermediate, layers, heads, kv heads, vocabulary.
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 4, 2, 256),
    "small": (256, 768, 6, 4, 2, 8192),
    # SmolLM2-135M's shape with an untied lm_head (163 M parameters).
    "135m": (576, 1536, 30, 9, 3, 49152),
    # Llama-3.2-1B's body with a 32k vocabulary, untied (1.1 B parameters).
    "1b": (2048, 8192, 16, 32, 8, 32000),
    # Llama-3.2-3B's body and vocabulary, untied (3.6 B parameters, 7.2 GB a
    # model in bf16): base + 3 agents exceed a 24 GB machine's memory.
    "3b": (3072, 8192, 28, 24, 8, 128256),
}
# Qwen3-MoE shapes saved one tensor per expert (mergekit fuses them as it
# reads): hidden, expert intermediate, layers, heads, kv heads, vocabulary,
# experts. 128 experts x 12 layers: 4,719 checkpoint tensors.
MOE_SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "moe": (128, 64, 12, 4, 2, 4096, 128),
}
SHAPES: dict[str, tuple[int, ...]] = {**SIZES, **MOE_SIZES}

# Fractions of elements each agent changes (the paper's 3.2 / 46.2 / 54.3 %),
# repeated with a shift for more agents.
DENSITIES = (0.032, 0.462, 0.543)

# name: (merge_method, parameters, our autoload on)
METHODS: dict[str, tuple[str, dict, bool]] = {
    "stock ram": ("ram", {}, False),
    "stock ramplus_tl": ("ramplus_tl", {}, False),
    "stock task_arithmetic": ("task_arithmetic", {}, False),
    "our ram": ("ram", {}, True),
    "our ramplus (global)": ("ramplus", {}, True),
    "our ramplus (tensor)": ("ramplus", {"statistics": "tensor"}, True),
}
BASELINE = "stock ram"
# Not a merge: what any mergekit plugin's merge costs at least (`floor`).
FLOOR = "floor"

# Bytes per element of the bf16 checkpoints and merge outputs.
BF16_BYTES = 2
# Free disk kept beyond the models and one output: configs, tokenizers and
# room for the file system.
DISK_MARGIN = 2_000_000_000
DROP_CACHES = "/proc/sys/vm/drop_caches"
# /usr/bin/time's "File system inputs" (Linux ru_inblock) count 512-byte blocks.
BLOCK_BYTES = 512


@dataclass(frozen=True)
class Run:
    wall: float  # seconds
    rss: int  # peak resident set, kilobytes
    user: float
    system: float
    read: int  # bytes read from disk (page-cache hits are not counted)
    digest: str = ""  # sha256 of the output's weight files (--hash), else ""


def parameter_count(size: str) -> int:
    return sum(math.prod(shape) for _name, shape in tensor_shapes(size))


def disk_needed(sizes: Sequence[str], agents: Sequence[int], root: str) -> int:
    """Bytes the run writes under root: models not built yet, one output, margin."""
    models = sum(
        parameter_count(size) * BF16_BYTES * (1 + count)
        for size in sizes
        for count in agents
        if not os.path.exists(os.path.join(root, f"{size}-{count}", "complete"))
    )
    largest = max(parameter_count(size) for size in sizes) * BF16_BYTES
    return models + largest + DISK_MARGIN


def disk_problem(folder: str, needed: int) -> str | None:
    """Why `folder` cannot hold `needed` bytes (None: it can), in one paragraph."""
    free = shutil.disk_usage(folder).free
    if free >= needed:
        return None
    return (
        f"Not enough free disk in {folder}: this benchmark needs about "
        f"{needed / 1e9:.1f} GB there (the models it builds, one merge output "
        f"and {DISK_MARGIN / 1e9:.0f} GB of margin) but {free / 1e9:.1f} GB is "
        "free. Pass --workdir with a folder on a disk with more room; the "
        "models built there are kept and reused by later runs."
    )


def drop_caches_problem() -> str | None:
    """Why --drop-caches cannot work here (None: it can), checked before any run."""
    if os.geteuid() != 0:
        return (
            f"--drop-caches writes to {DROP_CACHES}, which only root may do; "
            "run as root or leave the flag out."
        )
    if not os.access(DROP_CACHES, os.W_OK):
        return (
            f"--drop-caches cannot write to {DROP_CACHES} (a read-only /proc/sys, "
            "as in most containers); run on a host that allows it or leave the "
            "flag out."
        )
    return None


def drop_caches() -> None:
    """Write dirty pages back, then empty the page cache (the next run starts cold)."""
    os.sync()
    with open(DROP_CACHES, "w") as handle:
        handle.write("1\n")


def agent_densities(count: int) -> list[float]:
    """`count` densities: the paper's three, then shifted copies of them."""
    return [min(0.95, DENSITIES[i % 3] * (1.0 + 0.1 * (i // 3))) for i in range(count)]


def tensor_shapes(size: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama (or, for a MoE size, a
    per-expert Qwen3-MoE) checkpoint of this size."""
    hidden, inter, layers, heads, kv, vocab, *moe = SHAPES[size]
    head = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (hidden,)
        yield f"{p}.self_attn.q_proj.weight", (heads * head, hidden)
        yield f"{p}.self_attn.k_proj.weight", (kv * head, hidden)
        yield f"{p}.self_attn.v_proj.weight", (kv * head, hidden)
        yield f"{p}.self_attn.o_proj.weight", (hidden, heads * head)
        yield f"{p}.post_attention_layernorm.weight", (hidden,)
        if moe:
            yield f"{p}.self_attn.q_norm.weight", (head,)
            yield f"{p}.self_attn.k_norm.weight", (head,)
            yield f"{p}.mlp.gate.weight", (moe[0], hidden)
        experts = (
            [f"{p}.mlp.experts.{e}" for e in range(moe[0])] if moe else [p + ".mlp"]
        )
        for e in experts:
            yield f"{e}.gate_proj.weight", (inter, hidden)
            yield f"{e}.up_proj.weight", (inter, hidden)
            yield f"{e}.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def _write_config(size: str, path: str) -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    hidden, inter, layers, heads, kv, vocab, *moe = SHAPES[size]
    config = Qwen3MoeConfig if moe else LlamaConfig
    extra = (
        dict(moe_intermediate_size=inter, head_dim=hidden // heads, num_experts=moe[0])
        if moe
        else dict(intermediate_size=inter)
    )
    config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        architectures=[config.__name__.replace("Config", "ForCausalLM")],
        dtype="bfloat16",
        **extra,
    ).save_pretrained(path)


def build_models(size: str, agents: int, root: str, seed: int = 0) -> dict[str, str]:
    """Base and agents under root/size/ (reused when complete); name -> path.

    Tensors are made one at a time (the base's, then each agent's delta), so
    building never holds more than one tensor of every model in memory.
    """
    import torch
    from safetensors.torch import save_file

    folder = os.path.join(root, f"{size}-{agents}")
    names = ["base"] + [f"agent{i}" for i in range(agents)]
    paths = {n: os.path.join(folder, n) for n in names}
    done = os.path.join(folder, "complete")
    if os.path.exists(done):
        return paths
    densities = agent_densities(agents)
    states: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    generator = torch.Generator().manual_seed(seed)
    shard = {n: 0 for n in names}
    index: dict[str, dict[str, str]] = {n: {} for n in names}
    pending = 0

    def flush() -> None:
        for n in names:
            file = f"model-{shard[n]:05d}.safetensors"
            save_file(states[n], os.path.join(paths[n], file), {"format": "pt"})
            index[n].update({t: file for t in states[n]})
            states[n] = {}
            shard[n] += 1

    for n in names:
        os.makedirs(paths[n], exist_ok=True)
        _write_config(size, paths[n])
    for name, shape in tensor_shapes(size):
        if len(shape) == 1:
            base = torch.ones(shape)
        else:
            base = torch.randn(shape, generator=generator).mul_(0.02)
        states["base"][name] = base.to(torch.bfloat16)
        for i, density in enumerate(densities):
            keep = torch.rand(shape, generator=generator) < density
            delta = torch.randn(shape, generator=generator).mul_(0.01).mul_(keep)
            states[f"agent{i}"][name] = (base + delta).to(torch.bfloat16)
            del keep, delta
        pending += base.numel()
        if pending >= 400_000_000:
            flush()
            pending = 0
    if pending:
        flush()
    for n in names:
        with open(os.path.join(paths[n], "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index[n]}, f)
        _save_tokenizer(paths[n], SHAPES[size][5])
    open(done, "w").close()
    return paths


def _save_tokenizer(path: str, vocab: int) -> None:
    from mergekit_ram.commands.synthetic import save_tokenizer

    save_tokenizer(path, vocab)


def config_yaml(method: str, parameters: dict, paths: dict[str, str]) -> str:
    import yaml

    weighted = method == "task_arithmetic"
    config: dict = {
        "merge_method": method,
        "base_model": paths["base"],
        "models": [
            # task_arithmetic needs a weight; ours and stock RAM take none.
            {"model": p, **({"parameters": {"weight": 1.0}} if weighted else {})}
            for n, p in paths.items()
            if n != "base"
        ],
        "dtype": "bfloat16",
    }
    if parameters:
        config["parameters"] = parameters
    return yaml.safe_dump(config, sort_keys=False)


def parse_time_v(text: str) -> Run:
    """Wall, peak RSS, user and system time and bytes read from disk, from
    `/usr/bin/time -v` output (it counts the merge's child processes too)."""

    def field(label: str) -> str:
        match = re.search(rf"^\s*{re.escape(label)}: (.+)$", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"no {label!r} in /usr/bin/time output")
        return match.group(1).strip()

    clock = [
        float(part)
        for part in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")
    ]
    wall = 0.0
    for part in clock:
        wall = wall * 60 + part
    return Run(
        wall=wall,
        rss=int(field("Maximum resident set size (kbytes)")),
        user=float(field("User time (seconds)")),
        system=float(field("System time (seconds)")),
        read=int(field("File system inputs")) * BLOCK_BYTES,
    )


def output_digest(folder: str) -> str:
    """sha256 over the output's weight files (names and bytes, in name order):
    equal digests mean byte-identical weights."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            digest.update(name.encode())
            with open(os.path.join(folder, name), "rb") as handle:
                while block := handle.read(1 << 24):
                    digest.update(block)
    return digest.hexdigest()


def floor(config: str, out: str) -> None:
    """The least a mergekit plugin's merge of `config` can cost: the imports
    it cannot avoid (torch, safetensors, mergekit's merge and planner), every
    input tensor read once (through safetensors' map, as mergekit reads, each
    copied once so every byte is read) and an output of the base's shapes and
    dtypes written once with safetensors, in shards of mergekit's default
    size. No arithmetic, no checks, no progress bar."""
    import mergekit.merge  # noqa: F401
    import mergekit.plan  # noqa: F401
    import yaml
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(config) as handle:
        document = yaml.safe_load(handle)
    models = [document["base_model"], *(m["model"] for m in document["models"])]
    maps, names = {}, []
    for model in models:
        with open(os.path.join(model, "model.safetensors.index.json")) as handle:
            maps[model] = json.load(handle)["weight_map"]
        names = names or list(maps[model])  # the base's
    # One open shard per model at a time, as mergekit's loader keeps.
    opened: dict[str, tuple[str, Any]] = {}

    def read(model: str, name: str) -> Any:
        path = os.path.join(model, maps[model][name])
        if opened.get(model, ("",))[0] != path:
            opened[model] = (path, safe_open(path, "pt"))
        return opened[model][1].get_tensor(name).clone()

    os.makedirs(out)
    shard: dict = {}
    size = count = 0
    for name in names:
        tensors = [read(model, name) for model in models]
        output = tensors[0]
        if shard and size + output.nbytes > 5_000_000_000:
            count += 1
            save_file(shard, os.path.join(out, f"model-{count}.safetensors"))
            shard, size = {}, 0
        shard[name] = output
        size += output.nbytes
    save_file(shard, os.path.join(out, f"model-{count + 1}.safetensors"))


def run_once(
    name: str,
    paths: dict[str, str],
    workdir: str,
    cuda: bool,
    tree: str | None = None,
    digest: bool = False,
) -> Run:
    """One whole `mergekit-yaml` process under /usr/bin/time -v; `tree`: a
    checkout whose mergekit_ram is imported instead of the installed one."""
    method, parameters, ours = METHODS.get(name, ("ram", {}, False))
    config = os.path.join(workdir, "config.yml")
    with open(config, "w") as handle:
        handle.write(config_yaml(method, parameters, paths))
    out = os.path.join(workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    if name == FLOOR:
        command = [sys.executable, os.path.abspath(__file__), "--floor", config, out]
    else:
        command = [
            os.path.join(os.path.dirname(sys.executable), "mergekit-yaml"),
            config,
            out,
            "--no-write-model-card",
            "--no-copy-tokenizer",
        ] + (["--cuda"] if cuda else [])
    command = ["/usr/bin/time", "-v", *command]
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", MERGEKIT_RAM_AUTOLOAD="1" if ours else "0"
    )
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(tree), *filter(None, [env.get("PYTHONPATH")])]
        )
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout}\n{done.stderr}")
    run = parse_time_v(done.stderr)
    if digest:
        run = dataclasses.replace(run, digest=output_digest(out))
    shutil.rmtree(out, ignore_errors=True)
    return run


def ratio(value: float, base: float) -> str:
    """value ÷ base as the table shows it; "–" where the base is 0 (a stock
    run that read nothing from disk, its inputs all in the page cache)."""
    return f"{value / base:.2f}×" if base else "–"


def table(results: dict[str, list[Run]]) -> list[str]:
    """Markdown rows: median wall, peak RSS and bytes read, and their ratios
    to the baseline."""
    base = results[BASELINE]
    base_wall = statistics.median(r.wall for r in base)
    base_rss = statistics.median(r.rss for r in base)
    base_read = statistics.median(r.read for r in base)
    hashed = any(r.digest for runs in results.values() for r in runs)
    lines = [
        "| method | wall s (median) | ÷ stock ram | peak RSS GB | ÷ stock ram "
        "| read GB | ÷ stock ram | user s | system s |"
        + (" output sha256 |" if hashed else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if hashed else ""),
    ]
    for name, runs in results.items():
        wall = statistics.median(r.wall for r in runs)
        rss = statistics.median(r.rss for r in runs)
        read = statistics.median(r.read for r in runs)
        lines.append(
            f"| {name} | {wall:.1f} | {ratio(wall, base_wall)} | "
            f"{rss / 1e6:.2f} | {ratio(rss, base_rss)} | "
            f"{read / 1e9:.2f} | {ratio(read, base_read)} | "
            f"{statistics.median(r.user for r in runs):.1f} | "
            f"{statistics.median(r.system for r in runs):.1f} |"
            + (f" {digest_cell(runs)} |" if hashed else "")
        )
    return lines


def digest_cell(runs: Sequence[Run]) -> str:
    """The output's sha256 (12 hex digits) if every round wrote the same bytes."""
    digests = {r.digest for r in runs}
    return f"`{digests.pop()[:12]}`" if len(digests) == 1 else "differs between rounds"


def variants(
    methods: Sequence[str],
    trees: Sequence[str],
    compared: Sequence[str] | None = None,
) -> dict[str, tuple[str, str | None]]:
    """Row name -> (method, checkout or None): every method, then each of our
    methods (or those in `compared`) again per `LABEL=PATH` in trees, with
    that checkout's code."""
    rows: dict[str, tuple[str, str | None]] = {m: (m, None) for m in methods}
    for entry in trees:
        label, separator, path = entry.partition("=")
        if not separator or not label or not path:
            raise SystemExit(f"--compare wants LABEL=PATH, not {entry!r}")
        if not os.path.isdir(os.path.join(path, "mergekit_ram")):
            raise SystemExit(
                f"--compare {entry}: {path} holds no mergekit_ram package; give a "
                "checkout of this repository (e.g. git worktree add /tmp/old HEAD~1)"
            )
        for method in compared or methods:
            if method in METHODS and METHODS[method][2]:
                rows[f"{method} [{label}]"] = (method, path)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--floor"]:  # the floor's own process (run_once)
        floor(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["135m"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", type=int, nargs="+", default=[3])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[*METHODS, FLOOR],
        choices=[*METHODS, FLOOR],
        help=f"which rows to run ({FLOOR!r}: no merge, the least one can cost)",
    )
    parser.add_argument("--cuda", action="store_true", help="pass --cuda to merges")
    parser.add_argument(
        "--workdir",
        help="build (and reuse) the models here and keep them; default: a "
        "temporary folder, removed at the end unless --keep",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument("--output", help="also write the markdown here")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also run our methods with the mergekit_ram of another checkout "
        "(e.g. the commit before an optimisation), interleaved, rows marked [LABEL]",
    )
    parser.add_argument(
        "--compare-methods",
        nargs="+",
        choices=[name for name, (_m, _p, ours) in METHODS.items() if ours],
        help="which of our methods --compare repeats (default: all in --methods)",
    )
    parser.add_argument(
        "--hash",
        action="store_true",
        help="sha256 every output's weight files (a column: equal means "
        "byte-identical; outside the timed process)",
    )
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help=f"sync and write 1 to {DROP_CACHES} before every run, so each "
        "starts with a cold page cache (root only)",
    )
    args = parser.parse_args(argv)
    methods = list(dict.fromkeys([BASELINE, *args.methods]))
    rows = variants(methods, args.compare, args.compare_methods)
    os.environ["HF_HUB_OFFLINE"] = "1"
    problem = drop_caches_problem() if args.drop_caches else None
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ram-speed-")
    problem = disk_problem(workdir, disk_needed(args.sizes, args.agents, workdir))
    if problem:
        print(problem, file=sys.stderr)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return 2
    # Configs and merge outputs go to a folder of our own, whatever is there.
    scratch = tempfile.mkdtemp(prefix="runs-", dir=workdir)
    cold = ", page cache dropped before every run" if args.drop_caches else ""
    report = [
        f"`python benchmarks/speed.py {shlex.join(argv or sys.argv[1:])}` "
        f"({os.cpu_count()} CPUs{', --cuda' if args.cuda else ''}); medians of "
        f"{args.rounds} interleaved rounds, `dtype: bfloat16`{cold}.",
    ]
    try:
        for size in args.sizes:
            for agents in args.agents:
                print(f"building {size} with {agents} agents in {workdir}", flush=True)
                paths = build_models(size, agents, workdir)
                results: dict[str, list[Run]] = {row: [] for row in rows}
                for round_index in range(args.rounds):
                    for name, (method, tree) in rows.items():
                        if args.drop_caches:
                            drop_caches()
                        run = run_once(
                            method, paths, scratch, args.cuda, tree, args.hash
                        )
                        results[name].append(run)
                        print(
                            f"{size} x{agents} round {round_index + 1} {name:<24} "
                            f"{run.wall:7.1f} s {run.rss / 1e6:6.2f} GB "
                            f"{run.read / 1e9:6.2f} GB read {run.digest[:12]}",
                            flush=True,
                        )
                report += [
                    "",
                    f"**{size}** ({parameter_count(size) / 1e6:.1f} M parameters, "
                    f"base + {agents} agents)",
                    "",
                    *table(results),
                ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not (args.keep or args.workdir):
            shutil.rmtree(workdir, ignore_errors=True)
    text = "\n".join(report) + "\n"
    print("\n" + text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
