"""The blocked sweep of :class:`~mechgeom.analyses.contribution_geometry.LayerGeometry` with one fused pass per block.

Same numbers as the plain-torch sweep (SPEC.md §A; the formulas are those of
:mod:`mechgeom.analyses.contribution_geometry`, one function each there), arranged so that each metric
tensor is written once: per block of queries ``q0:q1``, one batched matmul (BLAS) gives both raw products
``z[i,h] M[h] . v[j,h]`` (the cosine's numerator) and ``(o[i] @ W_O[h].T) . v[j,h]`` (the head share's)
into a scratch block that stays in cache, then the C kernel ``contribution_rows.c`` makes one pass per
query row that reads ``alpha`` and those products and writes every requested metric, the four inter-head
ones included (the inter-head value norm ``sqrt(alpha^T G_j alpha)`` as well). The rows of a block are
shared out between ``torch.get_num_threads()`` threads (ctypes releases the GIL).

It runs where :func:`available` says so: a CPU tensor in float32 or float64, a C compiler on the machine
(:mod:`mechgeom._native`), and ``MECHGEOM_NATIVE`` not ``0``; everywhere else the plain-torch sweep runs.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import einops
import torch

from mechgeom import _native
from mechgeom.typing import Tensor

if TYPE_CHECKING:
    from mechgeom.analyses.contribution_geometry import LayerGeometry

__all__ = ["SLOTS", "available", "sweep_blocks"]

#: The kernel's argument slots, in order (see ``contribution_rows.c``).
SLOTS = (
    "alpha",
    "d1",
    "d2",
    "vt_norm",
    "inv_vt",
    "inv_oh",
    "inv_ol",
    "keep",
    "gram2",
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
_SYMBOLS = {torch.float32: "mg_contribution_rows_f32", torch.float64: "mg_contribution_rows_f64"}
_POOL: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
#: Work per block (query rows x keys x heads x texts) below which one thread does it. The kernel writes at about
#: the bandwidth one core gets, and right after a matmul BLAS's own threads still hold the other cores: measured
#: in situ on 2 cores, splitting rows did not pay at 1x256 or 1x1024 (blocks of 64 queries: 0.15-0.6M entries).
_MIN_PARALLEL = 1 << 21


def _kernel(dtype: torch.dtype) -> Callable[..., None] | None:
    if dtype not in _SYMBOLS:
        return None
    lib = _native.load("mechgeom.analyses", "contribution_rows.c")
    if lib is None:
        return None
    fn = getattr(lib, _SYMBOLS[dtype])
    fn.restype = None
    fn.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_void_p]
    return fn  # type: ignore[no-any-return]


def available(pattern: Tensor) -> bool:
    """Whether the fused sweep can run on this layer (see the module docstring)."""
    return pattern.device.type == "cpu" and _kernel(pattern.dtype) is not None


def _pool(n: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if n not in _POOL:
            _POOL[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mechgeom-rows")
        return _POOL[n]


def _strides(t: Tensor, kind: str) -> tuple[int, int, int]:
    """Element strides ``(b, h, i)`` of a tensor laid out as ``kind`` (``"bhqk"``, ``"bhk"``, ``"bhq"``, ``"bqk"``
    or ``"bq"``), 0 for an axis it lacks; its last axis has unit stride."""
    s = dict(zip(kind, t.stride(), strict=True))
    return s["b"], s.get("h", 0), s.get("q", 0)


def sweep_blocks(geo: LayerGeometry, want: set[str], out: dict[str, Tensor], *, zeroed: bool) -> None:
    """Write the metrics ``want`` of ``geo`` into ``out`` (full ``[b h q k]`` / ``[b q k]`` tensors, unit stride
    along keys); ``zeroed``: ``out`` already holds 0 at every key after each block (see ``compute``)."""
    from mechgeom.analyses.contribution_geometry import FUSED_BLOCK_SIZE, _inv_or_nan, _inv_or_zero

    alpha = geo.pattern if geo.pattern.stride(-1) == 1 else geo.pattern.contiguous()
    B, H, Q, _ = alpha.shape
    D = geo.v.shape[-1]
    dtype = alpha.dtype
    kernel = _kernel(dtype)
    assert kernel is not None
    need_d1 = bool(want & {"factor_cos", "contribution"})
    need_d2 = bool(want & {"head_share", "contribution_inter"})
    need_vn = need_d1 or bool(want & {"value_weighted", "value_weighted_normalized", "factor_norm_ratio"})
    need_vwi = bool(want & {"value_weighted_inter", "value_weighted_normalized_inter"})
    need_ol = need_d2 or need_vwi
    mod = geo.modified  # [b h q] or None
    step = geo.block_size or FUSED_BLOCK_SIZE

    ins: dict[str, tuple[Tensor, str]] = {}
    if need_vwi:  # first, so that vt_norm is read off its diagonal
        gram = einops.rearrange(geo.gram, "b k h g -> b h g k")
        eye = torch.eye(H, dtype=torch.bool, device=alpha.device)[None, :, :, None]
        ins["gram2"] = (torch.where(eye, gram, gram * 2).contiguous(), "bhqk")
    if need_vn:
        vt_norm = geo.vt_norm.contiguous()  # [b h k]
        ins["vt_norm"] = (vt_norm, "bhk")
        ins["inv_vt"] = (_inv_or_zero(vt_norm).contiguous(), "bhk")
    if need_vn or need_d1:
        inv_oh = _inv_or_nan(geo.head_out_norm)  # [b h q]
        if mod is not None:  # no per-source terms for a modified head
            inv_oh = inv_oh.masked_fill(mod, float("nan"))
        ins["inv_oh"] = (inv_oh.contiguous(), "bhq")
    if need_ol:
        ins["inv_ol"] = (_inv_or_nan(geo.layer_out_norm).contiguous(), "bq")
    if mod is not None:
        ins["keep"] = ((~mod).to(dtype).contiguous(), "bhq")
    ins["alpha"] = (alpha, "bhqk")

    kinds = [u for u, need in ((geo.head_u, need_d1), (geo.layer_u, need_d2)) if need]
    n_kinds = len(kinds)
    if n_kinds:  # [b h q kind d]: the left operands of one matmul per block, row 2i+kind
        left = geo.scratch("fused_left", (B, H, Q, n_kinds, D))
        for kind_i, u in enumerate(kinds):
            left[:, :, :, kind_i] = einops.rearrange(u, "b q h d -> b h q d")
        v_t = einops.rearrange(geo.v.to(dtype), "b k h d -> (b h) d k").contiguous()
        bs = min(step, Q)
        scratch = geo.scratch("fused_products", (B * H * n_kinds * bs * Q,))

    ptrs = (ctypes.c_void_p * len(SLOTS))()
    strides = (ctypes.c_int64 * (3 * len(SLOTS)))()
    es = alpha.element_size()

    def put(slot: str, t: Tensor, kind: str, offset_rows: int = 0, row_elems: int = 0) -> None:
        k = SLOTS.index(slot)
        sb, sh, si = _strides(t, kind)
        ptrs[k] = t.data_ptr() - offset_rows * row_elems * es
        strides[3 * k : 3 * k + 3] = [sb, sh, si]

    for name, (t, kind) in ins.items():
        put(name, t, kind)
    for name, t in out.items():
        assert t.stride(-1) == 1 and t.dtype == dtype
        put(name, t, "bqk" if name.endswith("_inter") else "bhqk")
    n_threads = max(1, torch.get_num_threads())

    for q0 in range(0, Q, step):
        q1 = min(q0 + step, Q)
        n = q1 - q0
        k1 = q1 if geo.causal else Q
        if n_kinds:
            d = scratch[: B * H * n_kinds * n * k1].view(B * H, n_kinds * n, k1)
            lhs = left[:, :, q0:q1].reshape(B * H, n_kinds * n, D)
            torch.matmul(lhs, v_t[..., :k1], out=d)
            d4 = d.view(B, H, n_kinds * n, k1)
            # row i of the block is row (i - q0) * n_kinds + kind of d: strides (b, h, n_kinds * k1)
            for kind_i, slot in enumerate(s for s, need in (("d1", need_d1), ("d2", need_d2)) if need):
                k = SLOTS.index(slot)
                ptrs[k] = d4.data_ptr() + (kind_i * k1 - q0 * n_kinds * k1) * es
                strides[3 * k : 3 * k + 3] = [H * n_kinds * n * k1, n_kinds * n * k1, n_kinds * k1]
        rows = B * n * k1 * H
        t_use = min(n_threads, n) if rows >= _MIN_PARALLEL else 1
        args = (B, H, Q, q0, q1)
        flags = (int(geo.causal), int(zeroed))
        if t_use == 1:
            kernel(*args, 0, 1, *flags, ptrs, strides)
        else:
            jobs = [_pool(t_use).submit(kernel, *args, t, t_use, *flags, ptrs, strides) for t in range(t_use)]
            for job in jobs:
                job.result()
