"""Brute-force reference for contribution weights (``docs/definitions.md`` §2), shared by the unit and integration tests.

It materialises ``T[h] = alpha[h,i,j] * vt[j,h]`` as an explicit ``[q, k, d_model]`` tensor per head
(float64, plain loops, GQA by indexing ``h // group`` rather than ``expand_kv``) and reads every metric off
it with plain torch ops: norms of ``T``, inner products of ``T`` with the head/layer outputs, and so on.
"""

from __future__ import annotations

import torch

from mechgeom.analyses.contribution.weights import INTER_METRICS, INTRA_METRICS

NAN = float("nan")


def brute_force(
    alpha: torch.Tensor,
    v_kv: torch.Tensor,
    W_O: torch.Tensor,
    *,
    causal: bool = True,
    real: torch.Tensor | None = None,
    window: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every §A metric of one layer from the materialised ``[q, k, d_model]`` tensors, in float64.

    ``alpha [b h q k]``, ``v_kv [b k n_kv d_head]`` (not expanded), ``W_O [h d_head d_model]``.
    Returns ``intra_<name>`` ``[b h q k]``, ``inter_<name>`` ``[b q k]`` and ``o_head`` ``[b q h m]``.
    The inputs may live on any device; the reference is computed on the CPU. ``causal=False`` (an encoder)
    keeps every key as a source; ``real [b pos]`` (an encoder's non-padding
    tokens) sets every entry of a padded query or key to 0. ``window`` (a sliding-window layer's width) sets
    every entry of a key ``j <= i - window`` to 0: not a source of query ``i``.
    """
    # on the CPU whatever the model's device (MECHGEOM_TEST_DEVICE): the reference is computed in one place
    alpha, v_kv, W_O = (x.detach().cpu().double() for x in (alpha, v_kv, W_O))
    B, H, Q, K = alpha.shape
    group = H // v_kv.shape[2]
    out: dict[str, torch.Tensor] = {
        f"intra_{n}": torch.zeros(B, H, Q, K, dtype=torch.float64) for n in INTRA_METRICS
    }
    out.update({f"inter_{n}": torch.zeros(B, Q, K, dtype=torch.float64) for n in INTER_METRICS})
    out["o_head"] = torch.zeros(B, Q, H, W_O.shape[-1], dtype=torch.float64)

    def ratio_or_nan(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        # docs/definitions.md §2.4: a zero output norm gives NaN (never inf, never 0)
        return torch.where(den == 0, torch.full_like(num, NAN), num / den)

    for b in range(B):
        T_heads, vts = [], []
        for h in range(H):
            vt = v_kv[b, :, h // group] @ W_O[h]  # [k, m]
            T_heads.append(alpha[b, h][:, :, None] * vt[None, :, :])  # [q, k, m], materialised
            vts.append(vt)
        T_layer = torch.stack(T_heads).sum(0)  # [q, k, m]
        o = T_layer.sum(1)  # [q, m]
        o_norm = o.norm(dim=-1)[:, None].expand(Q, K)
        for h in range(H):
            T, vt = T_heads[h], vts[h]
            o_h = T.sum(1)  # [q, m]
            out["o_head"][b, :, h] = o_h
            oh_norm = o_h.norm(dim=-1)[:, None].expand(Q, K)
            vt_norm = vt.norm(dim=-1)[None, :].expand(Q, K)
            out["intra_attention"][b, h] = alpha[b, h]
            out["intra_value_weighted"][b, h] = T.norm(dim=-1)
            out["intra_value_weighted_normalized"][b, h] = ratio_or_nan(T.norm(dim=-1), oh_norm)
            out["intra_contribution"][b, h] = ratio_or_nan((T * o_h[:, None, :]).sum(-1), oh_norm**2)
            out["intra_head_share"][b, h] = ratio_or_nan((T * o[:, None, :]).sum(-1), o_norm**2)
            out["intra_factor_norm_ratio"][b, h] = ratio_or_nan(vt_norm, oh_norm)
            for i in range(Q):
                for j in range(K):
                    if oh_norm[i, j] == 0:
                        cos = NAN
                    elif vt_norm[i, j] == 0:
                        cos = 0.0
                    else:
                        cos = float(o_h[i] @ vt[j]) / float(oh_norm[i, j] * vt_norm[i, j])
                    out["intra_factor_cos"][b, h, i, j] = cos
        out["inter_attention"][b] = alpha[b].mean(0)
        out["inter_value_weighted"][b] = T_layer.norm(dim=-1)
        out["inter_value_weighted_normalized"][b] = ratio_or_nan(T_layer.norm(dim=-1), o_norm)
        out["inter_contribution"][b] = ratio_or_nan((T_layer * o[:, None, :]).sum(-1), o_norm**2)
    # convention: only sources j <= i are entries; everything above the diagonal is 0 (NaN rows included)
    for i in range(Q if causal else 0):
        for name, t in out.items():
            if name != "o_head":
                t[..., i, i + 1 :] = 0.0
                if window is not None:
                    t[..., i, : max(0, i - window + 1)] = 0.0
    # an encoder's padding is neither a query nor a source
    for b in range(B if real is not None else 0):
        for i in range(Q):
            for j in range(K):
                if not (real[b, i] and real[b, j]):
                    for name, t in out.items():
                        if name != "o_head":
                            t[b, ..., i, j] = 0.0
    return out


def assert_all_metrics_match(intra: dict, inter: dict, ref: dict, atol: float = 1e-5) -> None:
    for name in INTRA_METRICS:
        torch.testing.assert_close(
            intra[name].double(),
            ref[f"intra_{name}"],
            atol=atol,
            rtol=atol,
            equal_nan=True,
            msg=f"intra {name}",
        )
    for name in INTER_METRICS:
        torch.testing.assert_close(
            inter[name].double(),
            ref[f"inter_{name}"],
            atol=atol,
            rtol=atol,
            equal_nan=True,
            msg=f"inter {name}",
        )


def acts_of(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = f"blocks.{layer}.attn."
    return cache[p + "hook_pattern"], cache[p + "hook_v"], cache[p + "hook_z"]
