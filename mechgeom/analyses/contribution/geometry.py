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

**Two sweeps, one set of numbers.** On CPU in float32/float64, where a C compiler is present, the blocked
sweep is :mod:`~mechgeom._kernels.fused`: per block one matmul for both raw products and one
pass of a small C kernel (built on first use, see :mod:`mechgeom._kernels.build`) that writes every metric once.
Elsewhere (GPU, other dtypes, no compiler, ``MECHGEOM_NATIVE=0``) the plain-torch sweep below runs. The
tests run both against the brute force.

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
from mechgeom.hooks import LayerActivations, head_outputs
from mechgeom.typing import WO, Bool, Float, HeadScores, LayerScores, Pattern, Tensor, Values, Z

__all__ = [
    "BLOCK_SIZE",
    "FUSED_BLOCK_SIZE",
    "INTER_METRICS",
    "INTRA_METRICS",
    "LayerGeometry",
]

#: Per-head metrics, ``[batch, layer, head_index, query_pos, key_pos]``.
INTRA_METRICS = (
    "attention",
    "value_weighted",
    "value_weighted_normalized",
    "contribution",
    "head_share",
    "factor_norm_ratio",
    "factor_cos",
)
#: Whole-layer metrics, ``[batch, layer, query_pos, key_pos]``.
INTER_METRICS = ("attention", "value_weighted", "value_weighted_normalized", "contribution")

#: Queries per block of the blocked computation (see "Causal layout" in the module docstring): the plain-torch
#: sweep's default (fewer, larger tensor operations pay there, on a GPU above all).
BLOCK_SIZE = 128
#: The fused sweep's default (:data:`mechgeom._kernels.fused.FUSED_BLOCK_SIZE`).
FUSED_BLOCK_SIZE = fused.FUSED_BLOCK_SIZE
#: Tokens per batched matmul of :attr:`LayerGeometry.gram` (its temporary is ``[head, tokens, d_model]``).
GRAM_CHUNK = 256


def _inv_or_nan(den: Tensor) -> Tensor:
    """``1 / den``, NaN where ``den == 0`` (so that a product with it is NaN there, also for a 0 numerator)."""
    return torch.where(den == 0, torch.full_like(den, float("nan")), 1 / torch.where(den == 0, 1, den))


def _inv_or_zero(den: Tensor) -> Tensor:
    """``1 / den``, 0 where ``den == 0``."""
    return torch.where(den == 0, torch.zeros_like(den), 1 / torch.where(den == 0, 1, den))


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
    ) -> None:
        if pattern.shape[-1] != pattern.shape[-2]:
            raise ValueError(
                f"the pattern must be square [.., q, k] (no KV cache); got {tuple(pattern.shape)}"
            )
        self.pattern = pattern
        self.v = v
        self.z = z
        self.W_O = W_O
        #: Queries per block; ``None``: each sweep's own default (:data:`BLOCK_SIZE`, :data:`FUSED_BLOCK_SIZE`).
        self.block_size = None if block_size is None else max(1, int(block_size))
        #: ``[b h q]`` heads whose ``z`` an earlier hook changed (see the module docstring); ``None`` = none.
        self.modified = modified if modified is not None and bool(modified.any()) else None
        self.causal = bool(causal)
        #: ``[b k]`` real (non-padding) tokens of an encoder's batch; ``None`` = all real.
        self.key_mask = key_mask if key_mask is not None and not bool(key_mask.all()) else None
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
            return like.new_empty(shape)
        buf = self.workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.workspace[name] = like.new_empty(numel)
        return buf[:numel].view(shape)

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
        return maths.wo_gram_full(self.W_O)

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
        return dots * (_inv_or_nan(self.layer_out_norm) ** 2)[:, None, :]

    @cached_property
    def modified_share(self) -> Float[Tensor, "batch head_index query_pos"]:
        """The share ``<o[i], o[i,h]> / ‖o[i]‖²`` of each *modified* head (0 for unmodified heads)."""
        if self.modified is None:
            return torch.zeros_like(self.pattern[..., 0])
        return torch.where(self.modified, self.output_share, torch.zeros_like(self.pattern[..., 0]))

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

    # ---- the metrics of docs/definitions.md §2.1, one function each (the formula is in the block kernels below)
    def attention(self) -> HeadScores:
        """Raw attention, intra-head: ``alpha[h,i,j]`` (0 at an encoder's padded queries too, see ``key_mask``)."""
        if self.key_mask is None:
            return self.pattern
        if "attention" not in self._metrics:
            real = self.key_mask[:, None, :, None] & self.key_mask[:, None, None, :]  # [b 1 q k]
            self._metrics["attention"] = self.pattern.masked_fill(~real, 0)
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
        return getattr(self, name)()

    def inter(self, name: str) -> LayerScores:
        return getattr(self, _inter_key(name))()

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
        metrics into, e.g. to reuse memory across layers; the returned tensors are then those.
        ``zeroed=True`` promises that those tensors already hold 0 at every key after its query
        (``key > query``), e.g. because they hold an earlier layer's metrics of a causal model with the same
        shape, untouched since; the fused sweep then does not write those entries again (the plain one
        writes the keys after a query up to the end of its block).
        """
        keys = [m for m in intra if m != "attention"]
        keys += [_inter_key(m) for m in inter]
        buffers = dict(out_intra or {})
        buffers.update({_inter_key(m): t for m, t in (out_inter or {}).items()})
        self._sweep([k for k in keys if k not in self._metrics], buffers, zeroed=zeroed)
        return {m: self.intra(m) for m in intra}, {m: self.inter(m) for m in inter}

    def _sweep(
        self, keys: Sequence[str], buffers: dict[str, Tensor] | None = None, *, zeroed: bool = False
    ) -> None:
        """Compute ``keys`` into ``self._metrics``, one block of queries ``q0:q1`` at a time against keys ``0:q1``
        (every key when not causal).

        Shared products are arranged so that each output is written once per block: with
        ``u[i,h] = o[i,h] @ W_O[h].T`` scaled by ``1/‖o[i,h]‖`` and ``v[j,h]`` by ``1/‖vt[j,h]‖``, one matmul
        gives ``cos``; the ratio ``‖vt‖/‖o‖`` is an outer product, ``alpha * ratio`` the normalised value
        weight and ``(alpha ratio) * cos`` the contribution. With ``o[i] @ W_O[h].T`` scaled by ``1/‖o[i]‖²``,
        one matmul times ``alpha`` gives the head shares, whose sum over heads is ``c[i,j]``.
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
        for k in want:
            shape = (B, Q, Q) if k.endswith("_inter") else (B, H, Q, Q)
            buf = buffers.get(k)
            if buf is not None and (tuple(buf.shape) != shape or buf.dtype != alpha.dtype):
                raise ValueError(
                    f"buffer for {k!r} is {tuple(buf.shape)} {buf.dtype}, need {shape} {alpha.dtype}"
                )
            if buf is None:
                fresh.add(k)
            out[k] = alpha.new_empty(shape) if buf is None else buf
        if fused.available(alpha) and all(t.stride(-1) == 1 for t in out.values()):
            if zeroed:  # the kernel writes the keys after a query only where the buffer is not known to be 0
                for k in fresh:
                    out[k].zero_()
            fused.sweep_blocks(self, want, out, zeroed=zeroed)
        else:
            self._eager_blocks(want, out, [out[k] for k in fresh] if zeroed else list(out.values()))
        if self.key_mask is not None:  # an encoder's padding: neither a source nor a query
            real = self.key_mask[:, :, None] & self.key_mask[:, None, :]  # [b q k]
            for k, t in out.items():
                t.masked_fill_(~(real if k.endswith("_inter") else real[:, None]), 0)
        self._metrics.update(out)

    def _eager_blocks(self, want: set[str], out: dict[str, Tensor], to_zero: list[Tensor]) -> None:
        """The plain-torch sweep (the fused one, :mod:`~mechgeom._kernels.fused`, gives the same
        numbers); ``to_zero``: the outputs whose keys after each block must be written 0."""
        alpha = self.pattern
        Q = alpha.shape[-1]
        need_cos = bool(want & {"factor_cos", "contribution"})
        need_vwn = bool(want & {"value_weighted_normalized", "contribution"})
        need_ratio = need_vwn or "factor_norm_ratio" in want
        need_share = bool(want & {"head_share", "contribution_inter"})
        need_vwi = bool(want & {"value_weighted_inter", "value_weighted_normalized_inter"})
        need_oh = need_cos or need_ratio
        if need_vwi:  # first, so that vt_norm is read off its diagonal
            gram = einops.rearrange(self.gram, "b k h g -> h g b k").contiguous()
        vt_norm = (
            self.vt_norm[:, :, None, :] if (need_ratio or "value_weighted" in want) else None
        )  # [b h 1 k]
        mod = self.modified  # [b h q] or None
        keep = None if mod is None else (~mod).to(alpha.dtype)[..., None]  # [b h q 1]
        inv_oh = _inv_or_nan(self.head_out_norm)[..., None] if need_oh else None  # [b h q 1]
        if inv_oh is not None and mod is not None:  # no per-source terms for a modified head
            inv_oh = inv_oh.masked_fill(mod[..., None], float("nan"))
        inv_ol = _inv_or_nan(self.layer_out_norm) if need_share or need_vwi else None  # [b q]
        v_t = einops.rearrange(self.v, "b k h d -> b h d k").contiguous()  # sliced per block, never copied
        if need_cos:
            assert inv_oh is not None
            u_cos = einops.rearrange(self.head_u, "b q h d -> b h q d") * inv_oh
            v_cos = v_t * _inv_or_zero(self.vt_norm)[:, :, None, :]
        if need_share:
            assert inv_ol is not None
            u_share = einops.rearrange(self.layer_u, "b q h d -> b h q d") * (inv_ol**2)[:, None, :, None]
            if keep is not None:
                u_share = u_share * keep  # a modified head's shares c[h→i,j] are exactly 0
        # alpha-weighted outputs are already 0 above the diagonal, except in NaN rows; factors never are
        factors = [out[k] for k in ("factor_norm_ratio", "factor_cos") if k in out]
        others = [t for k, t in out.items() if k not in ("factor_norm_ratio", "factor_cos")]
        nan_h = inv_oh.isnan()[..., 0].any((0, 1)) if inv_oh is not None else torch.zeros(Q, dtype=torch.bool)
        nan_l = inv_ol.isnan().any(0) if inv_ol is not None else torch.zeros(Q, dtype=torch.bool)
        nan_m = mod.any((0, 1)) if mod is not None else torch.zeros(Q, dtype=torch.bool)
        nan_rows = (nan_h.cpu() | nan_l.cpu() | nan_m.cpu()).tolist()
        step = self.block_size or BLOCK_SIZE
        bs = min(step, Q)
        upper = torch.ones(bs, bs, dtype=torch.bool, device=alpha.device).triu_(1)  # key > query in a block
        lower = (~upper).to(alpha.dtype)  # 1 where key <= query: a product zeroes the rest (faster)

        for q0 in range(0, Q, step):
            q1 = min(q0 + step, Q)
            k1 = q1 if self.causal else Q  # the keys these queries see
            a = alpha[:, :, q0:q1, :k1]

            def dst(key: str, q0: int = q0, q1: int = q1, k1: int = k1) -> Tensor | None:
                return out[key][..., q0:q1, :k1] if key in out else None

            if "value_weighted" in want:
                assert vt_norm is not None
                vw = _value_weighted(a, vt_norm[..., :k1], out=dst("value_weighted"))
                if mod is not None:
                    vw.masked_fill_(mod[:, :, q0:q1, None], float("nan"))
            if need_ratio:
                assert vt_norm is not None and inv_oh is not None
                ratio = _factor_norm_ratio(
                    vt_norm[..., :k1], inv_oh[:, :, q0:q1], out=dst("factor_norm_ratio")
                )
            if need_vwn:
                vwn = _value_weighted_normalized(a, ratio, out=dst("value_weighted_normalized"))
            if need_cos:
                cos = _factor_cos(u_cos[:, :, q0:q1], v_cos[..., :k1], out=dst("factor_cos"))
            if "contribution" in want:
                _contribution(vwn, cos, out=dst("contribution"))
            if need_share:
                share = _head_share(a, u_share[:, :, q0:q1], v_t[..., :k1], out=dst("head_share"))
            if "contribution_inter" in want:
                _contribution_inter(share, out=dst("contribution_inter"))
            if "attention_inter" in want:
                _attention_inter(a, out=dst("attention_inter"))
            if need_vwi:
                a_kept = a if keep is None else a * keep[:, :, q0:q1]  # unmodified heads only
                vwi = _value_weighted_inter(a_kept, gram[..., :k1], out=dst("value_weighted_inter"))
            if "value_weighted_normalized_inter" in want:
                assert inv_ol is not None
                _value_weighted_normalized_inter(
                    vwi, inv_ol[:, q0:q1, None], out=dst("value_weighted_normalized_inter")
                )

            if not self.causal:
                continue
            # not sources: keys after the block, and the block's own upper triangle (key > query)
            if q1 < Q:
                for t in to_zero:
                    t[..., q0:q1, q1:].zero_()
            n = q1 - q0
            if any(nan_rows[q0:q1]):  # NaN * 0 is NaN: fill instead
                for t in factors + others:
                    t[..., q0:q1, q0:q1].masked_fill_(upper[:n, :n], 0)
            else:
                for t in factors:
                    t[..., q0:q1, q0:q1].mul_(lower[:n, :n])


def _inter_key(name: str) -> str:
    return "contribution_inter" if name == "contribution" else f"{name}_inter"


# ---- the formulas of docs/definitions.md §2.1 on one block of queries (views, ``out=`` a view of the result)


def _value_weighted(alpha: Tensor, vt_norm: Tensor, out: Tensor | None) -> Tensor:
    """``alpha[h,i,j] * ‖vt[j,h]‖``."""
    return torch.mul(alpha, vt_norm, out=out)


def _value_weighted_normalized(alpha: Tensor, ratio: Tensor, out: Tensor | None) -> Tensor:
    """``alpha[h,i,j] * ‖vt[j,h]‖ / ‖o[i,h]‖ = alpha * ratio`` (``ratio = ‖vt[j,h]‖ / ‖o[i,h]‖``, NaN where
    ``‖o[i,h]‖ = 0``)."""
    return torch.mul(alpha, ratio, out=out)


def _factor_norm_ratio(vt_norm: Tensor, inv_o: Tensor, out: Tensor | None) -> Tensor:
    """``‖vt[j,h]‖ / ‖o[i,h]‖``."""
    return torch.mul(vt_norm, inv_o, out=out)


def _factor_cos(u_unit: Tensor, v_unit: Tensor, out: Tensor | None) -> Tensor:
    """``cos(o[i,h], vt[j,h]) = (o[i,h] @ W_O[h].T / ‖o[i,h]‖) . (v[j,h] / ‖vt[j,h]‖)``, one matmul in ``d_head``.

    ``u_unit [b h q d]`` is ``o @ W_O[h].T / ‖o‖`` (NaN rows where ``‖o‖ = 0``); ``v_unit [b h d k]`` is
    ``v / ‖vt‖`` (0 where ``‖vt‖ = 0``, giving a cosine of 0).
    """
    return torch.matmul(u_unit, v_unit, out=out)


def _contribution(vwn: Tensor, cos: Tensor, out: Tensor | None) -> Tensor:
    """``c[h,i,j] = <o[i,h], alpha[h,i,j] vt[j,h]> / ‖o[i,h]‖² = (alpha ‖vt[j,h]‖ / ‖o[i,h]‖) * cos(o[i,h], vt[j,h])``."""
    return torch.mul(vwn, cos, out=out)


def _head_share(alpha: Tensor, u_share: Tensor, v_t: Tensor, out: Tensor | None) -> Tensor:
    """``c[h→i,j] = <o[i], alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = alpha * v[j,h] . (o[i] @ W_O[h].T / ‖o[i]‖²)``.

    ``u_share [b h q d]`` is ``o[i] @ W_O[h].T / ‖o[i]‖²``; ``v_t [b h d k]``.
    """
    share = torch.matmul(u_share, v_t, out=out)
    return share.mul_(alpha)


def _contribution_inter(share: Tensor, out: Tensor | None) -> Tensor:
    """``c[i,j] = <o[i], sum_h alpha[h,i,j] vt[j,h]> / ‖o[i]‖² = sum_h c[h→i,j]``."""
    return torch.sum(share, dim=1, out=out)


def _attention_inter(alpha: Tensor, out: Tensor | None) -> Tensor:
    """``mean_h alpha[h,i,j]``."""
    return torch.mean(alpha, dim=1, out=out)


def _value_weighted_inter(
    alpha: Float[Tensor, "batch head_index q k"],
    gram: Float[Tensor, "head_index head_index2 batch k"],
    out: Tensor | None = None,
) -> Float[Tensor, "batch q k"]:
    """``‖sum_h alpha[h,i,j] vt[j,h]‖ = sqrt(sum_{h,g} alpha[h,i,j] alpha[g,i,j] G_j[h,g])`` (``G`` symmetric)."""
    n_heads = alpha.shape[1]
    twice = gram * 2.0  # [h g b k]: pre-scaled, since addcmul_(value=2) with broadcasting is a slow path
    sq = torch.zeros_like(alpha[:, 0]) if out is None else out.zero_()
    acc = torch.empty_like(alpha[:, 0])  # [b q k]
    for h in range(n_heads):
        torch.mul(alpha[:, h], gram[h, h][:, None, :], out=acc)
        for g in range(h + 1, n_heads):
            acc.addcmul_(alpha[:, g], twice[h, g][:, None, :])
        sq.addcmul_(acc, alpha[:, h])
    return sq.clamp_min_(0).sqrt_()


def _value_weighted_normalized_inter(vwi: Tensor, inv_o: Tensor, out: Tensor | None) -> Tensor:
    """``‖sum_h alpha[h,i,j] vt[j,h]‖ / ‖o[i]‖``."""
    return torch.mul(vwi, inv_o, out=out)
