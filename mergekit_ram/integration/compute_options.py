"""Where and in which dtype a merge computes: `dtype`, `out_dtype`, --cuda, --device.

mergekit 0.1.5 reads these only once the merge runs: a misspelled dtype
(`bf16`) is a RuntimeError while planning, `--cuda` on a machine without
CUDA an AssertionError inside torch, `--device tpu9` a RuntimeError, each a
traceback after every input's index was opened. Checked here first, each is
one RAMInputError naming the key or option and the fix.
"""

from __future__ import annotations

import torch
from mergekit.common import dtype_from_name
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ram.core.errors import RAMInputError

FLOAT_NAMES = ("bfloat16", "float16", "float32", "float64")
SPELLINGS = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}


def check_dtypes(config: MergeConfiguration) -> None:
    """`dtype` and `out_dtype` name a floating-point dtype mergekit knows."""
    for key in ("dtype", "out_dtype"):
        name = getattr(config, key)
        if not name:
            continue
        try:
            dtype = dtype_from_name(name)
        except RuntimeError:
            dtype = None
        if dtype is not None and dtype.is_floating_point:
            continue
        meant = SPELLINGS.get(str(name).lower())
        hint = f" (did you mean {meant}?)" if meant else ""
        raise RAMInputError(
            f"{key}: {name!r} is not a floating-point dtype mergekit knows{hint}. "
            f"RAM computes task vectors in floating point: write one of "
            f"{', '.join(FLOAT_NAMES)}."
        )


def _device_count(kind: str) -> int | None:
    """How many devices of `kind` torch can use here (None: mergekit cannot)."""
    if kind == "cpu":
        return 1
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    return None


def check_device(options: MergeOptions | None) -> None:
    """--cuda / --device name a device this machine has; --multi-gpu needs CUDA."""
    if options is None:
        return
    name = options.device or "cpu"
    # The flag the user typed: --gpu-rich sets --cuda, which sets the device.
    option = (
        "--gpu-rich"
        if options.gpu_rich
        else "--cuda"
        if options.cuda and name == "cuda"
        else f"--device {name}"
    )
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    count = None if device is None else _device_count(device.type)
    if count is None:
        raise RAMInputError(
            f"{option}: {name!r} is not a device mergekit can compute on. Use "
            "cpu, cuda, cuda:N, xpu, mps or auto."
        )
    if count == 0:
        build = (
            " (this torch is built without CUDA)"
            if device.type == "cuda" and torch.version.cuda is None
            else ""
        )
        raise RAMInputError(
            f"{option}: this machine has no {device.type} device torch can use"
            f"{build}. Leave {option} out to merge on the CPU, or run on a "
            f"machine with one."
        )
    if device.index is not None and device.index >= count:
        raise RAMInputError(
            f"{option}: this machine has {count} {device.type} device(s), "
            f"numbered 0 to {count - 1}. Pick one of those."
        )
    if options.read_to_gpu and device.type == "cpu":
        raise RAMInputError(
            "--read-to-gpu: the merge computes on the CPU here, so there is no "
            "GPU to read the tensors onto and the option would do nothing. Add "
            "--cuda (or --device cuda:N) on a machine with a GPU, or leave "
            "--read-to-gpu out."
        )
    if options.multi_gpu and torch.cuda.device_count() == 0:
        raise RAMInputError(
            "--multi-gpu: this machine has no CUDA GPU torch can use. Leave "
            "--multi-gpu (and --gpu-rich) out to merge on one device."
        )
