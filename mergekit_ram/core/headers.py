"""Every input's checkpoint files checked from their headers, before a weight is read.

A safetensors file starts with an 8-byte length and a JSON header naming each
tensor's dtype, shape and byte range; an index names the shard of every
tensor. Reading those (a few kilobytes per file) finds a truncated or corrupt
file, a missing shard, a tensor the base has and a task model lacks, and a
shape that differs, each as one RAMInputError naming model, file and tensor,
where mergekit would fail with a traceback deep in the merge, or silently
merge a task's embed_tokens as its missing lm_head. Pickled `.bin` files are
only ever opened with weights-only unpickling.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mergekit_ram.core.checks import check_layout
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.weight_files import SINGLE_FILES

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on the JSON header
FIX = (
    "Copy or download the checkpoint again (or save it again with "
    "save_pretrained); the merge has not started."
)


@dataclass(frozen=True)
class Tensor:
    """One tensor as a checkpoint's header describes it."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _refuse(role: str, model: str, file: str, problem: str) -> RAMInputError:
    return RAMInputError(f"{role} {model}: {file} {problem}. {FIX}")


def safetensors_header(path: str, role: str, model: str) -> dict[str, Tensor]:
    """The tensors a safetensors file declares, after checking its sizes."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _refuse(role, model, name, f"is {size} bytes, too short for a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(HEADER_LIMIT, size - 8):
            raise _refuse(
                role,
                model,
                name,
                f"declares a {length}-byte header but holds {size} bytes "
                "(truncated or not a safetensors file)",
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse(role, model, name, f"has a corrupt header ({error})") from None
    if not isinstance(header, dict):
        raise _refuse(role, model, name, "has a corrupt header (not a JSON object)")
    data = size - 8 - length
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _refuse(
                role, model, name, f"has a corrupt header entry for tensor {key}"
            ) from None
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * dtype.itemsize or begin < 0:
            raise _refuse(
                role,
                model,
                name,
                f"declares tensor {key} as {list(shape)} {entry['dtype']} in "
                f"{end - begin} bytes (corrupt header)",
            )
        if end > data:
            raise _refuse(
                role,
                model,
                name,
                f"is truncated: tensor {key} ends at byte {end} of the data, "
                f"which holds {data} bytes",
            )
        tensors[key] = Tensor(name, dtype, shape)
    return tensors


def pickle_tensors(path: str, role: str, model: str) -> dict[str, Tensor]:
    """A pickled checkpoint's tensors, unpickled weights-only (no code runs)."""
    name = os.path.basename(path)
    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except Exception as error:  # any unpickling failure is the file's problem
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RAMInputError(
            f"{role} {model}: {name} cannot be loaded as plain weights "
            f"(weights-only unpickling refused it: {first}). A pickle that "
            "needs more than tensors can run code when loaded, so it is not "
            "read. Convert the model to safetensors from a source you trust "
            "(save_pretrained(..., safe_serialization=True))."
        ) from None
    if not isinstance(state, Mapping):
        raise RAMInputError(
            f"{role} {model}: {name} holds a {type(state).__name__}, not a "
            "mapping of tensor names to tensors. Save the model's state dict."
        )
    return {
        key: Tensor(name, value.dtype, tuple(value.shape))
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def model_tensors(path: str, role: str) -> dict[str, Tensor]:
    """Every tensor of the model folder `path`, as mergekit would find them."""
    for stem, reader in zip(SINGLE_FILES, (safetensors_header, pickle_tensors)):
        single = os.path.join(path, stem)
        index = f"{single}.index.json"
        if os.path.exists(index):
            return _indexed(index, path, role, reader)
        if os.path.exists(single):
            return reader(single, role, path)
    return {}


def _indexed(index: str, path: str, role: str, reader) -> dict[str, Tensor]:
    name = os.path.basename(index)
    try:
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _refuse(role, path, name, f"is not a valid index ({error})") from None
    found: dict[str, Tensor] = {}
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise _refuse(
                role, path, name, f"names the shard {shard}, which is missing"
            )
        found.update(reader(file, role, path))
    for tensor, shard in weight_map.items():
        if tensor not in found:
            raise _refuse(
                role,
                path,
                shard,
                f"lacks tensor {tensor}, which {name} places there",
            )
    return found


def check_models(
    base: tuple[str, str],
    tasks: Sequence[tuple[str, str]],
    *,
    compare: bool,
    vocabulary_free: bool,
) -> None:
    """Read the headers of the base and task models (role, path) and refuse
    what the merge would trip over; with `compare`, also a tensor the base
    has and a task lacks, or one whose kind or shape differs (a vocabulary
    axis is left to mergekit when `vocabulary_free`: it aligns the rows)."""
    base_tensors = model_tensors(base[1], base[0])
    for role, path in tasks:
        tensors = model_tensors(path, role)
        if not compare:
            continue
        for name, expected in base_tensors.items():
            found = tensors.get(name)
            if found is None:
                raise _missing(name, expected, base, role, path)
            if not expected.dtype.is_floating_point:
                continue
            if vocabulary_free and found.shape[1:] == expected.shape[1:]:
                continue
            check_layout(
                name,
                {
                    base[1]: torch.empty(
                        expected.shape, dtype=expected.dtype, device="meta"
                    ),
                    path: torch.empty(found.shape, dtype=found.dtype, device="meta"),
                },
                base[1],
            )


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
