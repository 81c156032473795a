"""What a model folder holds and reads, from the file system, before a weight is read.

The one place that knows checkpoints on disk: which files are weights (one
file, or an index naming shards, as mergekit's loader looks for them, and
the names mergekit's writer gives them), where each tensor's bytes lie (the
statistics pass's read-ahead), whether writing a folder would change an
input, and every local input's checkpoint files checked from their headers.

The safetensors library validates each file's header (opening a file reads
only its header: a corrupt, truncated or padded file, overlapping tensors,
a bad dtype or shape all fail there); a pickled `.bin` is left to mergekit's
loader, which unpickles weights only. What stays ours is what no single file can
know: a missing shard, a tensor the base has and a task model lacks (mergekit
would silently merge a task's embed_tokens as its missing lm_head), a shape
or kind that differs, and a dtype torch cannot compute a merge in. Each
problem is one RAMInputError naming model, file and tensor, where mergekit
would fail with a traceback deep in the merge.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from mergekit_ram.core.errors import RAMInputError

if TYPE_CHECKING:
    import torch

# The weight files mergekit's ShardedTensorIndex.from_disk looks for in a model
# folder: one file, or an index naming shards. (mergekit's own list lives in a
# script module, mergekit.scripts.multimerge, whose import loads mergekit.merge:
# it would re-enter the autoload install while this package is half-imported.)
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = tuple(f"{name}.index.json" for name in SINGLE_FILES)
WEIGHT_FILES = tuple(n for pair in zip(SINGLE_FILES, INDEX_FILES) for n in pair)
FIX = (
    "Copy or download the checkpoint again (or save it again with "
    "save_pretrained); the merge has not started."
)
REASON_LIMIT = 300  # characters of a library's error shown in ours


class Tensor(NamedTuple):
    """One tensor as a checkpoint's header describes it (dtype None: torch has
    none). A tuple: a model of many tensors builds thousands of these."""

    file: str
    dtype: torch.dtype | None
    dtype_name: str
    shape: tuple[int, ...]


def _refuse(role: str, model: str, file: str, problem: str) -> RAMInputError:
    return RAMInputError(f"{role} {model}: {file} {problem}. {FIX}")


def _reason(error: BaseException) -> str:
    text = str(error).removeprefix("Error while deserializing header: ")
    text = " ".join(text.split()) or type(error).__name__
    return text if len(text) <= REASON_LIMIT else f"{text[:REASON_LIMIT]}…"


def safetensors_header(path: str, role: str, model: str) -> dict[str, Tensor]:
    """The tensors a safetensors file declares, as the safetensors library
    validated its header (only the header is read)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import _TYPES  # its names → torch's; absent: none

    name = os.path.basename(path)
    try:
        with safe_open(path, framework="pt") as handle:
            parts = {key: handle.get_slice(key) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise _refuse(
            role,
            model,
            name,
            f"is not a valid safetensors file ({_reason(error)}): truncated, "
            "padded, corrupt or not a safetensors file",
        ) from None
    return {
        key: Tensor(
            name, _TYPES.get(kind := part.get_dtype()), kind, tuple(part.get_shape())
        )
        for key, part in parts.items()
    }


def model_tensors(path: str, role: str) -> dict[str, Tensor] | None:
    """Every tensor of the model folder `path`, from the safetensors files
    mergekit would read; None for a pickled checkpoint (mergekit's loader
    reads it weights-only and reports its own problems)."""
    from mergekit.io.lazy_tensor_loader import ShardedTensorIndex

    single = os.path.join(path, SINGLE_FILES[0])
    index = f"{single}.index.json"
    if not os.path.lexists(index):
        found = os.path.lexists(single)
        return safetensors_header(single, role, path) if found else None
    name = os.path.basename(index)
    try:  # mergekit's reading of the index
        shards = ShardedTensorIndex.from_disk(path).shards
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        problem = f"is not a valid index ({_reason(error)})"
        raise _refuse(role, path, name, problem) from None
    found: dict[str, Tensor] = {}
    for shard in shards:
        file = os.path.join(path, shard.filename)
        if not os.path.lexists(file):
            problem = f"names the shard {shard.filename}, which is missing"
            raise _refuse(role, path, name, problem)
        tensors = safetensors_header(file, role, path)
        found.update(tensors)
        for tensor in shard.contained_keys:
            if tensor not in tensors:
                problem = f"lacks tensor {tensor}, which {name} places there"
                raise _refuse(role, path, shard.filename, problem)
    return found


def check_models(
    base: tuple[str, str] | None,
    tasks: Sequence[tuple[str, str]],
    *,
    compare: bool,
    vocabulary_free: bool,
    cast: bool = False,
    read: Callable[[], Collection[str] | None] | None = None,
) -> None:
    """Read the headers of the base and task models (role, path) and refuse
    what the merge would trip over: a tensor RAM merges in a dtype torch cannot
    compute in (unless mergekit `cast`s every tensor on load: `dtype:`); with
    `compare`, also a tensor the base has and a task lacks, or one whose kind
    or shape differs (a vocabulary axis is left to mergekit when
    `vocabulary_free`: it aligns the rows). A base whose headers are not here
    (None: a hub id) or not safetensors leaves each task model checked alone.

    `read` returns the tensor names mergekit's architecture reads (None:
    unknown); a tensor outside them is never loaded, so its dtype does not
    matter. It is called only when some dtype would be refused.
    """
    import torch

    from mergekit_ram.core.checks import check_layout, from_base, uncomputable

    names = functools.cache(read or (lambda: None))  # read once, if at all

    def computable(name: str, tensor: Tensor, role: str, path: str) -> None:
        problem = uncomputable(tensor.dtype) if tensor.dtype else "has no torch dtype"
        if cast or problem is None or name not in (names() or (name,)):
            return
        raise RAMInputError(
            f"Tensor {name} of {role} {path} ({tensor.file}) is stored as "
            f"{tensor.dtype_name}, which {problem}. Convert the checkpoint to "
            "bfloat16, float16 or float32 (dequantize it) before merging."
        )

    def alone(role: str, path: str, tensors: dict[str, Tensor] | None) -> None:
        for name, tensor in (tensors or {}).items():
            if not from_base(tensor.dtype):
                computable(name, tensor, role, path)

    base_tensors = model_tensors(base[1], base[0]) if base else None
    if base:
        alone(*base, base_tensors)
    for role, path in tasks:
        tensors = model_tensors(path, role)
        if tensors is None or base_tensors is None:
            alone(role, path, tensors)
            continue
        for name, expected in base_tensors.items():
            found = tensors.get(name)
            if found is None:
                if compare:
                    raise _missing(name, expected, base, role, path)
                continue
            if from_base(expected.dtype):
                continue  # copied from the base
            computable(name, found, role, path)
            if not compare or (
                not from_base(found.dtype) and found.shape == expected.shape
            ):
                continue
            if vocabulary_free and found.shape[1:] == expected.shape[1:]:
                continue
            layouts = {base[1]: expected, path: found}
            meta = {
                m: torch.empty(t.shape, dtype=t.dtype, device="meta")
                for m, t in layouts.items()
            }
            check_layout(name, meta, base[1])


def _missing(
    name: str, expected: Tensor, base: tuple[str, str], role: str, path: str
) -> RAMInputError:
    fallback = (
        " mergekit would silently merge the task's embed_tokens in its place "
        "(its tied-embedding fallback)."
        if name.startswith("lm_head")
        else ""
    )
    return RAMInputError(
        f"Tensor {name} is in the base model {base[1]} ({expected.file}) but "
        f"not in {role} {path}.{fallback} RAM merges task vectors of the "
        "base's tensors: save the task model with every tensor of the base "
        "(an untied lm_head included), or merge models of one architecture."
    )


# --- the output folder against the inputs ------------------------------------


def output_conflict(
    out: str, inputs: Iterable[tuple[str, str]], role: str = "output folder"
) -> str | None:
    """Why writing `out` would change an input (None when it would not).

    `out` must not be an input folder or lie inside one, and no entry of an
    input folder may resolve to a file directly in `out` (publishing writes
    and removes only `out`'s top-level files; an input lying deeper inside
    `out` is never touched).
    """
    target = os.path.realpath(out)
    for input_role, path in inputs:
        if not os.path.isdir(path):
            continue
        folder = os.path.realpath(path)
        if os.path.commonpath([target, folder]) == folder:  # OUT is or is in it
            where = "is" if target == folder else "lies inside"
            return f"The {role} {out} {where} the input {input_role} {path}"
        for name in sorted(os.listdir(path)):
            linked = os.path.realpath(os.path.join(path, name))
            if os.path.dirname(linked) == target:
                return (
                    f"The input {input_role} {path} reads {name}, which resolves "
                    f"to {linked} in the {role} {out}"
                )
    return None


def safetensors_spans(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (first byte, length) in a safetensors file, from its raw
    header (8-byte little-endian length, then JSON; data follows): the byte
    ranges the read-ahead hints, which the safetensors library does not give."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < size <= os.fstat(handle.fileno()).st_size - 8:
            raise ValueError(f"{path}: no safetensors header")
        header = json.loads(handle.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    spans = {}
    for name, entry in header.items():
        if name != "__metadata__":
            first, end = entry["data_offsets"]
            spans[name] = (8 + size + first, end - first)
    return spans
