"""The contract with mergekit: every host name we rely on that it does not publish.

mergekit 0.1.5 has no plugin API. Whatever of it we use beyond its published
names (`mergekit.merge_methods`'s `__all__`, the configuration and option
classes) is listed here once, each with what we use it for and the upstream
hook whose arrival would let it go, and `probe()` checks all of it before
`install` changes anything: the import, the attribute, the parameters we
pass or read, and that the host code which must reach what we wrap or
override still names it. Any difference is one IncompatibleMergekit
(`errors`) naming it; the plugin then installs nothing and refuses `ram` /
`ramplus`.
docs/compatibility.md shows this table to users (a test keeps them equal).
Importing this module imports no mergekit.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from importlib.metadata import version
from typing import Any, NamedTuple

SUPPORTED = "mergekit>=0.1.5,<0.2"
OURS = ("ram", "ramplus")  # the method names the plugin answers for


def incompatible(what: str) -> Exception:
    """The IncompatibleMergekit to raise (its module imports click: lazily)."""
    from mergekit_ram.integration.errors import IncompatibleMergekit

    return IncompatibleMergekit(
        f"mergekit-ram cannot install into mergekit {version('mergekit')}: {what}. "
        "It refuses `ram` and `ramplus` rather than merge them differently. Install "
        f"{SUPPORTED} (`pip install mergekit==0.1.5`) or a mergekit-ram release made "
        "for yours; MERGEKIT_RAM_AUTOLOAD=0 runs stock mergekit (no `ramplus`)."
    )


class Reliance(NamedTuple):
    """One host name: "module:attribute.path"; `reads`, the parameters (or
    fields) we pass or read by name; `reached`, host functions ("module:path")
    that must still name it for our wrapper or override to be called."""

    name: str
    reads: str = ""  # space-separated
    reached: str = ""  # space-separated


PLAN, METHODS = "mergekit.plan:MergePlanner", "mergekit.merge_methods"
TASK = f"{METHODS}.task_adapter:ExecuteMergeMethodTask"
CARD, GRAPH = "mergekit.card", "mergekit.graph"
# Each: what we use it for; the upstream hook whose arrival would let it go.
CONTRACT = (
    # Routed: `ram` / `ramplus` to ours, refused while we are not installed.
    # Hook: a way to replace a registered method, or plugin discovery.
    Reliance(f"{METHODS}:get", reached=f"{PLAN}.__init__ {TASK}.execute"),
    # Wrapped: checks, staging and one MergeRun around a RAM merge. Hook: a
    # pre-merge validation hook and an output writer that stages.
    Reliance("mergekit.merge:run_merge", "merge_config out_path options config_source"),
    # Wrapped, read and rewritten: planned merge tasks become RAMMergeTasks
    # with whole-model λ. Hook: a method hook after planning.
    Reliance(f"{PLAN}._plan", reached=f"{PLAN}.plan_to_disk"),
    Reliance(f"{PLAN}._tensors", reached=f"{PLAN}.plan_to_disk"),
    Reliance(f"{PLAN}.config", reached=f"{PLAN}.__init__"),
    # Wrapped: a last task writes ram_statistics.json. Hook: tasks after the
    # model is written.
    Reliance(f"{PLAN}.plan_to_disk", "out_path", "mergekit.merge:run_merge"),
    # Wrapped: the card's RAM section, OUT's name. Hook: a method card hook.
    Reliance("mergekit.merge:generate_card", "config name", "mergekit.merge:run_merge"),
    # Wrapped: no hub lookup for a folder a RAM merge read. Hook: a card that
    # knows local paths.
    Reliance(f"{CARD}:is_hf", reached=f"{CARD}:extract_hf_paths {CARD}:maybe_link_hf"),
    # Overridden: the output dtype reaches the kernel; global λ for in-memory
    # calls. Hook: out_dtype in merge_group, a whole-call method hook.
    Reliance(
        f"{METHODS}.base:GroupMergeMethod._execute",
        "groups parameters input_dtypes out_dtype",
        f"{METHODS}.base:MergeMethod._execute_resolved",
    ),
    # Called: the spec derived from merge_group's signature, as mergekit
    # derives its own. Hook: a public spec-from-signature helper.
    Reliance(f"{METHODS}.easy_define:_parameter_spec", "batched"),
    # Called: in-memory RAM+ counts each group in the dtype it merges in.
    # Hook: a whole-call method hook.
    Reliance(f"{METHODS}.dtype:align_dtype"),
    # Subclassed and read: the planned merge task. Hook: as for _plan.
    Reliance(
        TASK,
        "gather_tensors model_order base_model output_weight parameters "
        "input_parameters out_dtype",
    ),
    # Called and reordered: the statistics pass walks the planner's gather
    # tasks in mergekit's executor, backwards, reading ahead. Hook: a
    # statistics pass over planned inputs.
    Reliance("mergekit.io.tasks:LoadTensor._resolve_name"),
    Reliance(f"{GRAPH}:Executor.schedule", reached=f"{GRAPH}:Executor._run"),
    Reliance(f"{GRAPH}:ExecutionSchedule", "tasks last_use_index"),
)


def resolve(name: str) -> Any:
    """The object "module:attribute.path" names (ImportError, AttributeError)."""
    module, _, path = name.partition(":")
    parts = filter(None, path.split("."))
    return functools.reduce(getattr, parts, importlib.import_module(module))


def _problem(reliance: Reliance) -> str | None:
    """What is wrong with one relied-on name, None when nothing is. An
    attribute the class does not hold (set on the instance) must be named
    by every function in `reached`."""
    owner, _, last = reliance.name.replace(":", ":.").rpartition(".")
    name = reliance.name.replace(":", ".")
    try:
        target = getattr(resolve(owner), last, None)
        callers = [inspect.unwrap(resolve(n)) for n in reliance.reached.split()]
    except (ImportError, AttributeError) as error:
        return f"{name} is missing ({error})"
    if target is None and (reliance.reads or not callers):
        return f"{name} is missing"
    # The names its own code uses (not those of a nested function or, before
    # Python 3.12, comprehension: then it is refused, closed).
    if lost := next((c for c in callers if last not in c.__code__.co_names), None):
        return f"{name} is no longer used by {lost.__qualname__}"
    found = inspect.signature(target).parameters if reliance.reads else {}
    if missing := [p for p in reliance.reads.split() if p not in found]:
        return f"{name} has no parameter {', '.join(missing)}"
    return None


def probe() -> None:
    """Check every relied-on name; one IncompatibleMergekit naming each that
    changed."""
    if problems := [p for reliance in CONTRACT if (p := _problem(reliance))]:
        raise incompatible("; ".join(problems))


def bound(function: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """A call's arguments as `function` binds them, by parameter name; a
    wrapper passes its own arguments through, reading only what it needs."""
    return inspect.signature(function).bind(*args, **kwargs)
