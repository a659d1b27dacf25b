"""What a sweep's numbers depend on, as stable text: the model's weights and dtype, the settings, and the code
and data of every extra hook. A store resumes only when all of it is the same (:mod:`mechgeom.sweep.store`);
``docs/sweeps.md`` says what this covers and what it cannot see.

Values are fingerprinted by **content**, never by ``repr`` or memory address, so the text is the same in
another process:

- numbers, strings, bytes, ``None``, and tuples, lists, dicts and sets of them; enums by class and name;
- tensors and arrays by dtype, shape and a SHA-256 of their bytes (on any device);
- functions by their code object (bytecode, constants with nested code, names, argument counts, flags), their
  defaults and keyword defaults, the contents of their closure cells, and the globals their code reads
  (data by content, functions of the same module by their own code, modules, classes and functions of other
  modules by name);
- ``functools.partial`` by function, arguments and keywords; a bound method by its function and the object
  it is bound to; a dataclass instance by its class and fields (and its class's ``__call__`` if it has one).

Anything else (a model, a file, an arbitrary object in a closure) has no stable content:
:class:`Unfingerprintable` is raised, naming where it sits. :func:`labelled_hook` wraps such a hook with a
``label`` naming the intervention; the label then stands for that state.

>>> hook_fingerprint(lambda z, hook: z * 0.5) == hook_fingerprint(lambda z, hook: z * 0.0)
False
>>> def make(scale):
...     return lambda z, hook: z * scale
>>> hook_fingerprint(make(0.5)) == hook_fingerprint(make(0.5)), hook_fingerprint(make(0.5)) == hook_fingerprint(make(0.0))
(True, False)
>>> describe(3), describe("intra"), describe(0.1)
('3', 'intra', '0.1')
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import enum
import functools
import hashlib
import inspect
import sys
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = [
    "LabelledHook",
    "Unfingerprintable",
    "content_digest",
    "describe",
    "hook_fingerprint",
    "hooks_fingerprint",
    "labelled_hook",
    "model_dtype",
    "model_label",
    "tokens_hash",
    "weights_digest",
]

#: Hex digits of a content digest shown in fingerprints (64 bits: an accidental match is not a concern).
DIGEST_CHARS = 16


class Unfingerprintable(TypeError):
    """A value whose content has no stable fingerprint (an arbitrary object), named by where it sits."""


@dataclasses.dataclass(frozen=True)
class LabelledHook:
    """A hook function with a ``label`` naming its intervention (:func:`labelled_hook`); calls ``fn``."""

    fn: Callable[..., Any]
    label: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def labelled_hook(fn: Callable[..., Any], label: str) -> LabelledHook:
    """Give a hook whose state cannot be fingerprinted a label that names its intervention.

    The fingerprint of the result is the label plus everything of ``fn`` that can be fingerprinted (its code,
    constants, and the closure cells and globals that hold data); objects without stable content enter by
    their type only, so the label must name what they do. Change the label whenever that state changes.

    Args:
        fn: the hook, ``fn(tensor, hook)``, as TransformerLens calls it.
        label: a non-empty text that names the intervention and its parameters, e.g.
            ``"steer layer 3 by vector v7 x 2.0"``.

    Returns:
        A callable that runs ``fn`` and is fingerprinted by ``label`` (picklable if ``fn`` is).

    >>> class Steer:
    ...     pass
    >>> hook = labelled_hook(lambda z, hook, s=Steer(): z, "steer by v7")
    >>> hook_fingerprint(hook).startswith("'steer by v7' (")
    True
    """
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"label must be a non-empty text naming the intervention, got {label!r}")
    return LabelledHook(fn, label.strip())


def _name_of(fn: Any) -> str:
    """A function's ``module.qualname`` (a partial as ``partial(...)``, a labelled hook by its function)."""
    if isinstance(fn, LabelledHook):
        return _name_of(fn.fn)
    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    if isinstance(fn, types.MethodType):
        return _name_of(fn.__func__)
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{qual}"


def _global_names(code: types.CodeType) -> set[str]:
    """The global names that ``code`` (and the code nested in it) loads."""
    names = {
        str(ins.argval)
        for ins in dis.get_instructions(code)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _tensor_bytes(t: Any) -> memoryview:
    """The bytes of a tensor (any dtype, any device) as a flat contiguous uint8 buffer."""
    torch = sys.modules["torch"]  # a tensor exists, so torch is imported
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class _Encoder:
    """Feeds a canonical encoding of values into one SHA-256; ``strict`` refuses values without stable
    content, otherwise they enter by type (for :class:`LabelledHook`)."""

    def __init__(self, strict: bool = True) -> None:
        self.h = hashlib.sha256()
        self.strict = strict
        self.active: set[int] = set()  # functions being encoded (a recursive function refers back)

    def put(self, *parts: str | bytes | memoryview) -> None:
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            self.h.update(len(data).to_bytes(8, "little"))
            self.h.update(data)

    def digest(self) -> str:
        return self.h.hexdigest()

    def child_digest(self, x: Any, where: str) -> str:
        sub = _Encoder(self.strict)
        sub.active = self.active
        sub.value(x, where)
        return sub.digest()

    def value(self, x: Any, where: str) -> None:
        """Encode ``x``; ``where`` names it in the error of a value without stable content."""
        torch = sys.modules.get("torch")
        if x is None or x is Ellipsis or x is NotImplemented or isinstance(x, (bool, int, str, bytes, range)):
            self.put(type(x).__name__, x if isinstance(x, bytes) else str(x))
        elif isinstance(x, float):
            self.put("float", float.hex(x))
        elif isinstance(x, complex):
            self.put("complex", float.hex(x.real), float.hex(x.imag))
        elif isinstance(x, enum.Enum):
            self.put("enum", _name_of(type(x)), x.name)
        elif isinstance(x, slice):
            self.put("slice")
            self.value((x.start, x.stop, x.step), where)
        elif isinstance(x, (tuple, list)):
            self.put(type(x).__name__, str(len(x)))
            for i, item in enumerate(x):
                self.value(item, f"{where}[{i}]")
        elif isinstance(x, dict):
            keyed = sorted(
                ((self.child_digest(k, f"a key of {where}"), k, v) for k, v in x.items()), key=lambda t: t[0]
            )
            self.put("dict", str(len(keyed)))
            for kd, k, v in keyed:
                self.put(kd)
                self.value(v, f"{where}[{k!r}]")
        elif isinstance(x, (set, frozenset)):
            self.put("set", *sorted(self.child_digest(v, f"an item of {where}") for v in x))
        elif torch is not None and isinstance(x, torch.Tensor):
            self.put("tensor", str(x.dtype), str(tuple(x.shape)), hashlib.sha256(_tensor_bytes(x)).digest())
        elif torch is not None and isinstance(x, (torch.dtype, torch.device, torch.Size)):
            self.put(type(x).__name__, str(x))
        elif isinstance(x, np.ndarray) and x.dtype != object:
            data = np.ascontiguousarray(x).reshape(-1).view(np.uint8).tobytes()
            self.put("ndarray", x.dtype.str, str(x.shape), hashlib.sha256(data).digest())
        elif isinstance(x, np.ndarray):
            self.put("ndarray-object", str(x.shape))
            self.value(x.tolist(), where)
        elif isinstance(x, (np.generic, np.dtype)):
            self.put("numpy", str(getattr(x, "dtype", x)))
            self.value(x.item() if isinstance(x, np.generic) else None, where)
        else:
            self.callable_or_object(x, where)

    def callable_or_object(self, x: Any, where: str) -> None:
        if isinstance(x, LabelledHook):
            self.put("labelled", x.label)
            lenient = _Encoder(strict=False)
            lenient.value(x.fn, where)
            self.put(lenient.digest())
        elif isinstance(x, functools.partial):
            self.put("partial")
            self.value(x.func, f"the function of {where}")
            self.value(x.args, f"the arguments of {where}")
            self.value(x.keywords, f"the keywords of {where}")
        elif isinstance(x, types.FunctionType):
            self.function(x)
        elif isinstance(x, types.MethodType):
            self.put("method")
            self.value(x.__func__, where)
            self.value(x.__self__, f"the object {_name_of(x)} is bound to")
        elif isinstance(x, types.CodeType):
            self.code(x)
        elif isinstance(x, types.ModuleType):
            self.put("module", x.__name__)
        elif isinstance(x, type):
            self.put("class", _name_of(x))
        elif isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(x, "__self__", None)
            self.put("builtin", _name_of(x))
            if owner is not None and not isinstance(owner, (types.ModuleType, type)):
                self.value(owner, f"the object {_name_of(x)} is bound to")
        elif dataclasses.is_dataclass(x):
            self.put("dataclass", _name_of(type(x)))
            for f in dataclasses.fields(x):
                self.put(f.name)
                self.value(getattr(x, f.name), f"the field {f.name!r} of {where}")
            call = next((vars(c)["__call__"] for c in inspect.getmro(type(x)) if "__call__" in vars(c)), None)
            if isinstance(call, types.FunctionType):
                self.function(call)
        elif self.strict:
            raise Unfingerprintable(
                f"{where} holds a {_name_of(type(x))}, which has no stable content to fingerprint"
            )
        else:
            self.put("opaque", _name_of(type(x)))

    def code(self, co: types.CodeType) -> None:
        self.put("code", co.co_code, str(co.co_argcount), str(co.co_posonlyargcount))
        self.put(str(co.co_kwonlyargcount), str(co.co_flags), getattr(co, "co_exceptiontable", b""))
        for names in (co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars):
            self.put(str(len(names)), *names)
        self.put(str(len(co.co_consts)))
        for const in co.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const)
            else:
                self.value(const, f"a constant of {co.co_name}")

    def function(self, fn: types.FunctionType) -> None:
        """A function by its code, defaults, closure cells and the globals its code reads."""
        name = _name_of(fn)
        if id(fn) in self.active:
            self.put("recursion", name)
            return
        self.active.add(id(fn))
        self.put("function", name)
        self.code(fn.__code__)
        self.value(fn.__defaults__, f"the defaults of {name}")
        self.value(fn.__kwdefaults__, f"the keyword defaults of {name}")
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                content = cell.cell_contents
            except ValueError:  # a cell not yet assigned
                self.put("cell", var, "empty")
                continue
            self.put("cell", var)
            self.value(content, f"the closure cell {var!r} of {name}")
        for g in sorted(_global_names(fn.__code__)):
            if g in fn.__globals__:
                self.global_value(g, fn.__globals__[g], fn)
            else:
                self.put("global", g, "builtin" if hasattr(builtins, g) else "unbound")
        self.active.discard(id(fn))

    def global_value(self, g: str, x: Any, reader: types.FunctionType) -> None:
        """A global read by ``reader``: a function of another module (a library) by name, else by content."""
        self.put("global", g)
        if isinstance(x, types.FunctionType) and x.__module__ != reader.__module__:
            self.put("library function", _name_of(x))
        else:
            self.value(x, f"the global {g!r} read by {_name_of(reader)}")


def content_digest(x: Any, *, where: str = "the value") -> str:
    """SHA-256 (hex) of ``x``'s content by the rules of the module docstring.

    Raises:
        Unfingerprintable: ``x`` holds an object without stable content (named with ``where``).
    """
    enc = _Encoder()
    enc.value(x, where)
    return enc.digest()


def describe(x: Any, *, where: str = "the setting") -> str:
    """Stable text of a setting: strings as they are, numbers and ``None`` as Python prints them, anything
    else as its type with a content digest (a tensor also with dtype and shape).

    >>> import torch
    >>> describe(torch.zeros(2, 3)).startswith("tensor float32[2, 3] sha256 ")
    True
    """
    if isinstance(x, str):
        return x
    if x is None or isinstance(x, (bool, int, float, np.generic)):
        return str(x.item() if isinstance(x, np.generic) else x)
    digest = content_digest(x, where=where)[:DIGEST_CHARS]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return f"tensor {str(x.dtype).removeprefix('torch.')}{list(x.shape)} sha256 {digest}"
    return f"{type(x).__name__} sha256 {digest}"


def hook_fingerprint(fn: Callable[..., Any]) -> str:
    """``module.qualname #digest`` of a hook function (``'label' (...)`` for a :func:`labelled_hook`): the
    digest covers its code and data (module docstring).

    Raises:
        Unfingerprintable: the hook holds an object without stable content; the message says where and
            how to label it.
    """
    try:
        digest = content_digest(fn, where=f"the hook {_name_of(fn)}")[:DIGEST_CHARS]
    except Unfingerprintable as err:
        raise Unfingerprintable(
            f"{err}, so a checkpoint could not tell this intervention from another one. Wrap the hook as "
            "mechgeom.sweep.labelled_hook(fn, label='<the intervention and its parameters>') (the label then "
            "stands for that state: change it whenever the intervention changes), or run without checkpoint="
        ) from None
    text = f"{_name_of(fn)} #{digest}"
    return f"{fn.label!r} ({text})" if isinstance(fn, LabelledHook) else text


def hooks_fingerprint(hooks: Sequence[tuple[Any, Callable[..., Any]]]) -> str:
    """The fingerprint of ``extra_hooks``: ``"none"``, or ``hook point: hook_fingerprint(fn)`` per pair, in
    order (the order of hooks on one point changes the result)."""
    if not hooks:
        return "none"
    parts = []
    for name, fn in hooks:
        point = name if isinstance(name, str) else _name_of(name)
        try:
            parts.append(
                f"{point if isinstance(name, str) else hook_fingerprint(name)}: {hook_fingerprint(fn)}"
            )
        except Unfingerprintable as err:
            raise Unfingerprintable(f"the extra hook on {point}: {err}") from None
    return "; ".join(parts)


def model_label(model: Any) -> str:
    """The model's name for a fingerprint: ``cfg.model_name``, else the class name."""
    return str(getattr(model.cfg, "model_name", "")) or type(model).__name__


def model_dtype(model: Any) -> str:
    """The dtypes of the model's parameters (``float32``, or e.g. ``bfloat16+float32`` when mixed)."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return "+".join(dtypes) or str(getattr(model.cfg, "dtype", "unknown")).removeprefix("torch.")


def weights_digest(model: Any, *, threads: int = 4) -> str:
    """SHA-256 of every tensor of ``model.state_dict()`` (name, dtype, shape and bytes), as they are now.

    Taken when a sweep starts, so a weight edited in place after loading changes it. Tensors that share
    storage are read once; they are hashed on ``threads`` threads (hashlib releases the GIL). The cost is
    one read of the weights (``docs/sweeps.md`` gives it for SmolLM2).

    Returns:
        ``"sha256:<16 hex digits>"``.
    """
    state = model.state_dict()
    views: dict[tuple[Any, ...], Any] = {}
    names: list[tuple[str, tuple[Any, ...]]] = []
    other = _Encoder(strict=False)  # non-tensor entries (a module's extra state), by content or type
    for name in sorted(state):
        t = state[name]
        if not hasattr(t, "data_ptr"):
            other.put(name)
            other.value(t, name)
            continue
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        views.setdefault(ident, t)
        names.append((name, ident))
    idents = list(views)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = dict(
            zip(
                idents,
                pool.map(lambda i: hashlib.sha256(_tensor_bytes(views[i])).digest(), idents),
                strict=True,
            )
        )
    h = hashlib.sha256()
    for name, ident in names:
        h.update(f"{name}|{ident[2]}|{ident[3]}|".encode())
        h.update(digests[ident])
    h.update(other.digest().encode())
    return f"sha256:{h.hexdigest()[:DIGEST_CHARS]}"


def tokens_hash(tokens: Any, *, attention_mask: Any = None) -> str:
    """Content hash of a token tensor or array (its shape and int64 values), 16 hex digits.

    ``attention_mask`` (``[batch, pos]``, 1 at real tokens) is hashed with the tokens where it marks
    padding: the same ids with another mask (other tokens scored, or padding on the other side) are other
    numbers. A mask without padding, or none, gives the hash of the tokens alone (older fingerprints hold).

    >>> tokens_hash(np.array([[1, 2, 3]])) == tokens_hash([[1, 2, 3]])
    True
    >>> tokens_hash([[1, 2, 3]], attention_mask=[[1, 1, 1]]) == tokens_hash([[1, 2, 3]])
    True
    >>> tokens_hash([[1, 2, 3]], attention_mask=[[0, 1, 1]]) == tokens_hash([[1, 2, 3]])
    False
    """
    arr = np.asarray(tokens.detach().cpu() if hasattr(tokens, "detach") else tokens, dtype=np.int64)
    h = hashlib.sha256(str(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    if attention_mask is not None:
        mask = attention_mask.detach().cpu() if hasattr(attention_mask, "detach") else attention_mask
        real = np.asarray(mask).astype(bool)
        if not real.all():
            h.update(b"mask")
            h.update(np.packbits(real).tobytes())
    return h.hexdigest()[:16]
