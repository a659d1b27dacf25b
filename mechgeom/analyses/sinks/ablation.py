"""Sink-value ablation with a random-position control (``docs/definitions.md`` §4.6; paper A).

``docs/definitions.md`` §4.6: set the sink's value to zero (or rescale it to the mean non-sink norm) via ``hook_v`` in chosen
heads/layers. Report the change in head-output norm, in ``cos(o[i,h], mu_h)`` with ``mu_h`` the mean
direction of the non-sink projected values (the "semantic cone"), and ΔPPL; control: the same ablation at a
random non-sink position.

The ablation is the hook factory :func:`mechgeom.hooks.sink_value_hooks`; :func:`sink_ablation` runs it
(clean, sink and control passes) and measures next-token NLL, head-output norms and cone cosines
(:func:`cone_cos`) over the queries ``Q = {i : i > max(S)}`` of the sink set ``S``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import einops
import pandas as pd
import torch

from mechgeom.analyses.base import Result
from mechgeom.analyses.contribution import LayerGeometry
from mechgeom.analyses.scoring import bootstrap_ci, right_align, text_nll
from mechgeom.hooks import (
    FwdHook,
    LayerActivations,
    LayerCollector,
    TokensOrText,
    ValueAblationMode,
    affected_heads,
    masked_mean,
    query_mask,
    resolve_heads,
    resolve_layers,
    resolve_sinks,
    sink_mask,
    sink_value_hooks,
    to_batch,
)
from mechgeom.typing import Bool, Float, Tensor, Tokens

__all__ = [
    "AblationMode",
    "SinkAblationResult",
    "cone_cos",
    "random_control_positions",
    "sink_ablation",
]

#: The sink-value ablation modes (defined with the intervention in :mod:`mechgeom.hooks.interventions`).
AblationMode = ValueAblationMode


def random_control_positions(
    n_texts: int,
    pos: int,
    sink_positions: int | Sequence[int] | None = None,
    *,
    seed: int = 0,
    lengths: Sequence[int] | None = None,
) -> Tensor:
    """One random non-sink position per text, ``[n_texts, 1]``, uniform over ``{j < pos : j ∉ S}``
    (``torch.Generator`` seeded with ``seed``).

    ``lengths`` (texts of a right-aligned padded batch, :func:`~mechgeom.analyses.scoring.right_align`):
    text ``t``'s position is uniform over its own ``{j < lengths[t] : j ∉ S}``, never a pad.
    """
    if lengths is not None:
        sinks = resolve_sinks(sink_positions, min(int(n) for n in lengths))
        u = torch.rand(n_texts, generator=torch.Generator().manual_seed(seed))
        out = []
        for t, n in enumerate(lengths):
            own = [j for j in range(int(n)) if j not in sinks]
            if not own:
                raise ValueError(f"text {t} has no non-sink position ({n} tokens, sinks {sinks})")
            out.append(own[min(int(u[t] * len(own)), len(own) - 1)])
        return torch.tensor(out, dtype=torch.long)[:, None]
    sinks = resolve_sinks(sink_positions, pos)
    nonsink = torch.tensor([j for j in range(pos) if j not in sinks], dtype=torch.long)
    if not len(nonsink):
        raise ValueError(f"no non-sink position in a sequence of length {pos} with sinks {sinks}")
    g = torch.Generator().manual_seed(seed)
    return nonsink[torch.randint(len(nonsink), (n_texts, 1), generator=g)]


def cone_cos(
    geo: LayerGeometry, sinks: Sequence[int], key_mask: Bool[Tensor, "batch pos"] | None = None
) -> Float[Tensor, "batch head q"]:
    """``cos(o[i,h], mu_h)`` with ``mu_h`` the mean direction of the non-sink projected values (the
    "semantic cone"): ``mu_h = mean_{j ∉ S} vt[j,h]`` of the same text and pass. NaN where a norm is 0.
    ``key_mask`` (True at real tokens) keeps a padded batch's pads out of ``mu_h``."""
    pos = geo.pattern.shape[-1]
    nonsink = ~sink_mask(sinks, pos, geo.pattern.device)
    if key_mask is None:
        mu = geo.projected_values[:, nonsink].mean(dim=1)  # [b h m]
    else:
        w = (nonsink[None, :] & key_mask.to(nonsink.device)).to(geo.projected_values.dtype)  # [b k]
        total = einops.einsum(geo.projected_values, w, "b k h m, b k -> b h m")
        mu = total / w.sum(1)[:, None, None]
    dots = einops.einsum(geo.head_out, mu, "b q h m, b h m -> b h q")
    den = geo.head_out_norm * mu.norm(dim=-1)[..., None]  # [b h q]
    return torch.where(den > 0, dots / den.clamp_min(1e-30), torch.nan)


class _OutputMeter:
    """Reads every layer's head outputs; per text and head: ``mean_{i in Q} ‖o[i,h]‖`` and
    ``mean_{i in Q} cos(o[i,h], mu_h)`` with ``mu_h = mean_{j ∉ S} vt[j,h]`` of the same pass."""

    def __init__(self, model: Any, sinks: list[int], n_texts: int, mask: Tensor | None = None) -> None:
        self.model, self.sinks, self.mask = model, sinks, mask
        shape = (n_texts, int(model.cfg.n_layers), int(model.cfg.n_heads))
        self.norm = torch.full(shape, torch.nan)
        self.cone = torch.full(shape, torch.nan)

    def hooks(self, sl: slice) -> list[FwdHook]:
        return LayerCollector(self.model, None, partial(self._on_layer, sl=sl)).fwd_hooks

    def _on_layer(self, acts: LayerActivations, *, sl: slice) -> None:
        geo = LayerGeometry.from_activations(acts)
        qmask = query_mask(self.sinks, geo.pattern.shape[-1], geo.pattern.device)  # [q]
        real = None if self.mask is None else self.mask[sl].to(qmask.device)  # [b q]
        cos = cone_cos(geo, self.sinks, real)  # [b h q]
        keep = qmask.expand_as(cos) if real is None else (qmask[None, :] & real)[:, None].expand_as(cos)
        self.norm[sl, acts.layer] = masked_mean(geo.head_out_norm, keep, -1).cpu()
        self.cone[sl, acts.layer] = masked_mean(cos, keep, -1).cpu()


_CONDITIONS = ("clean", "sink", "control")


@dataclass
class SinkAblationResult(Result):
    """Sink-value ablation vs clean vs a random-position control, on ``n`` texts.

    ``nll[cond]`` is the per-text mean next-token NLL ``[n]``; ``out_norm[cond]`` and ``cone_cos[cond]``
    are ``[n, n_layers, head]`` (every layer of the model, so downstream effects show too): the mean
    over ``i in Q`` of ``‖o[i,h]‖`` and of ``cos(o[i,h], mu_h)``. ``cond`` is ``"clean"``, ``"sink"``
    or ``"control"``. ``affected_heads`` are the query heads of the ablated KV groups. In layers after the
    first ablated one, the changes include the effect of the upstream ablation.
    """

    layers: list[int]
    heads: list[int]
    affected_heads: list[int]
    mode: str
    scale: float
    sink_positions: list[int]
    control_positions: Tensor
    tokens: Tokens
    nll: dict[str, Tensor]
    out_norm: dict[str, Tensor]
    cone_cos: dict[str, Tensor]
    model_name: str = ""
    #: the real tokens of ``tokens`` (right-aligned), None where nothing is padding
    attention_mask: Tensor | None = None

    def ppl(self, cond: str = "clean") -> float:
        """``exp(mean NLL)`` over every predicted token of every text."""
        return float(torch.exp(self.nll[cond].mean()))

    def delta_ppl(self, cond: str = "sink") -> float:
        """``PPL(cond) − PPL(clean)``."""
        return self.ppl(cond) - self.ppl("clean")

    def summary(self, *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
        """PPL of each condition, ``ΔPPL`` and ``ΔNLL`` (with a per-text bootstrap 95% interval) of the sink
        ablation and of its control, and the mean ``Δ‖o‖`` / ``Δcos(o, mu)`` over the ablated heads."""
        out: dict[str, Any] = {
            "layers": " ".join(map(str, self.layers)),
            "n_layers_ablated": len(self.layers),
            "heads": " ".join(map(str, self.affected_heads)),
            "mode": self.mode,
            "scale": self.scale,
            "n_texts": int(self.nll["clean"].shape[0]),
            "ppl_clean": self.ppl("clean"),
        }
        frame = self.to_frame()
        abl = frame[frame["ablated"]]
        for cond in ("sink", "control"):
            d = (self.nll[cond] - self.nll["clean"]).numpy()
            lo, hi = bootstrap_ci(d, n_boot=n_boot, seed=seed)
            out |= {
                f"ppl_{cond}": self.ppl(cond),
                f"dppl_{cond}": self.delta_ppl(cond),
                f"dnll_{cond}": float(d.mean()),
                f"dnll_{cond}_lo": lo,
                f"dnll_{cond}_hi": hi,
                f"d_out_norm_rel_{cond}": float(abl[f"d_out_norm_rel_{cond}"].mean()),
                f"d_cone_cos_{cond}": float(abl[f"d_cone_cos_{cond}"].mean()),
            }
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head) of the model (means over texts): ``ablated`` (the layer was ablated
        and the head is in an ablated KV group), ``out_norm_{cond}``, ``cone_cos_{cond}``, and for
        ``sink``/``control`` the changes ``d_out_norm_*`` (absolute), ``d_out_norm_rel_*``
        (``‖o'‖/‖o‖ − 1`` of the text means) and ``d_cone_cos_*``."""
        n_layers, n_heads = self.out_norm["clean"].shape[1:]
        norm = {c: torch.nanmean(self.out_norm[c], dim=0) for c in _CONDITIONS}
        cone = {c: torch.nanmean(self.cone_cos[c], dim=0) for c in _CONDITIONS}
        rel = {
            c: torch.nanmean(self.out_norm[c] / self.out_norm["clean"] - 1, dim=0)
            for c in ("sink", "control")
        }
        rows = []
        for layer in range(n_layers):
            for h in range(n_heads):
                row: dict[str, Any] = {
                    "layer": layer,
                    "head": h,
                    "ablated": layer in self.layers and h in self.affected_heads,
                }
                for c in _CONDITIONS:
                    row[f"out_norm_{c}"] = float(norm[c][layer, h])
                    row[f"cone_cos_{c}"] = float(cone[c][layer, h])
                for c in ("sink", "control"):
                    row[f"d_out_norm_{c}"] = row[f"out_norm_{c}"] - row["out_norm_clean"]
                    row[f"d_out_norm_rel_{c}"] = float(rel[c][layer, h])
                    row[f"d_cone_cos_{c}"] = row[f"cone_cos_{c}"] - row["cone_cos_clean"]
                rows.append(row)
        df = pd.DataFrame(rows)
        df.attrs.update(model=self.model_name, mode=self.mode, scale=self.scale, layers=list(self.layers))
        return df


def sink_ablation(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    mode: AblationMode = "zero",
    scale: float = 1.0,
    sink_positions: int | Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 8,
    clean: SinkAblationResult | None = None,
    attention_mask: Tensor | None = None,
    verbose: bool = False,
) -> SinkAblationResult:
    """Ablate the sink value (:func:`sink_value_hooks`) in ``layers`` × ``heads`` (default: all of them,
    at once) on ``tokens_or_text`` (text or token ids, validated by :func:`mechgeom.hooks.to_batch`)
    and, as a control, the value of one random non-sink position per text
    (:func:`random_control_positions` with ``seed``) in the same layers and heads with the same mode.

    Three passes (clean, sink, control; each one NLL pass with readers attached) measure the NLL
    (``mechgeom.analyses.scoring.text_nll``), the head-output norms and the cone cosines. ``clean`` reuses
    the clean pass of an earlier result on the same tokens and sink set (for per-layer sweeps).

    **Padding.** ``attention_mask`` (``[n_texts, pos]``, 1 at real tokens; for a list of texts the default
    pads them on the tokenizer's side, :func:`~mechgeom.hooks.to_batch`): the batch is right-aligned
    (:func:`~mechgeom.analyses.scoring.right_align`), so position 0 of the sink set is the first real token
    of each text; pads are never targets of the NLL, never ablated, never in the ``"mean_norm"`` reference,
    never queries of the means over ``Q`` nor keys of ``mu_h``; the control position is drawn among each
    text's own non-sinks. Every text must be longer than ``max(S)``. The clean and sink conditions of a
    text then equal the text run alone (the control draws its position per batch).
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 60 lines.
    tokens, mask = to_batch(model, tokens_or_text, attention_mask=attention_mask, what="sink ablation")
    if mask is not None:
        tokens, mask = right_align(tokens, mask)
    n, pos = tokens.shape
    lengths = None if mask is None else [int(x) for x in mask.sum(-1).tolist()]
    sinks = resolve_sinks(sink_positions, pos if lengths is None else min(lengths))
    layer_list = resolve_layers(model, layers)
    head_list = resolve_heads(model, heads)
    control = random_control_positions(n, pos, sinks, seed=seed, lengths=lengths)
    common = {"layers": layer_list, "heads": head_list, "mode": mode, "scale": scale, "sink_positions": sinks}

    def real(sl: slice) -> Tensor | None:
        return None if mask is None else mask[sl]

    def measure(cond: str, make_hooks: Callable[[slice], list[FwdHook]]) -> tuple[Tensor, Tensor, Tensor]:
        meter = _OutputMeter(model, sinks, n, mask)
        nll = text_nll(
            model,
            tokens,
            lambda sl: [*make_hooks(sl), *meter.hooks(sl)],
            attention_mask=mask,
            batch_size=batch_size,
            verbose=verbose,
            desc=f"sink ablation: {cond}",
        )
        return nll, meter.norm, meter.cone

    results: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    if clean is not None:
        same_mask = (clean.attention_mask is None) == (mask is None) and (
            mask is None or torch.equal(clean.attention_mask, mask.cpu())  # type: ignore[arg-type]
        )
        if clean.sink_positions != sinks or not torch.equal(clean.tokens, tokens.cpu()) or not same_mask:
            raise ValueError("`clean` comes from other tokens, another attention_mask or another sink set")
        results["clean"] = (clean.nll["clean"], clean.out_norm["clean"], clean.cone_cos["clean"])
    else:
        results["clean"] = measure("clean", lambda sl: [])
    results["sink"] = measure(
        "sink",
        lambda sl: sink_value_hooks(model, key_mask=real(sl), **common),  # type: ignore[arg-type]
    )
    results["control"] = measure(
        "control",
        lambda sl: sink_value_hooks(model, positions=control[sl], key_mask=real(sl), **common),  # type: ignore[arg-type]
    )
    return SinkAblationResult(
        layers=layer_list,
        heads=head_list,
        affected_heads=affected_heads(model, head_list),
        mode=mode,
        scale=float(scale),
        sink_positions=sinks,
        control_positions=control[:, 0],
        tokens=tokens.cpu(),
        nll={c: r[0] for c, r in results.items()},
        out_norm={c: r[1] for c, r in results.items()},
        cone_cos={c: r[2] for c, r in results.items()},
        model_name=str(getattr(model.cfg, "model_name", "")),
        attention_mask=None if mask is None else mask.cpu(),
    )
