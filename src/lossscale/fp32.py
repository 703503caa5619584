"""Run chosen modules of an autocast model in FP32: the fix for a forward overflow no loss scale can help.

A module whose own FP16 output exceeds 65504 gives inf in the forward, and the loss scale only touches
the backward: it cannot help. ``keep_fp32`` runs such modules outside autocast, in FP32, and leaves
the rest of the model in FP16 (``lossscale.audit`` names them):

```python
handle = lossscale.keep_fp32(model, ["transformer.h.0.mlp.c_proj"])   # names or module objects
...train...
lossscale.fp32.kept_modules(model)    # ['transformer.h.0.mlp.c_proj']
handle.remove()                       # back to autocast everywhere
```

What a kept module does, inside an enabled autocast region of its device (outside one it runs exactly
as before, so an FP32 evaluation is untouched):

* its floating inputs of a lower precision (float16, bfloat16), in its positional and keyword
  arguments and nested in tuples, lists and dicts, are cast to float32; float32 and float64 inputs and
  everything else pass unchanged (autocast never narrows float64 either);
* its ``forward`` runs with autocast disabled, so every op in it (its submodules' too) computes in the
  dtype of its operands: float32, with the module's own float32 parameters;
* its outputs stay **float32** (the cast rule). That is what autocast itself does with the ops it runs in
  FP32 (softmax, layer_norm, ...): the next op autocast lists casts its input to FP16 itself, and a
  pointwise op (a residual add) promotes to float32. Casting back to FP16 would turn the very overflow
  the module was kept for into inf again. Pass ``cast_back=True`` for code downstream that needs the
  autocast dtype: floating float32 outputs are then cast to autocast's dtype, which is safe only when
  the overflow is *inside* the module (an attention's scores) and its output fits FP16 (the audit's
  ``fp32 amax`` column says which).

Parameters are not touched: they stay the user's (float32, as autocast's recipe keeps them; a module
with float16 parameters is refused, since FP32 inputs would not match them). In the backward, autograd
casts the gradient of an upcast input back to the input's dtype, so the rest of the model's gradients
are as before.

How, and why not hooks: the module's class becomes a subclass of its own class that overrides
``forward`` (one subclass per base class, cached; its ``__name__`` is the base's, so code that matches
modules by class name, such as ``_no_split_modules``, still matches). A pair of forward hooks cannot
disable autocast for the body without leaving it disabled when the forward raises, and closures in a
module's hook dicts do not pickle. With the class swap:

* ``state_dict()`` is the user's, key for key (nothing is stored on the instance, no buffer, no
  parameter, no attribute), and ``load_state_dict`` of a plain model's checkpoint works;
* ``pickle``, ``torch.save(model)`` and ``copy.deepcopy(model)`` keep the modules kept: the subclass
  pickles as (base class, cast rule) and the module's own state, and is rebuilt on load;
* ``isinstance`` checks hold, hooks already registered on the module keep running.

Calling ``keep_fp32`` again adds modules and is idempotent: a module already kept stays kept (a
different ``cast_back`` updates its rule) and belongs to the handle that first kept it. ``release``
un-keeps by name (after unpickling a model, whose handle stayed behind). A scaler that upcasts by
itself (``on_forward_overflow="upcast"``) calls ``keep_fp32(model, [name])`` and stores
``kept_modules(model)`` in its checkpoint.

Host syncs: none. The wrapper reads dtypes and the autocast state, never a tensor's values.
"""

from __future__ import annotations

import copy
import difflib
import weakref
from typing import Dict, Iterable, List, Tuple, Union

import torch

__all__ = ["keep_fp32", "kept_modules", "is_kept", "release", "KeepFP32Handle", "to_float32", "tensors_in"]

#: Dtypes a kept module's inputs are upcast from. float64 stays float64: autocast never narrows it.
LOWER_PRECISION = (torch.float16, torch.bfloat16)

# One kept subclass per (base class, cast_back), so two kept Linears share a type.
_KEPT_CLASSES: Dict[Tuple[type, bool], type] = {}


# ------------------------------------------------------------------ autocast state, torch 2.3 and later
def _autocast_state(device_type: str) -> Tuple[bool, torch.dtype]:
    """Whether autocast is enabled for ``device_type``, and its dtype. torch 2.4 takes the device type;
    2.3 has one function per device (cuda and cpu)."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch 2.3
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


# ------------------------------------------------------------------ nested tensors
def _map_tensors(fn, value):
    """``value`` with ``fn`` applied to every tensor in it, through tuples (namedtuples too), lists and
    dicts (a dict subclass such as transformers' ``ModelOutput`` is copied, then its items replaced)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map_tensors(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map_tensors(fn, v) for v in value]
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _map_tensors(fn, v)
        return out
    return value


def tensors_in(value) -> List[torch.Tensor]:
    """The tensors in ``value`` (nested in tuples, lists and dicts), in order, without rebuilding anything."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def to_float32(value):
    """``value`` with every float16 / bfloat16 tensor in it (nested in tuples, lists and dicts) cast to
    float32, differentiably; other tensors and objects unchanged. The rule a kept module's inputs follow."""
    return _map_tensors(lambda t: t.float() if t.dtype in LOWER_PRECISION else t, value)


def _first_device_type(module: torch.nn.Module, args, kwargs) -> str:
    """The device type whose autocast state applies: the first floating input's, else the module's first
    parameter's or buffer's, else the CPU's."""
    for t in tensors_in((args, kwargs)):
        if t.is_floating_point():
            return t.device.type
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return "cpu"


# ------------------------------------------------------------------ the kept subclass
def _forward(self, *args, **kwargs):
    """The base class's ``forward`` in FP32, outside autocast (see ``lossscale.fp32``)."""
    cls = type(self)
    base_forward = cls._lossscale_fp32_base.forward
    device_type = _first_device_type(self, args, kwargs)
    enabled, dtype = _autocast_state(device_type)
    if not enabled:  # no autocast here: the module runs exactly as it would unkept
        return base_forward(self, *args, **kwargs)
    with torch.autocast(device_type, enabled=False):
        out = base_forward(self, *to_float32(args), **to_float32(kwargs))
    if cls._lossscale_fp32_cast_back:
        out = _map_tensors(lambda t: t.to(dtype) if t.dtype == torch.float32 else t, out)
    return out


def _make_kept(base: type, cast_back: bool):
    """An empty kept instance of ``base`` (pickle then restores its state with ``__setstate__``)."""
    obj = base.__new__(base)
    obj.__class__ = _kept_class(base, cast_back)
    return obj


def _reduce_ex(self, protocol):
    # The kept class is not importable by name: pickle as (base class, cast rule) + the module's state.
    # The state is the third item, restored after the object exists, so a module that refers back to
    # itself (or a parent that refers to it) deep-copies and pickles as a plain module does.
    cls = type(self)
    return _make_kept, (cls._lossscale_fp32_base, cls._lossscale_fp32_cast_back), self.__getstate__()


def _kept_class(base: type, cast_back: bool) -> type:
    key = (base, cast_back)
    cls = _KEPT_CLASSES.get(key)
    if cls is None:
        cls = type(
            base.__name__,
            (base,),
            {
                # The base's names, so code that matches modules by class name still matches.
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "_lossscale_fp32_base": base,
                "_lossscale_fp32_cast_back": cast_back,
                "forward": _forward,
                "__reduce_ex__": _reduce_ex,
            },
        )
        _KEPT_CLASSES[key] = cls
    return cls


def is_kept(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs in FP32 through ``keep_fp32``."""
    return "_lossscale_fp32_base" in type(module).__dict__


def _unkeep(module: torch.nn.Module) -> None:
    if is_kept(module):
        module.__class__ = type(module)._lossscale_fp32_base


# ------------------------------------------------------------------ selecting modules
def _check_model(model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"model={model!r} must be a torch.nn.Module (the model that holds the modules to keep in FP32)."
        )
    return model


def _resolve(model: torch.nn.Module, modules) -> List[Tuple[str, torch.nn.Module]]:
    """``modules`` (names as in ``named_modules``, or module objects of ``model``) as (name, module) pairs,
    in the order given, without repeats."""
    if isinstance(modules, (str, torch.nn.Module)):
        modules = [modules]
    try:
        wanted = list(modules)
    except TypeError:
        raise ValueError(
            f"modules={modules!r} must be a list of module names (as in model.named_modules()) "
            "or module objects of the model."
        ) from None
    named = dict(model.named_modules(remove_duplicate=False))
    names_of = {}
    for name, m in named.items():
        names_of.setdefault(id(m), name)
    out: Dict[str, torch.nn.Module] = {}
    for m in wanted:
        if isinstance(m, str):
            if m not in named:
                close = difflib.get_close_matches(m, list(named), n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else " (see model.named_modules())."
                raise ValueError(f"modules: {m!r} is not a submodule name of the model{hint}")
            out.setdefault(m, named[m])
        elif isinstance(m, torch.nn.Module):
            if id(m) not in names_of:
                raise ValueError(
                    f"modules: {type(m).__name__} object is not a submodule of the model; pass "
                    "one of model's own modules (after a deepcopy, the copy's) or its name."
                )
            out.setdefault(names_of[id(m)], m)
        else:
            raise ValueError(f"modules entries must be module names or module objects, got {m!r}.")
    return list(out.items())


def _check_keepable(name: str, module: torch.nn.Module) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        raise ValueError(
            f"modules: {name!r} is a TorchScript module, whose class cannot change; keep the "
            "eager module before scripting."
        )
    for pname, p in module.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"modules: {name!r} has a {str(p.dtype).replace('torch.', '')} parameter {pname!r}; keep_fp32 "
                "runs a module on float32 inputs with its own parameters, which autocast's recipe keeps in "
                f"float32. Convert it first (model.get_submodule({name!r}).float())."
            )


# ------------------------------------------------------------------ the public functions
class KeepFP32Handle:
    """What ``keep_fp32`` returns: ``remove()`` puts the modules this call kept back under autocast.

    Attributes:
        names: the module names this call kept (modules that were kept already are not in it: they
            belong to the handle that kept them first).

    Also a context manager: ``with lossscale.keep_fp32(model, names): ...`` removes on exit. The
    handle refers to the model's module objects (weakly): after ``copy.deepcopy(model)`` or a pickle
    round trip the copy's modules stay kept, and ``release`` is the way to un-keep them.
    """

    def __init__(self, kept: List[Tuple[str, torch.nn.Module]]):
        self.names: List[str] = [name for name, _ in kept]
        self._refs = [weakref.ref(m) for _, m in kept]

    def remove(self) -> None:
        """Run the modules this handle kept under autocast again (idempotent)."""
        for ref in self._refs:
            m = ref()
            if m is not None:
                _unkeep(m)
        self._refs = []

    def __enter__(self) -> "KeepFP32Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"KeepFP32Handle(names={self.names!r})"


def keep_fp32(
    model: torch.nn.Module, modules: Iterable[Union[str, torch.nn.Module]], *, cast_back: bool = False
) -> KeepFP32Handle:
    """Run ``modules`` of ``model`` outside autocast, in FP32; returns a handle whose ``remove()`` undoes it.

    Args:
        model: the model (a ``torch.nn.Module``) that holds the modules.
        modules: names as in ``model.named_modules()`` (``report.keep_fp32`` of ``lossscale.audit``)
            or module objects of ``model``; one name or module alone is accepted too.
        cast_back: False (default): a kept module's outputs stay float32 (see ``lossscale.fp32`` for
            why). True: float32 outputs are cast to autocast's dtype, for code downstream that needs it
            (safe only when the module's output itself fits FP16).

    Inside an enabled autocast region a kept module gets its float16/bfloat16 inputs cast to float32 and
    runs with autocast disabled; outside one it runs unchanged. Parameters, ``state_dict()`` keys and
    values, and hooks are untouched; pickling and ``copy.deepcopy`` of the model keep the modules kept.
    Calling it again adds modules; a module kept already stays kept (``cast_back`` updated).

    Raises:
        ValueError: ``model`` is not a module; a name is not one of its modules (close names are
            suggested) or an object is not one of its modules; a module has non-float32 floating
            parameters, or is a TorchScript module.

    No host sync.
    """
    _check_model(model)
    if not isinstance(cast_back, bool):
        raise ValueError(f"cast_back={cast_back!r} must be True or False.")
    pairs = _resolve(model, modules)
    for name, m in pairs:
        _check_keepable(name, m)
    added = []
    for name, m in pairs:
        if not is_kept(m):
            added.append((name, m))
        base = getattr(type(m), "_lossscale_fp32_base", type(m))
        m.__class__ = _kept_class(base, cast_back)
    return KeepFP32Handle(added)


def kept_modules(model: torch.nn.Module) -> List[str]:
    """The names of ``model``'s modules that run in FP32 (``keep_fp32``), in ``named_modules`` order."""
    _check_model(model)
    return [name for name, m in model.named_modules() if is_kept(m)]


def release(model: torch.nn.Module, modules=None) -> List[str]:
    """Un-keep ``modules`` of ``model`` (names or objects; None: every kept module); returns the names
    released. For a model whose ``KeepFP32Handle`` is gone (unpickled, deep-copied)."""
    _check_model(model)
    pairs = [(n, m) for n, m in model.named_modules() if is_kept(m)] if modules is None else _resolve(model, modules)
    released = [name for name, m in pairs if is_kept(m)]
    for _, m in pairs:
        _unkeep(m)
    return released
