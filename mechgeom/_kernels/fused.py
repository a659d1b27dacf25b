"""The blocked sweep of :class:`~mechgeom.analyses.contribution.geometry.LayerGeometry` with one fused pass per block.

Same numbers as the plain-torch sweep (``docs/definitions.md`` §2; the formulas are those of
:mod:`mechgeom.analyses.contribution.geometry`, one function each there), arranged so that every product is
one batched matmul over heads (BLAS) and every element-wise step one pass of the C kernels of
``contribution_rows.c``, each metric tensor written once:

1. the products ``z[i,h] M[h]`` (one ``bmm`` over heads) and ``o[i] @ W_O[h].T`` (one matmul ``z[i] @ M`` for
   every head), from the weight-only :func:`mechgeom.maths.wo_gram_layouts`, then both output norms in one C
   pass;
2. the value norms ``‖vt[j,h]‖`` and, for the inter-head value norm, the per-token Gram ``G_j`` (each
   unordered head pair once): one ``bmm`` per chunk of tokens, reduced in C into the kernel's layout;
3. per block of queries ``q0:q1``, one ``bmm`` for both raw products (``z[i,h] M[h] . v[j,h]``, the cosine's
   numerator, and ``(o[i] @ W_O[h].T) . v[j,h]``, the head share's; their rows interleaved), then one pass
   per query row that reads ``alpha`` and those products and writes every requested metric, the four
   inter-head ones included (``sqrt(alpha^T G_j alpha)`` as well), each row computed in L1 and written
   with streaming stores (see ``contribution_rows.c``).

Where the kernel is built with OpenMP on PyTorch's own runtime (:func:`mechgeom._kernels.build.openmp`), the C
passes share their rows among ``torch.get_num_threads()`` threads of PyTorch's pool.

It runs where :func:`available` says so: a CPU tensor in float32, float64, bfloat16 or float16, a C compiler on
the machine (:mod:`mechgeom._kernels.build`), and ``MECHGEOM_NATIVE`` not ``0``; everywhere else the plain-torch
sweep runs.

**Half precision.** The C kernels are built for float32 and float64 only; the sweep runs in the geometry's
compute dtype (``geo.dtype``: float32 for a bfloat16 or float16 model). ``v`` and ``z`` come upcast (no ``q x k``
axis); the pattern is upcast one block of queries at a time into a scratch ``[b h n k1]`` that the row kernel
reads in its place, so the numbers are those of the plain sweep, which upcasts the same blocks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

from mechgeom import maths
from mechgeom._kernels import build
from mechgeom.typing import WO, Bool, Float, Pattern, Tensor, Values, Z

__all__ = ["FUSED_BLOCK_SIZE", "INPUTS", "OUTPUTS", "SLOTS", "LayerGeometry", "available", "sweep_blocks"]

#: Queries per block of the fused sweep: smaller blocks waste less of the causal triangle in their matmuls
#: (the C kernel skips those keys anyway). The measurements behind 64 are in ``docs/architecture.md``.
FUSED_BLOCK_SIZE = 64


class LayerGeometry(Protocol):
    """What the fused sweep reads of one layer: the activations, the weight Gram and a scratch allocator.

    :class:`mechgeom.analyses.contribution.geometry.LayerGeometry` is the implementation; the kernel names
    only this protocol, so the native code sits below the analyses and imports none of them.
    """

    pattern: Pattern
    v: Values
    z: Z
    W_O: WO
    #: The dtype the sweep computes in (float32 or float64; the pattern may be half precision).
    dtype: torch.dtype
    causal: bool
    block_size: int | None
    modified: Bool[Tensor, "batch head_index query_pos"] | None

    @property
    def wo_gram_full(self) -> Float[Tensor, "head_index d_head head_index2 d_head2"]: ...

    def scratch(self, name: str, shape: Sequence[int]) -> Tensor: ...


#: The row kernel's input slots, in order (see ``contribution_rows.c``).
INPUTS = ("alpha", "d1", "d2", "vt_norm", "inv_vt", "inv_oh", "inv_ol", "keep", "gram2")
#: The row kernel's output slots, after the inputs: the metrics it computes, by their keys in the table of
#: :mod:`mechgeom.analyses.contribution.metrics` (``name`` intra-head, ``name_inter`` inter-head; a test reads
#: the C source's slot list and checks both against it). Any other metric runs on the plain-torch sweep.
OUTPUTS = (
    "value_weighted",
    "value_weighted_normalized",
    "contribution",
    "factor_norm_ratio",
    "factor_cos",
    "head_share",
    "attention_inter",
    "value_weighted_inter",
    "value_weighted_normalized_inter",
    "contribution_inter",
)
#: The row kernel's argument slots, in order: :data:`INPUTS`, then :data:`OUTPUTS`.
SLOTS = INPUTS + OUTPUTS
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
#: Pattern dtypes the sweep reads: the kernel's own, and half precision upcast per block to float32.
_READS = (*_SUFFIX, torch.bfloat16, torch.float16)
_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = {
    "mg_contribution_rows": [_I64] * 5 + [_INT] * 3 + [_PTR, _PTR],
    "mg_value_gram": [_I64] * 7 + [_PTR] * 5 + [_INT],
    "mg_out_norms": [_I64] * 4 + [_PTR] + [_I64] * 3 + [_PTR] * 4,
}
#: Work of one C call (entries it writes) below which it runs on one thread: a parallel region costs a few
#: microseconds, which pays from about this size on (measured at 1x256 on SmolLM2, 2 cores).
_MIN_PARALLEL = 1 << 15
#: Bytes of the Gram's products per chunk of tokens (``[head, tokens, (H // 2 + 1) * d_head]``): one chunk at
#: 1x256 on SmolLM2, which measured faster than chunks of 1 MB that stay in L2 (``docs/benchmarks.md``).
GRAM_CHUNK_BYTES = 1 << 22


_TYPED: dict[int, ctypes.CDLL] = {}  # the library objects whose functions have their argtypes


def _lib() -> ctypes.CDLL | None:
    lib = build.load("mechgeom._kernels", "contribution_rows.c")
    if lib is not None and _TYPED.get(id(lib)) is not lib:
        for name, argtypes in _ARGTYPES.items():
            for suffix in _SUFFIX.values():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.restype = None
                fn.argtypes = argtypes
        _TYPED[id(lib)] = lib
    return lib


def _fn(name: str, dtype: torch.dtype) -> Any:
    lib = _lib()
    assert lib is not None
    return getattr(lib, f"{name}_{_SUFFIX[dtype]}")


def available(pattern: Tensor) -> bool:
    """Whether the fused sweep can run on a layer with this pattern (see the module docstring)."""
    return pattern.device.type == "cpu" and pattern.dtype in _READS and _lib() is not None


def _threads(work: int) -> int:
    """Threads for a C call that writes ``work`` entries: PyTorch's count where the kernel shares its pool."""
    lib = _lib()
    if lib is None or work < _MIN_PARALLEL or not build.openmp(lib):
        return 1
    return max(1, torch.get_num_threads())


def _strides(t: Tensor, kind: str) -> tuple[int, int, int]:
    """Element strides ``(b, h, i)`` of a tensor laid out as ``kind`` (``"bhqk"``, ``"bhk"``, ``"bhq"``, ``"bqk"``
    or ``"bq"``), 0 for an axis it lacks; its last axis has unit stride."""
    s = dict(zip(kind, t.stride(), strict=True))
    return s["b"], s.get("h", 0), s.get("q", 0)


def _head_major(x: Tensor, geo: LayerGeometry, name: str) -> Tensor:
    """``[b pos h d] -> [h (b pos) d]``, contiguous: a view where ``x`` is laid out so (TransformerLens's ``z`` of
    one text), else a copy in ``geo``'s workspace."""
    B, P, H, D = x.shape
    view = x.permute(2, 0, 1, 3)
    if view.is_contiguous():
        return view.view(H, B * P, D)
    out = geo.scratch(name, (H, B, P, D))
    out.copy_(view)
    return out.view(H, B * P, D)


def _value_norms(
    geo: LayerGeometry, vh: Tensor, layouts: maths.WOGramLayouts, gram: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(‖vt[j,h]‖, 1/‖vt[j,h]‖ or 0, gram2)``, ``[b h k]`` each and ``gram2 [b h g k]`` (``G_j[h,h]`` on the
    diagonal, ``2 G_j[h,g]`` above it; only when ``gram``): see ``mg_value_gram`` in ``contribution_rows.c``."""
    B, K, H, D = geo.v.shape
    dtype = geo.dtype
    R = H // 2 + 1 if gram else 1  # r = 0 alone: M[h,:,h,:], the value norms
    mc = layouts.circulant[..., : R * D]  # [h d (r e)]
    vt_norm = geo.scratch("fused_vt_norm", (B, H, K))
    inv_vt = geo.scratch("fused_inv_vt", (B, H, K))
    gram2 = geo.scratch("fused_gram2", (B, H, H, K)) if gram else None  # read only at g >= h
    es = dtype.itemsize
    chunk = max(1, GRAM_CHUNK_BYTES // (H * R * D * es))
    reduce = _fn("mg_value_gram", dtype)
    for t0 in range(0, B * K, chunk):
        n = min(chunk, B * K - t0)
        y = geo.scratch("gram_y", (H, n, R * D))
        torch.bmm(vh[:, t0 : t0 + n], mc, out=y)  # v[j,h] M[h,:,(h+r)%H,:]
        reduce(
            H, R, D, K, B * K, t0, n,
            y.data_ptr(), vh.data_ptr(), 0 if gram2 is None else gram2.data_ptr(),
            vt_norm.data_ptr(), inv_vt.data_ptr(), _threads(H * n * R * D // 8),  # a dot product ~ 8 entries
        )  # fmt: skip
    return vt_norm, inv_vt, gram2


def _out_norms(
    geo: LayerGeometry, z: Tensor, hu: Tensor | None, lu: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """``(1/‖o[i,h]‖ [b h q], 1/‖o[i]‖ [b q])``, NaN where a norm is 0; ``None`` where its product is
    (``z`` ``[b q h d]`` in the sweep's dtype, ``hu`` head-major ``[h (b q) d]``, ``lu`` token-major
    ``[(b q) (h d)]``)."""
    B, Q, H, D = z.shape
    z = z if z.stride(-1) == 1 else z.contiguous()
    inv_oh = geo.scratch("fused_inv_oh", (B, H, Q)) if hu is not None else None
    inv_ol = geo.scratch("fused_inv_ol", (B, Q)) if lu is not None else None
    if hu is None and lu is None:
        return None, None
    _fn("mg_out_norms", geo.dtype)(
        B, H, Q, D, z.data_ptr(), z.stride(0), z.stride(1), z.stride(2),
        *(0 if t is None else t.data_ptr() for t in (hu, lu, inv_oh, inv_ol)),
    )  # fmt: skip
    return inv_oh, inv_ol


def sweep_blocks(
    geo: LayerGeometry, want: set[str], out: dict[str, Tensor], *, needs: Collection[str], zeroed: bool
) -> None:
    """Write the metrics ``want`` (a subset of :data:`OUTPUTS`) of ``geo`` into ``out`` (full ``[b h q k]`` /
    ``[b q k]`` tensors, unit stride along keys).

    Args:
        geo: The layer.
        want: The metrics to compute.
        out: Where to write each of them.
        needs: Every quantity and metric they need, by the names of the table in
            :mod:`mechgeom.analyses.contribution.metrics` (its ``plan(want)``): they say which of the kernel's
            inputs to compute (``vt_norm``, ``gram``, ``inv_head_norm``, ``inv_layer_norm``, and the raw
            products of ``factor_cos`` and ``head_share``).
        zeroed: ``out`` already holds 0 at every key after its query (see ``compute``).
    """
    if not want <= set(OUTPUTS):
        raise ValueError(f"the fused kernel has no slot for {sorted(want - set(OUTPUTS))}; it has {OUTPUTS}")
    # a half-precision pattern is upcast block by block in _rows; otherwise read in place
    upcast = geo.pattern.dtype != geo.dtype
    alpha = geo.pattern if upcast or geo.pattern.stride(-1) == 1 else geo.pattern.contiguous()
    B, H, Q, _ = alpha.shape
    D = geo.v.shape[-1]
    dtype = geo.dtype
    need_d1 = "factor_cos" in needs  # cos numerator z[i,h] M[h] . v[j,h]
    need_d2 = "head_share" in needs  # (o[i] @ W_O[h].T) . v[j,h]
    need_vn = need_d1 or "vt_norm" in needs  # the cosine divides by ‖vt‖
    need_vwi = "gram" in needs
    need_oh = need_d1 or "inv_head_norm" in needs  # and by ‖o[i,h]‖, from the product d1 is made of
    need_ol = need_d2 or "inv_layer_norm" in needs
    mod = geo.modified  # [b h q] or None
    layouts = maths.wo_gram_layouts(geo.wo_gram_full)

    with torch.no_grad():
        z = geo.z.to(dtype)  # [b q h d]
        zh = _head_major(z, geo, "fused_z") if need_oh else None  # [h (b q) d]
        vh = _head_major(geo.v.to(dtype), geo, "fused_v")  # [h (b k) d]
        # z[i,h] M[h] = o[i,h] @ W_O[h].T, head-major [h (b q) d]; o[i] @ W_O[h].T for every h at once as
        # z[i] @ M, token-major [(b q) (h d)] (one matmul, faster than one batched over heads: docs/benchmarks.md)
        hu = torch.bmm(zh, layouts.diag) if zh is not None else None
        lu = torch.mm(z.reshape(B * Q, H * D), layouts.square) if need_ol else None
        inv_oh, inv_ol = _out_norms(geo, z, hu, lu)
        if inv_oh is not None and mod is not None:  # no per-source terms for a modified head
            inv_oh.masked_fill_(mod, float("nan"))

        ins: dict[str, tuple[Tensor, str]] = {"alpha": (alpha, "bhqk")}
        if need_vn or need_vwi:
            vt_norm, inv_vt, gram2 = _value_norms(geo, vh, layouts, need_vwi)
            ins["vt_norm"], ins["inv_vt"] = (vt_norm, "bhk"), (inv_vt, "bhk")
            if gram2 is not None:
                ins["gram2"] = (gram2, "bhqk")
        if inv_oh is not None:
            ins["inv_oh"] = (inv_oh, "bhq")
        if inv_ol is not None:
            ins["inv_ol"] = (inv_ol, "bq")
        if mod is not None:
            ins["keep"] = ((~mod).to(dtype).contiguous(), "bhq")
        _rows(geo, want, ins, out, hu if need_d1 else None, lu if need_d2 else None, vh, zeroed=zeroed)


def _rows(
    geo: LayerGeometry,
    want: set[str],
    ins: dict[str, tuple[Tensor, str]],
    out: dict[str, Tensor],
    hu: Tensor | None,
    lu: Tensor | None,
    vh: Tensor,
    *,
    zeroed: bool,
) -> None:
    """The blocks of queries: per block one ``bmm`` for both raw products, then the row kernel over its rows."""
    alpha = ins["alpha"][0]
    B, H, Q, _ = alpha.shape
    D = vh.shape[-1]
    dtype = geo.dtype
    es = dtype.itemsize
    upcast = alpha.dtype != dtype  # half precision: the kernel reads each block's pattern upcast to dtype
    ptrs = (ctypes.c_void_p * len(SLOTS))()
    strides = (ctypes.c_int64 * (3 * len(SLOTS)))()

    def put(slot: str, ptr: int, st: tuple[int, int, int]) -> None:
        k = SLOTS.index(slot)
        ptrs[k] = ptr
        strides[3 * k : 3 * k + 3] = list(st)

    for name, (t, kind) in ins.items():
        if not (upcast and name == "alpha"):
            put(name, t.data_ptr(), _strides(t, kind))
    for name, t in out.items():
        assert t.stride(-1) == 1 and t.dtype == dtype
        put(name, t.data_ptr(), _strides(t, "bqk" if name.endswith("_inter") else "bhqk"))

    slots = [s for s, u in (("d1", hu), ("d2", lu)) if u is not None]
    kinds = len(slots)
    if kinds:  # [(h b) q kind d]: row i of kind k at row i * kinds + k, so that one bmm per block gives both
        left = geo.scratch("fused_left", (H * B, Q, kinds, D))
        heads = left.view(H, B, Q, kinds, D)
        if hu is not None:
            heads[:, :, :, 0] = hu.view(H, B, Q, D)
        if lu is not None:
            heads[:, :, :, kinds - 1] = lu.view(B, Q, H, D).permute(2, 0, 1, 3)
        # [(h b) d k], a view (keys = queries: the pattern is square)
        v_t = vh.view(H * B, Q, D).transpose(1, 2)
    step = geo.block_size or FUSED_BLOCK_SIZE
    rows = _fn("mg_contribution_rows", dtype)
    for q0 in range(0, Q, step):
        q1 = min(q0 + step, Q)
        n = q1 - q0
        k1 = q1 if geo.causal else Q
        if upcast:  # the block's rows q0:q1 (keys 0:k1) in dtype; the kernel indexes rows from 0, hence - q0
            a = geo.scratch("fused_alpha", (B, H, n, k1))
            a.copy_(alpha[:, :, q0:q1, :k1])
            put("alpha", a.data_ptr() - q0 * k1 * es, (H * n * k1, n * k1, k1))
        if kinds:
            d = geo.scratch("fused_products", (H * B, n * kinds, k1))
            torch.bmm(left[:, q0:q1].reshape(H * B, n * kinds, D), v_t[..., :k1], out=d)
            for k, slot in enumerate(slots):  # row i of the block: (i - q0) * kinds + k
                put(
                    slot,
                    d.data_ptr() + (k - q0 * kinds) * k1 * es,
                    (n * kinds * k1, B * n * kinds * k1, kinds * k1),
                )
        threads = _threads(B * n * H * k1)
        rows(B, H, Q, q0, q1, int(geo.causal), int(zeroed), threads, ptrs, strides)
