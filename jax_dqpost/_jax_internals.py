"""Every use of jax that is not its public API, in one place, each with why no public API serves.

Read at jax 0.10 to 0.12. Each name here is one jax may move; a test of every transformation (tests/) fails
where it does, and this module is what to mend.
"""

from __future__ import annotations

from jax._src import dispatch


def def_impl(primitive) -> None:
    """Eager calls of ``primitive`` run it through jit (``dispatch.apply_primitive``): jax's own primitives do so,
    and ``jax.extend`` has no public counterpart."""
    import functools

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))


def require_devices_during_lowering(primitive) -> None:
    """jax hands a lowering the program's devices only when its jaxpr holds a primitive on this private list; the
    op's lowering needs them (``custom_partitioning``, primitive.py)."""
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
