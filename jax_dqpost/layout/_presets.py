"""FlashAttention-4's presets: the accumulator orders its backward writes, by GPU, head dim, causality, tensor and
release (:func:`flash_attention`, ``AccumLayout.flash_attention``'s body and docstring: the table, with its
sources), the GPU tables they stand on, and the hints of the errors that concern them. Plain data, no GPU; it does
not import ``__init__.py``, which holds the orders themselves and passes its record's class in."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from .. import _checks
from .._checks import MAX_HEAD_DIM

GPU_ARCHS = (80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)
"""The GPU architectures that have accumulator orders here, as numbers: those the kernel compiles for
(``_kernel/arch.py``'s ``SUPPORTED_ARCHS``, which tests/test_layout.py holds to this list)."""
FLASH_ATTENTION_ARCHS = tuple(a for a in GPU_ARCHS if a // 10 in (9, 10, 11, 12))
"""Those FlashAttention-4's backward runs on."""


def has_postprocess(arch: int, head_dim: int) -> bool:
    """Whether FlashAttention-4's backward on GPU ``arch`` ends with a postprocess at ``head_dim``: on the GPUs it runs
    on (:data:`FLASH_ATTENTION_ARCHS`) but sm100/sm110 above head dim 192 (a dedicated kernel finishes dQ, dK, dV)."""
    return arch in FLASH_ATTENTION_ARCHS and not (arch // 10 in (10, 11) and head_dim > 192)


@dataclasses.dataclass(frozen=True)
class Release:
    """How a flash-attn-4 release pads the head dim where its tiles and its allocation disagree.

    Attributes:
      version: the release's version string.
      sm90_tile_multiple: ``{head dims up to: multiple}``: its sm90 backward's tiles pad head dims up to the key to a
        multiple of the value (flash_bwd_sm90.py's ``tile_hdim``), where the presets' rows are allocated in
        multiples of 32.
      cannot_run: ``{(GPU family, head_dim, causal): why}``: configurations its backward cannot run.
      issue: the upstream issue about the padding.
    """

    version: str
    sm90_tile_multiple: dict
    cannot_run: dict
    issue: str


_PR_2896 = "Dao-AILab/flash-attention PR #2896"
FLASH_ATTENTION_RELEASES = {
    "4.0.0b36": Release("4.0.0b36", {128: 16},
                        {(9, d, False): "its swapped (112, 80) dQ MMA does not partition into WGMMA atoms"
                         for d in (104, 112)}, _PR_2896),
}
"""The flash-attn-4 releases :meth:`AccumLayout.flash_attention` knows, by version (read in their sources;
``tests/test_gradients.py`` checks what they write against the mathematics)."""


def _release_layout(layout, gpu: int, head_dim: int, release: Release, dq: bool):
    """``layout`` (a preset, allocated in multiples of its ``hdim_multiple_of``) with ``release``'s tiles: where its
    sm90 backward tiles ``head_dim`` narrower than the allocation pads it, ``hdim_multiple_of`` becomes the tiles' and
    ``alloc_hdim_multiple_of`` keeps the allocation's, and dQ's packed (varlen) accumulators are unreadable (its
    preprocess zeroes the allocation's tiles). Elsewhere ``layout`` (the two readings are one)."""
    multiple = next((m for up_to, m in sorted(release.sm90_tile_multiple.items()) if head_dim <= up_to), None)
    if gpu // 10 != 9 or multiple is None or layout.hdim_multiple_of % multiple:
        return layout
    tiled = dataclasses.replace(layout, hdim_multiple_of=multiple, alloc_hdim_multiple_of=layout.hdim_multiple_of)
    dr, da = tiled.padded_head_dim(head_dim), tiled.alloc_head_dim(head_dim)
    if dr == da:
        return layout
    if dq:
        tiled = dataclasses.replace(tiled, varlen_unreadable=(
            f"flash-attn-4 {release.version}'s sm{gpu} backward adds dQ at head_dim={head_dim} in {dr}-column tiles "
            f"into an accumulator its preprocess zeroes in {da}-column tiles, so for packed (varlen) batches some of "
            f"what it adds to was never zeroed and no reading recovers dQ ({release.issue}); dense batches are read "
            "right"))
    return tiled


def _preset(cls, arch: int, head_dim: int, causal: bool, dkv: bool):
    """FlashAttention-4's order, an instance of ``cls`` (``AccumLayout``; :func:`flash_attention` checked the
    arguments)."""
    family = arch // 10
    if family == 9:
        if dkv:
            if head_dim <= 128:
                return cls(90, 128, 256, 2, False, 32)
            return cls(90, 96, 256, 2, True, 64) if head_dim <= 192 else cls(90, 48, 256, 1, True, 64)
        if head_dim <= 64:
            return cls(90, 128, 256, 2, False, 32)
        if head_dim <= 96:
            return cls(90, 64, 128, 1, False, 32)
        if head_dim <= 128:
            return cls(90, 64, 256, 1, False, 32) if causal else cls(90, 80, 256, 1, True, 32)
        return cls(90, 64, 256, 1, False, 64)
    if family in (10, 11):
        two_cta = head_dim >= 128
        return cls(100, 128, 128, 1, False, 32, two_cta=two_cta and not dkv,
                           cluster_size=2 if two_cta and dkv else 1)
    return cls(80, 64, 128, 4, False, 32)


def presets_of(layout) -> dict:
    """``{(gpu, dkv, causal): head dims}`` for which FlashAttention-4's presets (of every known release) are
    ``layout``; causal only where it differs from the non-causal preset."""
    return _preset_table(type(layout)).get(layout, {})


@functools.cache
def _preset_table(cls) -> dict:
    """``{layout: {(gpu, dkv, causal): head dims}}``, every preset of every known release (see :func:`presets_of`)."""
    table = {}
    for gpu, dkv, causal in itertools.product(dict.fromkeys(a // 10 * 10 for a in FLASH_ATTENTION_ARCHS),
                                              (False, True), (False, True)):
        for d in range(8, MAX_HEAD_DIM + 1, 8):
            preset = _preset(cls, gpu, d, causal, dkv)
            if not has_postprocess(gpu, d) or causal and preset == _preset(cls, gpu, d, False, dkv):
                continue
            for release in FLASH_ATTENTION_RELEASES.values():
                dims = table.setdefault(_release_layout(preset, gpu, d, release, not dkv), {})
                dims.setdefault((gpu, dkv, causal), []).append(d)
    return {layout: {where: sorted(set(d)) for where, d in found.items()} for layout, found in table.items()}


def head_dim_ranges(head_dims) -> str:
    """``[104, 112, 120, 128, 200]`` -> ``'104..128, 200'``."""
    runs = []
    for d in head_dims:
        if runs and d == runs[-1][1] + 8:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs)


def preset_hint(layout) -> str:
    """`` (it is FlashAttention-4's preset for sm90 dQ at head dims 120..128)``, or "" for a layout no preset is: the
    hint of ``AccumLayout.check_head_dim``'s errors, where a layout made for another head dim is the usual cause."""
    found = [f"sm{gpu} {'dK/dV' if dkv else 'dQ'}{' causal' if causal else ''} at head dims {head_dim_ranges(dims)}"
             for (gpu, dkv, causal), dims in presets_of(layout).items()]
    return f" (it is FlashAttention-4's preset for {'; '.join(found)})" if found else ""


HINTS = {
    "causal": "True or False (True also for local attention); FlashAttention-4's causal and non-causal orders differ "
              "for sm90 dQ at head dims 104..128, with the same shape wherever both tiles divide the sequence, so a "
              "wrong guess gives wrong values, not an error. Pass it for every GPU, so that the call is portable",
    "tensor": "'dq' or 'dkv'; FlashAttention-4's dQ and dK/dV orders differ (e.g. non-causal, for sm90 at head dims "
              "72..256; sm100, sm110 at head dims 128..192), so a wrong guess gives wrong values, not an error",
    "version": f"the flash-attn-4 release whose backward wrote the accumulator, one of "
               f"{', '.join(map(repr, FLASH_ATTENTION_RELEASES))} (importlib.metadata.version('flash-attn-4')); "
               "releases pad the head dim differently (4.0.0b36's sm90 backward tiles it in multiples of 16 in "
               f"accumulators allocated in multiples of 32, {_PR_2896}), so a wrong guess gives wrong gradients, not "
               "an error",
}
"""How to choose each of :func:`flash_attention`'s required arguments: what the error for a missing one says (where
the presets differ: ``tests/test_layout.py`` checks these sentences against the presets)."""


# AccumLayout.flash_attention's body and docstring; cls: the record's class, AccumLayout.
def flash_attention(cls, gpu: int, head_dim: int, *, causal: bool, tensor: str, version: str,
                    head_dim_v: int | None = None):
    """The layout in which FlashAttention-4's backward, release ``version``, running on GPU architecture ``gpu``
    (90, 100, 101, 103, 110, 120 or 121: the GPU the backward runs on, not a field of the order), writes the
    accumulator of ``tensor``: ``"dq"``, or ``"dkv"`` (dK and dV, accumulated in fp32 for grouped-query attention,
    where several query heads add into one key/value head).

    ``causal`` (True also for local attention), ``tensor`` and ``version`` have no default: for some GPUs and
    head dims (the table below; the error for a missing ``causal`` lists them) the causal order differs from the
    non-causal one, and dQ's from dK/dV's, with shapes that agree wherever both tiles divide the sequence; and
    releases pad the head dim differently (below). A wrong guess gives wrong gradients, not an error. All three
    are required on every GPU, so that a call is portable. ``head_dim_v`` (default ``head_dim``) only matters
    for the head dims with no postprocess.

    ``version``: the flash-attn-4 release that wrote the accumulator (``importlib.metadata.version(
    "flash-attn-4")``; a port of its kernels: the release it was taken from, if its padding is unchanged). The
    presets know the releases below; another release raises ``ValueError`` naming the layouts to pass instead, as
    the rows below differ between releases only in the padding:

    * ``"4.0.0b36"``: its sm90 backward tiles the head dim in multiples of 16 (64 where its dK/dV MMA is
      swapped, head dims above 128) while it allocates the accumulators in multiples of 32 (upstream:
      Dao-AILab/flash-attention PR #2896, open). At sm90 head dims 8, 16, 40, 48, 72, 80, 104 and 112, where the
      two differ, its dQ (and dK/dV) accumulators hold ``Dr = ceil(D / 16) * 16`` tiles in rows allocated for
      ``Da = ceil(D / 32) * 32``: the rows below with ``hdim_multiple_of=16, alloc_hdim_multiple_of=32``, which
      read them right (its own postprocess reads them as 32-column tiles and returns wrong gradients there).
      Packed (varlen) dQ there is lost: its preprocess zeroes the 32-column tiles and the backward adds into
      16-column ones, some never zeroed, so the dQ preset has ``varlen_unreadable`` set and a varlen call
      raises ValueError (dK/dV, allocated as zeros, are read right). At 104 and 112 without ``causal`` its
      backward does not compile (a swapped ``(112, 80)`` dQ MMA): ValueError.

    The presets, as ``AccumLayout(...)``'s positional fields (dK/dV's rows are key rows: ``tile_m`` is
    FlashAttention's ``n_block_size``)::

        | gpu | head dim | causal | dQ (`tensor="dq"`) | dK/dV (`tensor="dkv"`) |
        |---|---|---|---|---|
        | 90 | 8..64 | either | `(90, 128, 256, 2, False, 32)` | the same |
        | 90 | 72..96 | either | `(90, 64, 128, 1, False, 32)` | `(90, 128, 256, 2, False, 32)` |
        | 90 | 104..128 | no | `(90, 80, 256, 1, True, 32)` | `(90, 128, 256, 2, False, 32)` |
        | 90 | 104..128 | yes | `(90, 64, 256, 1, False, 32)` | `(90, 128, 256, 2, False, 32)` |
        | 90 | 136..192 | either | `(90, 64, 256, 1, False, 64)` | `(90, 96, 256, 2, True, 64)` |
        | 90 | 200..256 | either | `(90, 64, 256, 1, False, 64)` | `(90, 48, 256, 1, True, 64)` |
        | 100, 101, 103, 110 | 8..120 | either | `(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=1)` | the same |
        | 100, 101, 103, 110 | 128..192 | either | `(100, 128, 128, 1, False, 32, two_cta=True, cluster_size=1)` | `(100, 128, 128, 1, False, 32, two_cta=False, cluster_size=2)` |
        | 100, 101, 103, 110 | 200..256 | either | `ValueError`: a dedicated kernel finishes dQ, dK, dV | the same |
        | 120, 121 | 8..256 | either | `(80, 64, 128, 4, False, 32)` | the same |

    (sm90's hd96 dQ takes one warpgroup; sm120's backward uses the sm80 ``mma.sync`` MMA with 4 warps.)

    From flash_attn/cute/interface.py (flash-attn 4.0.0b36): ``_tile_size_bwd_sm90`` and the postprocess
    calls of ``_flash_attn_bwd`` (``num_threads_post_dQ``/``num_threads_post_dKV``, ``hdim_multiple_of = 64
    if sm90 and dKV_swapAB``, dK/dV with ``n_block_size``, ``AtomLayoutNdKV``, ``dKV_swapAB`` and
    ``cluster_size``), the sm100 branch (``use_2cta_instrs = head_dim >= 128``, ``cluster_size = 2`` with it;
    ``FlashAttentionBackwardSm100.accum_tile_orders``: dQ in the 1- or 2-CTA fragment order, dK/dV in the
    1-CTA one) and the sm120 branch (sm80 MMA, 4 warps); flash_bwd_sm90.py's ``tile_hdim`` for the padding.

    Raises:
      TypeError: ``causal``, ``tensor`` or ``version`` left out, or an argument of the wrong type.
      ValueError: ``gpu`` is not a GPU architecture (the message lists them) or has no FlashAttention-4
        backward (sm80..sm89); ``version`` is not a release the presets know; on sm100/sm110, head dims above
        192 (a dedicated kernel finishes dQ, dK and dV itself, with no separate postprocess); a configuration
        the release's backward cannot run; a head dim that is not a positive multiple of 8 up to 256.
    """
    gpu = _checks.static_int("gpu", gpu, minimum=1)
    head_dim = _checks.head_dim(head_dim)
    head_dim_v = head_dim if head_dim_v is None else _checks.head_dim(head_dim_v, name="head_dim_v")
    causal = _checks.static_bool("causal", causal)
    if tensor not in ("dq", "dkv"):
        raise ValueError(f"tensor must be 'dq' or 'dkv', got {_checks.describe(tensor)}")
    if gpu not in GPU_ARCHS:
        raise ValueError(f"gpu={gpu} is not a GPU architecture; the known ones are "
                         f"{', '.join(map(str, GPU_ARCHS))} (FlashAttention-4's backward runs on "
                         f"{', '.join(map(str, FLASH_ATTENTION_ARCHS))})")
    if gpu not in FLASH_ATTENTION_ARCHS:
        what = "dQ" if tensor == "dq" else "dK/dV"
        raise ValueError(f"FlashAttention-4 has no {what} postprocess configuration for gpu={gpu} (its "
                         f"backward runs on {', '.join(map(str, FLASH_ATTENTION_ARCHS))}); pass an AccumLayout "
                         "with the producer's fields")
    if not has_postprocess(gpu, head_dim):
        raise ValueError(f"FlashAttention's sm{gpu} backward for head_dim={head_dim}, head_dim_v={head_dim_v} "
                         "uses its dedicated hd256 kernel, which finishes dQ, dK and dV itself (no separate "
                         "postprocess)")
    layout = _preset(cls, gpu, head_dim, causal, tensor == "dkv")
    if not isinstance(version, str):
        raise TypeError(f"version must be a str, a flash-attn-4 release such as "
                        f"{next(iter(FLASH_ATTENTION_RELEASES))!r}, got {_checks.describe(version)}")
    release = FLASH_ATTENTION_RELEASES.get(version.strip())
    where = f"gpu={gpu}, head_dim={head_dim}, causal={causal}, tensor={tensor!r}"
    if release is None:
        known = next(iter(FLASH_ATTENTION_RELEASES.values()))
        padded = dataclasses.replace(_release_layout(layout, gpu, head_dim, known, tensor == "dq"),
                                     varlen_unreadable=None)
        alternatives = (f"for this call ({where}) {known.version}'s is {padded!r} (dense batches only), and "
                        f"with the accumulators' own padding (PR #2896) {layout!r}" if padded != layout
                        else f"for this call ({where}) the known releases' is {layout!r}")
        raise ValueError(
            f"version={version!r} is not a flash-attn-4 release these presets know "
            f"({', '.join(FLASH_ATTENTION_RELEASES)}): releases pad the head dim differently (4.0.0b36's sm90 "
            "backward tiles it in multiples of 16 in accumulators allocated in multiples of 32; "
            "Dao-AILab/flash-attention PR #2896 would make both 32), and an accumulator read with another "
            "release's padding gives wrong gradients, not an error. Pass the release the backward comes from, or "
            f"an AccumLayout with the fields your release's flash_bwd_sm90.py (tile_hdim) and interface.py "
            f"(head_dim_rounded) give: {alternatives}")
    if (gpu // 10, head_dim, causal) in release.cannot_run:
        raise ValueError(
            f"flash-attn-4 {version}'s sm{gpu} backward does not run at head_dim={head_dim} with causal={causal} "
            f"({release.cannot_run[gpu // 10, head_dim, causal]}): there is no accumulator to read "
            f"({release.issue})")
    return _release_layout(layout, gpu, head_dim, release, tensor == "dq")

