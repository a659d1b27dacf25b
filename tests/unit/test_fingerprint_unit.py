"""The sweep fingerprint (mechgeom.sweep.fingerprint): hooks by the content of their code and data, the same in
another process; weights by their bytes as they are now; values without stable content refused, with the label
that lets them through."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny

from mechgeom.hooks import interventions as iv
from mechgeom.sweep import RowStore, fingerprint as fpm

ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.5


def _scaled(z, hook):
    return z * SCALE


def _make(scale):
    def hook(z, hook):
        return z * scale

    return hook


def _nested(scale):
    def hook(z, hook):
        return (lambda t: t * scale)(z)

    return hook


def _with_default(z, hook, scale=0.5):
    return z * scale


def _with_kwdefault(z, hook, *, scale=0.5):
    return z * scale


def _helper(z):
    return z + 1


def _calls_helper(z, hook):
    return _helper(z)


@dataclass
class _Scaler:
    scale: float

    def apply(self, z, hook):
        return z * self.scale


class _Opaque:
    def apply(self, z, hook):
        return z


def fp(fn):
    return fpm.hook_fingerprint(fn)


def test_lambdas_differ_by_their_constants_and_match_by_their_code():
    assert fp(lambda z, hook: z * 0.5) != fp(lambda z, hook: z * 0.0)
    assert fp(lambda z, hook: z * 0.5) == fp(lambda z, hook: z * 0.5)
    assert fp(lambda z, hook: z * 0.5) != fp(lambda z, hook: z / 0.5)  # the bytecode
    assert "0x" not in fp(lambda z, hook: z) and "<lambda>" in fp(lambda z, hook: z)


def test_closure_cells_defaults_and_nested_code_enter_by_content():
    assert fp(_make(0.5)) == fp(_make(0.5)) != fp(_make(0.0))
    assert fp(_make(torch.ones(3))) == fp(_make(torch.ones(3))) != fp(_make(torch.ones(3) * 2))
    assert fp(_make(torch.ones(3))) != fp(_make(torch.ones(3, dtype=torch.float64)))  # the dtype
    assert fp(_make(torch.ones(3))) != fp(_make(torch.ones(1, 3)))  # the shape
    assert fp(_make(np.arange(3))) != fp(_make(np.arange(3) + 1))
    assert fp(_make({"a": [1, (2, "x")]})) != fp(_make({"a": [1, (2, "y")]}))
    assert fp(_nested(0.5)) != fp(_nested(0.0))  # a closure of a code object nested in the hook
    with_default = functools.partial(_with_default, scale=0.0)
    assert fp(_with_default) != fp(with_default) != fp(functools.partial(_with_default, scale=0.5))
    kw = _with_kwdefault
    other = lambda z, hook, *, scale=0.0: z * scale  # noqa: E731
    assert fp(kw) != fp(other)


def test_globals_are_read_by_content_and_functions_of_the_module_by_their_code(monkeypatch):
    before = fp(_scaled)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 0.0)
    assert fp(_scaled) != before
    helper = fp(_calls_helper)
    monkeypatch.setattr(sys.modules[__name__], "_helper", lambda z: z + 2)
    assert fp(_calls_helper) != helper


def test_bound_methods_and_partials_by_function_and_data():
    assert fp(_Scaler(0.5).apply) == fp(_Scaler(0.5).apply) != fp(_Scaler(0.0).apply)
    part = functools.partial(iv.replace_z_hook, heads=[1], fill=None)
    assert fp(part) != fp(functools.partial(iv.replace_z_hook, heads=[2], fill=None))
    assert fp(part).startswith("partial(mechgeom.hooks.interventions.replace_z_hook) #")


def test_a_hook_over_an_arbitrary_object_is_refused_and_a_label_lets_it_through():
    opaque = _Opaque()
    with pytest.raises(fpm.Unfingerprintable, match=r"holds a .*_Opaque.*labelled_hook\(fn, label="):
        fp(opaque.apply)
    with pytest.raises(
        fpm.Unfingerprintable, match=r"the extra hook on blocks\.0\.attn\.hook_z: .*closure cell 'scale'"
    ):
        fpm.hooks_fingerprint([("blocks.0.attn.hook_z", _make(opaque))])
    a = fpm.labelled_hook(_make(opaque), "identity via _Opaque v1")
    assert fp(a).startswith("'identity via _Opaque v1' (")
    assert fp(a) != fp(fpm.labelled_hook(_make(opaque), "identity via _Opaque v2"))  # the label counts
    assert fp(a) != fp(fpm.labelled_hook(_make(0.5), "identity via _Opaque v1"))  # and so does the rest
    assert torch.equal(fpm.labelled_hook(opaque.apply, "identity")(torch.ones(2), None), torch.ones(2))
    with pytest.raises(ValueError, match="non-empty"):
        fpm.labelled_hook(_scaled, " ")


def test_an_unfingerprintable_hook_is_refused_only_for_checkpointing(tmp_path):
    hooks = [("blocks.0.attn.hook_z", _make(_Opaque()))]
    assert RowStore(None, key=["k"], settings={}, extra_hooks=hooks).fingerprint == {}
    with pytest.raises(fpm.Unfingerprintable, match="labelled_hook"):
        RowStore(tmp_path / "s.csv", key=["k"], settings={}, extra_hooks=hooks)


def test_every_hook_factory_of_mechgeom_is_fingerprintable_and_the_same_in_another_process():
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, "tests")
        from conftest import make_tiny
        from mechgeom.hooks import interventions as iv
        from mechgeom.sweep import hooks_fingerprint
        m = make_tiny(n_kv=2)
        mask = torch.zeros(1, 6, 6, dtype=torch.bool)
        mask[0, 3, 1] = True
        means = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8)
        for hooks in (
            iv.masking_hooks(m, mask=mask),
            iv.sink_mass_hooks(m, 0.3, heads=[1]),
            iv.sink_value_hooks(m, mode="mean_norm", scale=2.0),
            iv.head_ablation_hooks(m, [(0, 1), (1, 3)]),
            iv.head_ablation_hooks(m, [(1, 2)], mode="mean", means=means),
        ):
            print(hooks_fingerprint(hooks))
        """
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0].splitlines()) == 5
    assert "0x" not in runs[0] and "#" in runs[0]
    names = {n for n in iv.__all__ if n.endswith("_hooks")}
    assert names == {"head_ablation_hooks", "masking_hooks", "sink_mass_hooks", "sink_value_hooks"}


def test_the_weights_digest_sees_an_in_place_edit_and_the_dtype():
    model = make_tiny(seed=4)
    digest = fpm.weights_digest(model)
    assert digest == fpm.weights_digest(make_tiny(seed=4)) != fpm.weights_digest(make_tiny(seed=5))
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] += 1e-6
    assert fpm.weights_digest(model) != digest
    assert (
        fpm.model_dtype(make_tiny()) == "float32"
        and fpm.model_dtype(make_tiny().to(torch.bfloat16)) == "bfloat16"
    )
    assert fpm.weights_digest(make_tiny(seed=4).to(torch.float64)) != digest


def test_settings_are_described_by_content():
    assert fpm.describe(torch.zeros(2)) == fpm.describe(torch.zeros(2)) != fpm.describe(torch.zeros(2) + 1e-7)
    assert fpm.describe(None) == "None" and fpm.describe(np.int64(3)) == "3" and fpm.describe(0.1) == "0.1"
    with pytest.raises(fpm.Unfingerprintable, match="the setting 'x' holds a"):
        fpm.describe(_Opaque(), where="the setting 'x'")
