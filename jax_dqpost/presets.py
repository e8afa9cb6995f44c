"""FlashAttention-4's presets: the accumulator orders its backward writes, by GPU, head dim, causality, tensor and
release (``AccumLayout.flash_attention``, whose docstring is the table and names the sources), and the GPU tables
they stand on. Plain data, no GPU: ``layout.py`` holds the orders themselves."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from . import _checks
from ._checks import MAX_HEAD_DIM
from .arch import SUPPORTED_ARCHS, sm_version
from .layout import AccumLayout

ORDER_OF_FAMILY = {8: 80, 9: 90, 10: 100, 11: 100, 12: 80}
"""The accumulator order (``AccumLayout.arch``) FlashAttention's backward writes on each GPU family (sm80 and sm120:
``mma.sync``, sm90: wgmma, sm100 and sm110: tcgen05); fa4-jax's tile plans name the family too."""

GPU_ARCHS = tuple(sorted({sm_version(a) for a in SUPPORTED_ARCHS}))
"""The GPU architectures the kernel knows, as numbers (``arch.SUPPORTED_ARCHS``)."""
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
"""The flash-attn-4 releases :meth:`AccumLayout.flash_attention` knows, by version (read in its sources and measured
against the mathematics on an H200)."""


def _release_layout(layout: AccumLayout, gpu: int, head_dim: int, release: Release, dq: bool) -> AccumLayout:
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


def _preset(arch: int, head_dim: int, causal: bool, dkv: bool) -> AccumLayout:
    """FlashAttention-4's order (``AccumLayout.flash_attention``, whose arguments are checked)."""
    family = arch // 10
    if family == 9:
        if dkv:
            if head_dim <= 128:
                return AccumLayout(90, 128, 256, 2, False, 32)
            return AccumLayout(90, 96, 256, 2, True, 64) if head_dim <= 192 else AccumLayout(90, 48, 256, 1, True, 64)
        if head_dim <= 64:
            return AccumLayout(90, 128, 256, 2, False, 32)
        if head_dim <= 96:
            return AccumLayout(90, 64, 128, 1, False, 32)
        if head_dim <= 128:
            return AccumLayout(90, 64, 256, 1, False, 32) if causal else AccumLayout(90, 80, 256, 1, True, 32)
        return AccumLayout(90, 64, 256, 1, False, 64)
    if family in (10, 11):
        two_cta = head_dim >= 128
        return AccumLayout(100, 128, 128, 1, False, 32, two_cta=two_cta and not dkv,
                           cluster_size=2 if two_cta and dkv else 1)
    return AccumLayout(80, 64, 128, 4, False, 32)


def presets_of(layout: AccumLayout) -> dict:
    """``{(gpu, dkv, causal): head dims}`` for which FlashAttention-4's presets (of every known release) are
    ``layout``; causal only where it differs from the non-causal preset."""
    return _preset_table().get(layout, {})


@functools.cache
def _preset_table() -> dict:
    """``{layout: {(gpu, dkv, causal): head dims}}``, every preset of every known release (see :func:`presets_of`)."""
    table = {}
    for gpu, dkv, causal in itertools.product(dict.fromkeys(a // 10 * 10 for a in FLASH_ATTENTION_ARCHS),
                                              (False, True), (False, True)):
        for d in range(8, MAX_HEAD_DIM + 1, 8):
            preset = _preset(gpu, d, causal, dkv)
            if not has_postprocess(gpu, d) or causal and preset == _preset(gpu, d, False, dkv):
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


def _differing(choice_a, choice_b) -> str:
    """Where FlashAttention-4's presets differ between two choices of ``(causal, dkv)``, each a function of ``dkv``
    (so that one of them may be the tensor): e.g. ``'sm90 dQ at head dims 104..128'``."""
    out = []
    for families in ((9,), (10, 11), (12,)):
        archs = [a for a in FLASH_ATTENTION_ARCHS if a // 10 in families]
        for dkv in (False, True):
            a, b = choice_a(dkv), choice_b(dkv)
            dims = [d for d in range(8, MAX_HEAD_DIM + 1, 8) if has_postprocess(archs[0], d)
                    and _preset(archs[0], d, *a) != _preset(archs[0], d, *b)]
            if dims:
                tensor = "" if a[1] != b[1] else " dK/dV" if dkv else " dQ"
                where = ", ".join(f"sm{x}" for x in dict.fromkeys(x // 10 * 10 for x in archs))
                out.append(f"{where}{tensor} at head dims {head_dim_ranges(dims)}")
    return "; ".join(dict.fromkeys(out))


def _causal_hint() -> str:
    return (f"True or False (True also for local attention); FlashAttention-4's causal and non-causal orders differ "
            f"for {_differing(lambda dkv: (True, dkv), lambda dkv: (False, dkv))}, with the same shape wherever "
            "both tiles divide the sequence, so a wrong guess gives wrong values, not an error. Pass it for every GPU, "
            "so that the call is portable")


def _version_hint() -> str:
    return (f"the flash-attn-4 release whose backward wrote the accumulator, one of "
            f"{', '.join(map(repr, FLASH_ATTENTION_RELEASES))} (importlib.metadata.version('flash-attn-4')); releases "
            "pad the head dim differently (4.0.0b36's sm90 backward tiles it in multiples of 16 in accumulators "
            f"allocated in multiples of 32, {_PR_2896}), so a wrong guess gives wrong gradients, not an error")


def _tensor_hint() -> str:
    return (f"'dq' or 'dkv'; FlashAttention-4's dQ and dK/dV orders differ (e.g. non-causal, for "
            f"{_differing(lambda dkv: (False, False), lambda dkv: (False, True))}), so a wrong guess gives wrong "
            "values, not an error")


def flash_attention(gpu: int, head_dim: int, *, causal: bool, tensor: str, version: str,
                    head_dim_v: int | None = None) -> AccumLayout:
    """``AccumLayout.flash_attention`` (its docstring): the arguments checked, the preset and the release's
    padding."""
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
    layout = _preset(gpu, head_dim, causal, tensor == "dkv")
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


HINTS = {"causal": _causal_hint, "tensor": _tensor_hint, "version": _version_hint}
"""How to choose each of ``flash_attention``'s required arguments: what the error for a missing one says."""
