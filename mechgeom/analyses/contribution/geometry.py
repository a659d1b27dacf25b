"""The per-layer kernels of ``docs/definitions.md`` §2: :class:`LayerGeometry` and its blocked sweep over queries.

For one layer (batch ``b``, head ``h``, query ``i``, source ``j <= i``; every ``j`` on an encoder), with ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``z = hook_z`` and ``W_O`` from the model: projected value
``vt[j,h] = v[j,h] @ W_O[h]``, head output ``o[i,h] = z[i,h] @ W_O[h]``, layer output ``o[i] = sum_h o[i,h]``
(no ``b_O``). The conventions (zero output norm, basis, modified heads) are those of
:mod:`mechgeom.analyses.contribution.weights`, which collects these metrics over layers.

Every metric costs one ``q x k`` product in ``d_head`` per head, like attention itself, because
``<o, vt[j,h]> = v[j,h] . (o @ W_O[h].T)``. No ``[batch, head, q, k, d_model]`` tensor is ever built.
The inter-head value norm is ``alpha^T G_j alpha`` with the ``[head, head]`` Gram matrix ``G_j`` of
token ``j``'s projected values. Norms of head outputs and projected values are quadratic forms in
``d_head`` with ``M[h] = W_O[h] W_O[h].T`` (:func:`mechgeom.maths.wo_gram`).

**Causal layout.** Metrics are ``[.., query_pos, key_pos]`` with every entry above the diagonal
(``key > query``, not a source) exactly 0, factors included. They are computed in blocks of queries
(``block_size``), each against only the keys it can see, so about half of the ``q x k`` work of a full
square is skipped. The pattern is taken as causal, as a decoder's is (mechgeom's interventions keep it so),
unless ``causal=False``.

**The metrics are data.** Each is a row of :data:`mechgeom.analyses.contribution.metrics.METRICS`: its name,
scope, the quantities and metrics it needs, and its formula on one block of queries. The plain-torch sweep
prepares the closure of those needs once per layer and evaluates each needed metric once per block.

**Two sweeps, one set of numbers.** On CPU (activations in float32/float64, or half precision computed in
float32), where a C compiler is present, the blocked
sweep of the metrics the C kernel has slots for is :mod:`~mechgeom._kernels.fused`: per block one matmul for
both raw products and one pass of a small C kernel (built on first use, see :mod:`mechgeom._kernels.build`)
that writes every metric once. Any other metric, and all of them elsewhere (GPU, other dtypes, no compiler,
``MECHGEOM_NATIVE=0``), runs on the plain-torch sweep below. The tests run both against the brute force.

**Half precision.** A model in bfloat16 or float16 gives its activations as they are: ``pattern`` stays in
that dtype and is upcast to float32 one block of queries at a time (no float32 copy of a ``[b h q k]``
tensor beyond one block), ``v``, ``z`` and ``W_O`` (no ``q x k`` axis) once per layer, and every metric is
computed and accumulated in float32 (:attr:`LayerGeometry.dtype`). The model's ``z`` is ``sum_j alpha v_j``
rounded to its dtype; it is recomputed in float32 from the same ``alpha`` and ``v`` (one attention product
per layer), except at heads an earlier hook modified, so that ``o[i,h]`` is the sum of its sources' terms and
rows sum to 1 to float32 rounding whatever the model's dtype. float32 and float64 activations are computed in
their own dtype, with the model's ``z``.

**Encoder layout** (``causal=False``, a bidirectional model): every query is computed against every key.
With ``key_mask`` (``[batch, key_pos]``, ``False`` at padding), every metric is exactly 0 wherever the key or
the query is padding, factors included: padding is neither a source nor a query.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property

import einops
import torch

from mechgeom import maths
from mechgeom._kernels import fused
from mechgeom.analyses.contribution import metrics
from mechgeom.analyses.contribution.metrics import INTER_METRICS, INTRA_METRICS
from mechgeom.hooks import LayerActivations, head_outputs
from mechgeom.typing import WO, Bool, Float, HeadScores, LayerScores, Pattern, Tensor, Values, Z

__all__ = [
    "BLOCK_SIZE",
    "FUSED_BLOCK_SIZE",
    "HALF_DTYPES",
    "INTER_METRICS",
    "INTRA_METRICS",
    "LayerGeometry",
    "compute_dtype",
]

#: Queries per block of the blocked computation (see "Causal layout" in the module docstring): the plain-torch
#: sweep's default (fewer, larger tensor operations pay there, on a GPU above all).
BLOCK_SIZE = 128
#: The fused sweep's default (:data:`mechgeom._kernels.fused.FUSED_BLOCK_SIZE`).
FUSED_BLOCK_SIZE = fused.FUSED_BLOCK_SIZE
#: Tokens per batched matmul of :attr:`LayerGeometry.gram` (its temporary is ``[head, tokens, d_model]``).
GRAM_CHUNK = 256
#: Activation dtypes whose metrics are computed in float32 (see "Half precision" in the module docstring).
HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the metrics of activations in ``dtype`` are computed in: float32 for bfloat16 and float16
    (their 8 and 11 significant bits would round every sum to about 1e-2 and 1e-3), else ``dtype`` itself."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


class LayerGeometry:
    """The shared pieces of one layer's metrics, each computed once and only when asked for.

    Shapes: ``pattern [batch head q k]``, ``v [batch pos head d_head]`` (expanded),
    ``z [batch pos head d_head]``, ``W_O [head d_head d_model]``. :meth:`compute` returns several metrics
    in one blocked sweep (what :class:`ContributionCollector` uses); the per-metric methods return the same
    numbers one at a time and keep them.
    """

    def __init__(
        self,
        pattern: Pattern,
        v: Values,
        z: Z,
        W_O: WO,
        *,
        block_size: int | None = None,
        modified: Bool[Tensor, "batch head_index query_pos"] | None = None,
        causal: bool = True,
        key_mask: Bool[Tensor, "batch key_pos"] | None = None,
        workspace: dict[str, Tensor] | None = None,
        keys_only: bool = False,
        window: int | None = None,
    ) -> None:
        if pattern.shape[-1] != pattern.shape[-2]:
            raise ValueError(
                f"the pattern must be square [.., q, k] (no KV cache); got {tuple(pattern.shape)}"
            )
        #: The dtype every metric is computed and returned in (:func:`compute_dtype` of the pattern's).
        self.dtype = compute_dtype(pattern.dtype)
        #: As given (a half-precision pattern is upcast one block of queries at a time, never whole).
        self.pattern = pattern
        # no q x k axis: upcast once per layer (a no-op in float32/float64)
        self.v = v.to(self.dtype)
        self.z = z.to(self.dtype)
        self.W_O = W_O.to(self.dtype)
        self._W_O_given = (
            W_O  # the weight Gram's cache is keyed on the model's own tensor (maths.wo_gram_full)
        )
        #: Queries per block; ``None``: each sweep's own default (:data:`BLOCK_SIZE`, :data:`FUSED_BLOCK_SIZE`).
        self.block_size = None if block_size is None else max(1, int(block_size))
        #: ``[b h q]`` heads whose ``z`` an earlier hook changed (see the module docstring); ``None`` = none.
        self.modified = modified if modified is not None and bool(modified.any()) else None
        self.causal = bool(causal)
        # half precision: z as the float32 sum it is a rounding of (not needed by the quantities of the key
        # axis alone, which is all keys_only=True asks for: the kept rows of queries= remix their own z)
        if pattern.dtype != self.dtype and not keys_only:
            self.z = self._mixed_values(self.z)
        #: ``[b k]`` real (non-padding) tokens of an encoder's batch; ``None`` = all real.
        self.key_mask = key_mask if key_mask is not None and not bool(key_mask.all()) else None
        #: A sliding-window layer's width: the keys ``j <= i - window`` are not sources of query ``i`` (0 in every
        #: metric, factors included); ``None``: every key up to the query is.
        self.window = window if causal and window is not None and window < pattern.shape[-1] else None
        self._metrics: dict[str, Tensor] = {}
        #: Temporaries kept between layers (by whoever passes the dict, e.g. a collector), so that memory the
        #: allocator would hand back to the system is not faulted in again every layer. Never returned.
        self.workspace = workspace

    def scratch(self, name: str, shape: Sequence[int]) -> Tensor:
        """A temporary of ``shape`` (contents undefined): a view of ``workspace[name]`` when there is a workspace
        (grown when too small), else fresh memory."""
        numel = math.prod(shape)
        like = self.pattern
        if self.workspace is None:
            return like.new_empty(shape, dtype=self.dtype)
        buf = self.workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != self.dtype or buf.device != like.device:
            buf = self.workspace[name] = like.new_empty(numel, dtype=self.dtype)
        return buf[:numel].view(shape)

    def _mixed_values(self, z: Z) -> Z:
        """``sum_j alpha[h,i,j] v[j,h]`` in :attr:`dtype` (one block of queries of the pattern upcast at a time),
        and ``z`` itself at modified heads.

        A half-precision model's ``z`` is this sum rounded to its dtype (off by up to ``2**-8`` of its norm in
        bfloat16): taken as it is, ``o[i,h] = z[i,h] @ W_O[h]`` would not be the sum of its sources' terms, and
        the rows of the contribution would sum to 1 only to about 3e-3. A head an earlier hook changed is
        told apart by :func:`mechgeom.hooks.modified_mask` at twice that rounding, and keeps the model's ``z``.
        """
        B, H, Q, K = self.pattern.shape
        v = einops.rearrange(self.v, "b k h d -> b h k d")
        mixed = v.new_empty((B, H, Q, v.shape[-1]))
        step = self.block_size or BLOCK_SIZE
        for q0 in range(0, Q, step):
            q1 = min(q0 + step, Q)
            k1 = q1 if self.causal and Q == K else K
            torch.matmul(self.pattern[:, :, q0:q1, :k1].to(self.dtype), v[:, :, :k1], out=mixed[:, :, q0:q1])
        out = einops.rearrange(mixed, "b h q d -> b q h d").contiguous()
        if self.modified is not None:
            keep = einops.rearrange(self.modified, "b h q -> b q h")[..., None]
            out = torch.where(keep, z, out)
        return out

    @classmethod
    def from_activations(
        cls,
        acts: LayerActivations,
        *,
        block_size: int | None = None,
        workspace: dict[str, Tensor] | None = None,
    ) -> LayerGeometry:
        return cls(
            acts.pattern,
            acts.v,
            acts.z,
            acts.W_O,
            block_size=block_size,
            modified=acts.modified,
            causal=acts.causal,
            key_mask=acts.key_mask,
            workspace=workspace,
            window=acts.window,
        )

    # ---- outputs and values in d_model (the metrics only need projected_values, for the Gram matrix)
    @cached_property
    def head_out(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``o[i,h] = z[i,h] @ W_O[h]``."""
        return head_outputs(self.z, self.W_O)

    @cached_property
    def layer_out(self) -> Float[Tensor, "batch pos d_model"]:
        """``o[i] = sum_h o[i,h]`` (no ``b_O``)."""
        return einops.einsum(self.z, self.W_O, "b q h d, h d m -> b q m")

    @cached_property
    def projected_values(self) -> Float[Tensor, "batch pos head_index d_model"]:
        """``vt[j,h] = v[j,h] @ W_O[h]`` (``d_model`` per token and head, no ``q`` axis)."""
        return head_outputs(self.v, self.W_O)

    # ---- norms and products in d_head (never q x k x d_model)
    @cached_property
    def wo_gram_full(self) -> Float[Tensor, "head_index d_head head_index2 d_head2"]:
        """``M[h,:,g,:] = W_O[h] @ W_O[g].T`` (weight-only, cached per ``W_O``: :func:`mechgeom.maths.wo_gram_full`)."""
        return maths.wo_gram_full(self._W_O_given, dtype=self.dtype)

    @cached_property
    def wo_gram(self) -> Float[Tensor, "head_index d_head d_head2"]:
        """``M[h] = W_O[h] @ W_O[h].T``, so that ``<x @ W_O[h], y @ W_O[h]> = x M[h] y`` (:func:`mechgeom.maths.wo_gram`:
        the diagonal blocks of :attr:`wo_gram_full`)."""
        return einops.rearrange(torch.diagonal(self.wo_gram_full, dim1=0, dim2=2), "d e h -> h d e")

    @cached_property
    def head_u(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """``o[i,h] @ W_O[h].T = z[i,h] M[h]``."""
        return einops.einsum(self.z, self.wo_gram, "b q h d, h d e -> b q h e")

    @cached_property
    def layer_u(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """``o[i] @ W_O[h].T = sum_g z[i,g] M[g,:,h,:]`` for every head ``h``."""
        h = self.z.shape[2]
        z = einops.rearrange(self.z, "b q h d -> b q (h d)")
        m = einops.rearrange(self.wo_gram_full, "h d g e -> (h d) (g e)")
        return einops.rearrange(z @ m, "b q (g e) -> b q g e", g=h)

    @cached_property
    def vt_norm(self) -> Float[Tensor, "batch head_index key_pos"]:
        """``‖vt[j,h]‖ = sqrt(v[j,h] M[h] v[j,h])`` (the square root of :attr:`gram`'s diagonal once that is computed)."""
        if "gram" in self.__dict__:  # G_j[h,h] = ‖vt[j,h]‖²
            diag = torch.diagonal(self.__dict__["gram"], dim1=-2, dim2=-1)  # [b k h]
            return einops.rearrange(diag, "b k h -> b h k").clamp_min(0).sqrt()
        vm = einops.einsum(self.v, self.wo_gram, "b k h d, h d e -> b k h e")
        sq = einops.einsum(vm, self.v, "b k h d, b k h d -> b h k")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def head_out_norm(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``‖o[i,h]‖ = sqrt(z[i,h] M[h] z[i,h])``."""
        sq = einops.einsum(self.z, self.head_u, "b q h d, b q h d -> b h q")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def layer_out_norm(self) -> Float[Tensor, "batch query_pos"]:
        """``‖o[i]‖ = sqrt(sum_h z[i,h] . (o[i] @ W_O[h].T))``."""
        sq = einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b q")
        return sq.clamp_min(0).sqrt()

    @cached_property
    def dot_head(self) -> HeadScores:
        """``<o[i,h], vt[j,h]> = v[j,h] . (o[i,h] @ W_O[h].T)``, computed in ``d_head`` (full square)."""
        return einops.einsum(self.head_u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def dot_layer(self) -> HeadScores:
        """``<o[i], vt[j,h]> = v[j,h] . (o[i] @ W_O[h].T)``, computed in ``d_head`` (full square)."""
        return einops.einsum(self.layer_u, self.v, "b q h d, b k h d -> b h q k")

    @cached_property
    def output_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """``<o[i], o[i,h]> / ‖o[i]‖² = z[i,h] . (o[i] @ W_O[h].T) / ‖o[i]‖²``: head ``h``'s part of ``o[i]``."""
        dots = einops.einsum(self.z, self.layer_u, "b q h d, b q h d -> b h q")
        return dots * (metrics.inv_or_nan(self.layer_out_norm) ** 2)[:, None, :]

    @cached_property
    def modified_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """The share ``<o[i], o[i,h]> / ‖o[i]‖²`` of each *modified* head (0 for unmodified heads)."""
        zeros = self.pattern.new_zeros(self.pattern.shape[:-1], dtype=self.dtype)
        if self.modified is None:
            return zeros
        return torch.where(self.modified, self.output_share, zeros)

    @cached_property
    def gram(self) -> Float[Tensor, "batch key_pos head_index head_index2"]:
        """``G_j[h,g] = <vt[j,h], vt[j,g]> = v[j,h] M[h,:,g,:] v[j,g]``, the per-token ``[head, head]`` Gram matrix.

        Computed in ``d_head`` from :attr:`wo_gram_full`, each unordered pair of heads once (``G`` is
        symmetric): head ``h`` takes the heads ``g = (h + r) mod H`` for ``r = 0 .. H // 2``, which covers
        every pair, so one batched matmul gives ``y[j,h,r] = v[j,h] M[h,:,g,:]`` for all of them
        (``[head, tokens, (H // 2 + 1) * d_head]``, at most :data:`GRAM_CHUNK` tokens at a time), and its
        product with ``v[j,g]`` summed over ``d_head`` gives ``G``; no ``d_model`` vector of a token is ever formed.
        """
        B, K, H, D = self.v.shape
        R = H // 2 + 1
        mc, cols, hg, gh = maths.wo_gram_circulant(self.wo_gram_full)
        v = self.v.reshape(B * K, H, D)
        # [(h r) (b k) d]: head h's values, then heads 0 .. R-2 again, so that head (h + r) % H is row h + r
        v_wrap = self.scratch("gram_v", (H + R - 1, B * K, D))
        v_wrap[:H] = v.transpose(0, 1)
        v_wrap[H:] = v_wrap[: R - 1]
        out = v.new_empty((B * K, H * H))
        for t0 in range(0, B * K, GRAM_CHUNK):
            n = min(GRAM_CHUNK, B * K - t0)
            y = self.scratch("gram_y", (H, n, R, D))
            torch.bmm(v_wrap[:H, t0 : t0 + n], mc, out=y.view(H, n, R * D))  # v[j,h] M[h,:,(h+r)%H,:]
            v_g = v_wrap.as_strided(  # [h n r d]: v[j, (h+r)%H]
                (H, n, R, D), (B * K * D, D, B * K * D, 1), v_wrap.storage_offset() + t0 * D
            )
            y.mul_(v_g)
            pairs = einops.rearrange(y.sum(-1), "h n r -> n (h r)")
            if cols is not None:
                pairs = pairs[:, cols]
            block = out[t0 : t0 + n]
            block[:, hg] = pairs
            block[:, gh] = pairs
        return out.view(B, K, H, H)

    # ---- the metrics of docs/definitions.md §2.1, one method each (their formulas are rows of metrics.METRICS)
    def attention(self, out: HeadScores | None = None) -> HeadScores:
        """Raw attention, intra-head: ``alpha[h,i,j]`` (0 at an encoder's padded queries too, see ``key_mask``),
        in :attr:`dtype`; written into ``out`` when given (any float dtype: the pattern is copied once, with
        no temporary), else the pattern itself where no copy is needed."""
        if out is not None:
            out.copy_(self.pattern)
            if self.key_mask is not None:
                real = self.key_mask[:, None, :, None] & self.key_mask[:, None, None, :]  # [b 1 q k]
                out.masked_fill_(~real, 0)
            self._metrics["attention"] = out
            return out
        if "attention" not in self._metrics:
            if self.key_mask is None and self.pattern.dtype == self.dtype:
                return self.pattern
            self._metrics["attention"] = self.attention(
                self.pattern.new_empty(self.pattern.shape, dtype=self.dtype)
            )
        return self._metrics["attention"]

    def attention_inter(self) -> LayerScores:
        """Raw attention, inter-head: ``mean_h alpha[h,i,j]``."""
        return self._get("attention_inter")

    def value_weighted(self) -> HeadScores:
        """Value-weighted attention (Kobayashi 2020), intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖``."""
        return self._get("value_weighted")

    def value_weighted_inter(self) -> LayerScores:
        """Value-weighted, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(alpha^T G_j alpha)``."""
        return self._get("value_weighted_inter")

    def value_weighted_normalized(self) -> HeadScores:
        """Value-weighted, output-normalised, intra-head: ``alpha[h,i,j] * ‖vt[j,h]‖ / ‖o[i,h]‖``."""
        return self._get("value_weighted_normalized")

    def value_weighted_normalized_inter(self) -> LayerScores:
        """Value-weighted, output-normalised, inter-head: ``‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖``."""
        return self._get("value_weighted_normalized_inter")

    def contribution(self) -> HeadScores:
        """Contribution weight, intra-head: ``c[h,i,j] = <o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖²``.

        Sums to 1 over ``j``; can be negative. NaN where ``‖o[i,h]‖ = 0``.
        """
        return self._get("contribution")

    def head_share(self) -> HeadScores:
        """Per-head share of the inter-head weight: ``c[h→i,j] = <o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖²``.

        Sums to 1 over ``(h, j)``. NaN where ``‖o[i]‖ = 0``.
        """
        return self._get("head_share")

    def contribution_inter(self) -> LayerScores:
        """Contribution weight, inter-head: ``c[i,j] = <o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h c[h→i,j]``."""
        return self._get("contribution_inter")

    def factor_norm_ratio(self) -> HeadScores:
        """Relative magnitude factor ``‖vt[j,h]‖ / ‖o[i,h]‖`` (NaN where ``‖o[i,h]‖ = 0``)."""
        return self._get("factor_norm_ratio")

    def factor_cos(self) -> HeadScores:
        """Directional alignment factor ``cos(o[i,h], vt[j,h])``.

        NaN where ``‖o[i,h]‖ = 0``; 0 where ``‖vt[j,h]‖ = 0``. With the other two factors,
        ``c[h,i,j] = alpha * (‖vt‖/‖o‖) * cos``.
        """
        return self._get("factor_cos")

    def intra(self, name: str) -> HeadScores:
        """The intra-head metric ``name`` (a row of :data:`~mechgeom.analyses.contribution.metrics.METRICS`)."""
        return self._metric(metrics.lookup(name, "intra"))

    def inter(self, name: str) -> LayerScores:
        """The inter-head metric ``name`` (a row of :data:`~mechgeom.analyses.contribution.metrics.METRICS`)."""
        return self._metric(metrics.lookup(name, "inter"))

    def _metric(self, m: metrics.Metric) -> Tensor:
        return getattr(self, m.key)() if m.formula is None else self._get(m.key)

    # ---- the blocked sweep
    def _get(self, key: str) -> Tensor:
        if key not in self._metrics:
            self._sweep([key])
        return self._metrics[key]

    def compute(
        self,
        intra: Sequence[str] = INTRA_METRICS,
        inter: Sequence[str] = INTER_METRICS,
        *,
        out_intra: dict[str, Tensor] | None = None,
        out_inter: dict[str, Tensor] | None = None,
        zeroed: bool = False,
    ) -> tuple[dict[str, HeadScores], dict[str, LayerScores]]:
        """Several metrics in one blocked sweep: ``({intra name: [b h q k]}, {inter name: [b q k]})``.

        ``out_intra`` / ``out_inter`` optionally give tensors (or views) of the right shape to write the
        metrics into, e.g. to reuse memory across layers; the returned tensors are then those. A buffer in
        another float dtype than :attr:`dtype` (e.g. bfloat16 outputs of a float32 computation) gets the metric
        computed in :attr:`dtype` and then copied into it (one layer's temporary).
        ``zeroed=True`` promises that those tensors already hold 0 at every key after its query
        (``key > query``), e.g. because they hold an earlier layer's metrics of a causal model with the same
        shape, untouched since; the fused sweep then does not write those entries again (the plain one
        writes the keys after a query up to the end of its block).

        Raises:
            ValueError: A name that is not a row of :data:`~mechgeom.analyses.contribution.metrics.METRICS`.
        """
        rows = [metrics.lookup(m, "intra") for m in intra] + [metrics.lookup(m, "inter") for m in inter]
        buffers = {metrics.lookup(m, "intra").key: t for m, t in (out_intra or {}).items()}
        buffers.update({metrics.lookup(m, "inter").key: t for m, t in (out_inter or {}).items()})
        keys = [r.key for r in rows if r.formula is not None and r.key not in self._metrics]
        self._sweep(keys, buffers, zeroed=zeroed)
        if "attention" in intra and "attention" in buffers:  # the pattern copied straight into its buffer
            self.attention(buffers["attention"])
        return {m: self.intra(m) for m in intra}, {m: self.inter(m) for m in inter}

    def _sweep(
        self, keys: Sequence[str], buffers: dict[str, Tensor] | None = None, *, zeroed: bool = False
    ) -> None:
        """Compute ``keys`` into ``self._metrics``, one block of queries ``q0:q1`` at a time against keys ``0:q1``
        (every key when not causal).

        The metrics the C kernel has slots for (:data:`mechgeom._kernels.fused.OUTPUTS`) run on the fused
        sweep where it is available, the others (and all of them elsewhere) on the plain one.
        """
        if not keys:
            return
        with torch.no_grad():
            self._sweep_blocks(set(keys), buffers or {}, zeroed=zeroed and buffers is not None)

    def _sweep_blocks(self, want: set[str], buffers: dict[str, Tensor], *, zeroed: bool) -> None:
        alpha = self.pattern
        B, H, Q, _ = alpha.shape
        out = {}
        fresh = set()
        staged: dict[
            str, Tensor
        ] = {}  # buffers in another float dtype (out_dtype): computed here, then copied
        for k in want:
            shape = (B, Q, Q) if metrics.lookup(k).scope == "inter" else (B, H, Q, Q)
            buf = buffers.get(k)
            if buf is not None and (tuple(buf.shape) != shape or not buf.dtype.is_floating_point):
                raise ValueError(
                    f"buffer for {k!r} is {tuple(buf.shape)} {buf.dtype}, need {shape} in a float dtype "
                    f"(the metrics are computed in {self.dtype})"
                )
            if buf is not None and buf.dtype != self.dtype:
                staged[k], buf = buf, None
            if buf is None:
                fresh.add(k)
            out[k] = alpha.new_empty(shape, dtype=self.dtype) if buf is None else buf
        plain = set(want)
        kernel = want & set(fused.OUTPUTS)
        if kernel and fused.available(self.pattern) and all(out[k].stride(-1) == 1 for k in kernel):
            if zeroed:  # the kernel writes the keys after a query only where the buffer is not known to be 0
                for k in fresh & kernel:
                    out[k].zero_()
            quantities, steps = metrics.plan(kernel)
            needs = {q.name for q in quantities} | {m.key for m in steps}
            fused.sweep_blocks(self, kernel, {k: out[k] for k in kernel}, needs=needs, zeroed=zeroed)
            plain -= kernel
        if plain:
            to_zero = [out[k] for k in plain if k in fresh or not zeroed]
            self._eager_blocks(plain, {k: out[k] for k in plain}, to_zero)
        if self.key_mask is not None:  # an encoder's padding: neither a source nor a query
            real = self.key_mask[:, :, None] & self.key_mask[:, None, :]  # [b q k]
            for k, t in out.items():
                t.masked_fill_(~(real if metrics.lookup(k).scope == "inter" else real[:, None]), 0)
        if (
            self.window is not None
        ):  # a sliding window: the keys before it are not sources (alpha-free factors)
            pos = torch.arange(alpha.shape[-1], device=alpha.device)
            before = pos[None, :] <= pos[:, None] - self.window  # [q k]
            for t in out.values():
                t.masked_fill_(before, 0)
        for k, buf in staged.items():
            out[k] = buf.copy_(out[k])
        self._metrics.update(out)

    def _eager_blocks(self, want: set[str], out: dict[str, Tensor], to_zero: list[Tensor]) -> None:
        """The plain-torch sweep (the fused one, :mod:`~mechgeom._kernels.fused`, gives the same numbers) of the
        metrics ``want`` into ``out``; ``to_zero``: the outputs whose keys after each block must be written 0.

        What it computes is read off the table (:func:`mechgeom.analyses.contribution.metrics.plan`): the
        quantities the metrics need, once per layer, then per block every metric they need, once each (into
        ``out`` where it is kept), each by its row's formula.
        """
        quantities, steps = metrics.plan(want)
        prepared: dict[str, Tensor] = {}
        for quantity in quantities:
            prepared[quantity.name] = quantity.prepare(self, prepared)
        alpha = self.pattern
        Q = alpha.shape[-1]
        keep = None if self.modified is None else (~self.modified).to(self.dtype)[..., None]  # [b h q 1]
        # alpha-weighted outputs are already 0 above the diagonal, except in NaN rows; factors never are
        factors = [t for k, t in out.items() if metrics.lookup(k).factor]
        nan_rows = self._nan_rows(quantities, prepared)
        step = self.block_size or BLOCK_SIZE
        bs = min(step, Q)
        upper = torch.ones(bs, bs, dtype=torch.bool, device=alpha.device).triu_(1)  # key > query in a block
        lower = (~upper).to(self.dtype)  # 1 where key <= query: a product zeroes the rest (faster)

        for q0 in range(0, Q, step):
            q1 = min(q0 + step, Q)
            k1 = q1 if self.causal else Q  # the keys these queries see
            block = _Block(self, prepared, keep, q0, q1, k1)
            for m in steps:
                assert m.formula is not None
                block.done[m.key] = m.formula(block, out[m.key][..., q0:q1, :k1] if m.key in out else None)

            if not self.causal:
                continue
            # not sources: keys after the block, and the block's own upper triangle (key > query)
            if q1 < Q:
                for t in to_zero:
                    t[..., q0:q1, q1:].zero_()
            n = q1 - q0
            if any(nan_rows[q0:q1]):  # NaN * 0 is NaN: fill instead
                for t in out.values():
                    t[..., q0:q1, q0:q1].masked_fill_(upper[:n, :n], 0)
            else:
                for t in factors:
                    t[..., q0:q1, q0:q1].mul_(lower[:n, :n])

    def _nan_rows(self, quantities: list[metrics.Quantity], prepared: dict[str, Tensor]) -> list[bool]:
        """Per query, whether a metric of its row may be NaN (a quantity on the query axis is NaN there, or a
        head is modified there; every query where a quantity on the key axis has a NaN)."""
        Q = self.pattern.shape[-1]
        # gathered on the layer's device and copied to the host once (one sync per layer, not per quantity)
        rows = torch.zeros(Q, dtype=torch.bool, device=self.pattern.device)
        if self.modified is not None:
            rows |= self.modified.any(0).any(0)
        every = torch.zeros((), dtype=torch.bool, device=rows.device)  # a NaN on the key axis: every row
        for quantity in quantities:
            nan = prepared[quantity.name].isnan()
            if quantity.axis == "query":
                rows |= nan.any(-1).reshape(-1, Q).any(0)
            else:
                every |= nan.any()
        return (rows | every).tolist()


class _Block:
    """One block of queries ``q0:q1`` against keys ``0:k1``, as the formulas see it
    (:class:`mechgeom.analyses.contribution.metrics.Block`); ``done`` holds the block's metrics so far."""

    def __init__(
        self, geo: LayerGeometry, prepared: dict[str, Tensor], keep: Tensor | None, q0: int, q1: int, k1: int
    ) -> None:
        # the one float32 copy of a half-precision pattern: this block's (a view in float32/float64)
        self.alpha = geo.pattern[:, :, q0:q1, :k1].to(geo.dtype)
        self.modified = None if geo.modified is None else geo.modified[:, :, q0:q1, None]
        self.keep = None if keep is None else keep[:, :, q0:q1]
        self.done: dict[str, Tensor] = {}
        self._prepared, self._rows, self._k1 = prepared, slice(q0, q1), k1

    def __getitem__(self, name: str) -> Tensor:
        if name in self.done:
            return self.done[name]
        if name not in self._prepared:
            raise KeyError(
                f"a formula read {name!r}, which is neither a prepared quantity nor an earlier metric of this "
                f"block: list it in its row's needs (metrics.METRICS)"
            )
        t = self._prepared[name]
        return t[..., self._rows, :] if metrics.QUANTITIES[name].axis == "query" else t[..., : self._k1]
