"""Every use of jax that is not its public API, in one place, each with why no public API serves.

Read at jax 0.10 to 0.12. Each name here is one jax may move; a test of every transformation (tests/) fails
where it does, and this module is what to mend.
"""

from __future__ import annotations

import jax
from jax._src import dispatch
from jax.sharding import NamedSharding, PartitionSpec


def def_impl(primitive) -> None:
    """Eager calls of ``primitive`` run it through jit (``dispatch.apply_primitive``): jax's own primitives do so,
    and ``jax.extend`` has no public counterpart."""
    import functools

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))


def require_devices_during_lowering(primitive) -> None:
    """jax hands a lowering the program's devices only when its jaxpr holds a primitive on this private list; the
    op's lowering needs them (``custom_partitioning``, ``_primitive/rules.py``)."""
    dispatch.prim_requires_devices_during_lowering.add(primitive)


def lowered_for_export(ctx) -> bool:
    """Whether a lowering rule runs for ``jax.export`` (the rule context's lowering parameters)."""
    return bool(ctx.module_context.lowering_parameters.for_export)


def lowered_without_devices(ctx) -> bool:
    """Whether the lowering has no device assignment: bound inside another primitive's own lowering (the rule
    context's axis context)."""
    return getattr(ctx.module_context.axis_context, "device_assignment", ()) is None


def partitioned_over(ctx) -> int:
    """The devices XLA's partitioner spreads the op over (what makes custom_partitioning emit its callback): those
    of a jit's device assignment, or of a ``shard_map`` with axes left automatic; 1 inside a ``shard_map`` whose
    axes are all manual. The axis contexts are jax's private ``sharding_impls`` types."""
    from jax._src import sharding_impls

    context = ctx.module_context.axis_context
    if isinstance(context, sharding_impls.SPMDAxisContext):
        return 1 if set(context.manual_axes) == set(context.mesh.axis_names) else context.mesh.size
    return len(getattr(context, "device_assignment", None) or ())


# ---- shard_map's varying manual axes (check_vma=True): the op's results carry its operands'

def varying_axes(x) -> frozenset:
    """The manual mesh axes over which ``x`` (a value or an aval) varies inside ``jax.shard_map`` (empty outside it,
    or with ``check_vma=False``). jax keeps them in the aval (``aval.mat.varying``; ``aval.vma`` in older jax), and
    prints them (``jax.typeof(x)`` shows ``{V:...}``), but has no public accessor."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_as(x, axes):
    """``x`` made varying over the manual axes of ``axes`` it lacks (``jax.lax.pcast(..., to="varying")``, whose
    transpose, a psum, jax's AD applies); ``x`` itself where it lacks none (always outside ``jax.shard_map``)."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_alike(*xs) -> list:
    """``xs`` (arrays, or None: passed through) each made varying over the union of their varying manual axes
    (:func:`vary_as`), as jax.numpy's binary operations do implicitly; unchanged outside ``jax.shard_map``. Only the
    reading of the axes is internal (:func:`varying_axes`)."""
    union = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    return [x if x is None or not union else vary_as(x, union) for x in xs]


def result_aval(shape, dtype, operands):
    """A primitive's result of ``shape`` and ``dtype`` typed with its operands' varying manual axes (which must be
    one set: the operands are cast to their union, :func:`vary_alike`, before the bind), so that inside
    ``jax.shard_map`` with its default check (``check_vma=True``) jax's AD finds cotangents of the types it expects.
    A public ``jax.core.ShapedArray`` takes no varying axes in jax 0.10 to 0.12 (no ``vma=`` keyword): the result
    is the aval of an operand that has them, updated (``aval.update``, which keeps them) with the result's shape and
    dtype, replicated over its abstract mesh (the axes are manual: each device holds its own block). Outside
    ``shard_map`` (no varying axes) it is ``jax.core.ShapedArray(shape, dtype)``."""
    avals = [x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x) for x in operands]
    union = frozenset().union(*(varying_axes(a) for a in avals))
    if not union:
        return jax.core.ShapedArray(shape, dtype)
    like = next((a for a in avals if varying_axes(a) == union), None)
    if like is None:
        found = sorted({tuple(sorted(varying_axes(a), key=str)) for a in avals}, key=str)
        raise ValueError(f"jax_dqpost: the op's operands vary over different manual axes of jax.shard_map ({found}); "
                         "the API casts them to their union before it binds the op")
    return like.update(shape=tuple(shape), dtype=dtype, weak_type=False,
                       sharding=NamedSharding(like.sharding.mesh, PartitionSpec()))


# ---- custom_partitioning takes a function that closes over no array -------------------------------------------

def hoisting_constants(fun, *args):
    """``(call, constants)``: ``fun(*args)`` traced once, the arrays it closes over (``constants``) made operands
    of ``call(*args, *constants)``, which gives ``fun``'s result. ``jax.experimental.custom_partitioning`` refuses a
    function with such constants (an ``AssertionError`` inside jax) and jax has no public way to hoist them:
    ``jax.closure_convert`` hoists floating-point ones only."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    count, tree = len(closed.consts), jax.tree.structure(out_shape)

    def call(*operands):
        inputs, constants = operands[:len(operands) - count], operands[len(operands) - count:]
        return jax.tree.unflatten(tree, core.eval_jaxpr(jaxpr, (), *constants, *inputs))

    return call, list(closed.consts)
