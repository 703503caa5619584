"""``lossscale.rescale``: divide a transformer's residual stream by a power of two, so its FP16 forward stays finite.

(The module is ``lossscale.rescaling``, not ``lossscale.rescale``: a submodule of that name would replace the
function ``lossscale.rescale`` on the package as soon as anything imported it.)

When what outgrows FP16's 65504 is the residual stream itself (Gemma-style: a scaled embedding, large
post-norm weights), no loss scale helps (the scale only touches the backward), and keeping the overflowing
modules in FP32 (``lossscale.keep_fp32``) moves most of the model out of FP16. In a pre-norm transformer every
reader of the residual stream is a norm, and a norm is blind to a common factor of its input once its ``eps``
moves with it: ``norm(x / c; eps / c**2) == norm(x; eps)``. So dividing the stream by ``c = 2**k`` at every
place that writes into it, and moving the ``eps`` of every norm that reads it, leaves the model's function
unchanged; and a power of two changes only exponents, so in FP32 it is unchanged **bitwise** (as long as no
value becomes subnormal).

Where the factor goes (each writer, before its output is formed, so the FP16 tensor that used to overflow is
the one made small):

* an embedding: its looked-up rows times ``1/c`` (a lookup cannot overflow); Gemma's scaled embedding: its
  ``sqrt(hidden)`` scale times ``1/c``, so the product is formed small;
* a Linear (or GPT-2's ``Conv1D``) whose output is added to the stream (``o_proj``, ``down_proj``,
  ``c_proj``): its input times ``1/c``, and its bias times ``1/c`` inside the graph (``(x/c) W + b/c`` is
  ``(x W + b) / c``, exactly);
* a post-norm that writes the stream (Gemma's ``post_attention_layernorm``, ``post_feedforward_layernorm``):
  its FP32 result times ``1/c``, before the cast to the input's dtype;
* ``inputs_embeds`` given to the model instead of token ids: times ``1/c``.

and every norm that reads the stream (``input_layernorm``, ``post_attention_layernorm`` of Llama,
``pre_feedforward_layernorm`` of Gemma, ``ln_1``/``ln_2``/``ln_f`` of GPT-2, the final norm) gets
``eps / c**2``. The factors are constants in the graph: no parameter, no persistent buffer and no
``state_dict`` entry changes, and every parameter's gradient is the original's bitwise in FP32 (the
gradients of the stream and of the writers' outputs grow by ``c``, those of their inputs and weights do
not). ``output_hidden_states`` returns the stream as it flows: divided by ``c``.

Which models: the families whose forward code is known, checked module by module (the exact classes, so a
subclass that could change a forward is refused): Llama, Qwen2, Qwen3, Mistral (RMSNorm pre-norm, tied or
untied embeddings), Gemma 2 and Gemma 3 text models (scaled embedding, sandwich norms), GPT-2 (LayerNorm,
biases, tied ``wte``). Any other model is refused with an error naming what could not be proven, unless the
caller names the writers and readers (``writers=``, ``readers=``).

The handle ``Rescaling`` undoes it (bitwise), records it (``state_dict``), and writes an ordinary checkpoint
with the factor folded into the weights and config (``export``). ``choose_rescale`` picks ``c`` from an
audit. Host syncs: none in the rescaled forward; ``choose_rescale`` and ``export`` read values on the host.
"""

from __future__ import annotations

import copy
import inspect
import math
import types
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import formats

__all__ = ["rescale", "Rescaling", "RescaleWriter", "choose_rescale", "RescaleChoice", "LayerNeed", "in_force"]

FP16_MAX = formats.FP16.max

#: How each writer is rescaled (``RescaleWriter.how``).
INPUT = "input"  # a Linear / Conv1D: its input (and bias) times 1/c
OUTPUT = "output"  # an embedding lookup: its rows times 1/c
NORM_OUTPUT = "norm output"  # a post-norm: its FP32 result times 1/c, before the cast back
SCALED_EMBEDDING = "scaled embedding"  # Gemma: the embedding's scale times 1/c


@dataclass(frozen=True)
class RescaleWriter:
    """One module that writes the residual stream, and where its ``1/c`` goes.

    Attributes:
        name: its name in ``model.named_modules()``.
        how: ``"input"`` (a Linear or ``Conv1D``: its input and bias times ``1/c``), ``"output"`` (an
            embedding: its rows times ``1/c``), ``"norm output"`` (a post-norm: its FP32 result times
            ``1/c`` before the cast to the input's dtype) or ``"scaled embedding"`` (Gemma: its scale
            times ``1/c``).
    """

    name: str
    how: str


# ------------------------------------------------------------------ the known families
@dataclass(frozen=True)
class _Family:
    """What the forward code of one transformers family does with its residual stream."""

    name: str
    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix
    base_attr: str  # the base model's attribute on the *ForCausalLM
    base_cls: str
    embeddings: Tuple[Tuple[str, str], ...]  # (attribute of the base model, how)
    layers_attr: str
    layer_cls: str
    writers: Tuple[Tuple[str, str, str], ...]  # (path in the layer, class, how)
    readers: Tuple[str, ...]  # paths in the layer
    norm_cls: str
    final_norm: str
    branches: Tuple[Tuple[str, str], ...]  # (path in the layer, class): the branches whose last op is known
    eps_field: str  # the config field every norm's eps comes from (export)
    stream: Tuple[str, ...] = ()  # base-model modules whose output is the stream before the first layer


def _llama_like(name: str, module: str, prefix: str) -> _Family:
    return _Family(
        name=name,
        module=module,
        prefix=prefix,
        base_attr="model",
        base_cls=f"{prefix}Model",
        embeddings=(("embed_tokens", OUTPUT),),
        layers_attr="layers",
        layer_cls=f"{prefix}DecoderLayer",
        writers=(("self_attn.o_proj", "Linear", INPUT), ("mlp.down_proj", "Linear", INPUT)),
        readers=("input_layernorm", "post_attention_layernorm"),
        norm_cls=f"{prefix}RMSNorm",
        final_norm="norm",
        branches=(("self_attn", f"{prefix}Attention"), ("mlp", f"{prefix}MLP")),
        eps_field="rms_norm_eps",
    )


def _gemma(name: str, module: str, prefix: str, base: str) -> _Family:
    return _Family(
        name=name,
        module=module,
        prefix=prefix,
        base_attr="model",
        base_cls=base,
        embeddings=(("embed_tokens", SCALED_EMBEDDING),),
        layers_attr="layers",
        layer_cls=f"{prefix}DecoderLayer",
        writers=(
            ("post_attention_layernorm", f"{prefix}RMSNorm", NORM_OUTPUT),
            ("post_feedforward_layernorm", f"{prefix}RMSNorm", NORM_OUTPUT),
        ),
        readers=("input_layernorm", "pre_feedforward_layernorm"),
        norm_cls=f"{prefix}RMSNorm",
        final_norm="norm",
        branches=(("self_attn", f"{prefix}Attention"), ("mlp", f"{prefix}MLP")),
        eps_field="rms_norm_eps",
    )


_FAMILIES: Tuple[_Family, ...] = (
    _llama_like("llama", "llama", "Llama"),
    _llama_like("qwen2", "qwen2", "Qwen2"),
    _llama_like("qwen3", "qwen3", "Qwen3"),
    _llama_like("mistral", "mistral", "Mistral"),
    _gemma("gemma2", "gemma2", "Gemma2", "Gemma2Model"),
    _gemma("gemma3", "gemma3", "Gemma3", "Gemma3TextModel"),
    _Family(
        name="gpt2",
        module="gpt2",
        prefix="GPT2",
        base_attr="transformer",
        base_cls="GPT2Model",
        embeddings=(("wte", OUTPUT), ("wpe", OUTPUT)),
        layers_attr="h",
        layer_cls="GPT2Block",
        writers=(("attn.c_proj", "Conv1D", INPUT), ("mlp.c_proj", "Conv1D", INPUT)),
        readers=("ln_1", "ln_2"),
        norm_cls="LayerNorm",
        final_norm="ln_f",
        branches=(("attn", "GPT2Attention"), ("mlp", "GPT2MLP")),
        eps_field="layer_norm_epsilon",
        stream=("drop",),
    ),
)


def _causal_cls(f: _Family) -> str:
    """The class name of the family's language-model head: ``<prefix>ForCausalLM``, GPT-2's ``GPT2LMHeadModel``."""
    return "GPT2LMHeadModel" if f.name == "gpt2" else f"{f.prefix}ForCausalLM"


def _family_of(model: torch.nn.Module) -> Optional[_Family]:
    mod = type(model).__module__
    for f in _FAMILIES:
        if mod == f"transformers.models.{f.module}.modeling_{f.module}":
            return f
    return None


class _Unproven(Exception):
    """A structural check failed: what could not be proven."""


def _cls(f: _Family, name: str) -> type:
    import importlib

    if name == "Linear":
        return torch.nn.Linear
    if name == "LayerNorm":
        return torch.nn.LayerNorm
    if name == "Conv1D":
        return importlib.import_module("transformers.pytorch_utils").Conv1D
    return getattr(importlib.import_module(f"transformers.models.{f.module}.modeling_{f.module}"), name)


def _exact(f: _Family, module: Any, cls_name: str, where: str) -> None:
    cls = _cls(f, cls_name)
    if type(module) is not cls:
        raise _Unproven(f"{where} is {type(module).__name__}, not {cls_name}: its forward is not the one known")
    if "forward" in vars(module):
        raise _Unproven(f"{where} has its forward replaced on the instance (rescaled already, or patched)")


def _plan(model: torch.nn.Module, f: _Family) -> Tuple[List[RescaleWriter], List[str], str, List[str]]:
    """The writers, readers, base-model name and layer names of a model of family ``f``, each checked."""
    cls = type(model).__name__
    if cls == f.base_cls:
        base, prefix = model, ""
    elif cls == _causal_cls(f):
        base, prefix = getattr(model, f.base_attr, None), f.base_attr + "."
        if base is None:
            raise _Unproven(f"{cls} has no .{f.base_attr}")
    else:
        raise _Unproven(
            f"{cls} is not {_causal_cls(f)} or {f.base_cls}: what its forward does with the residual stream "
            "(which head reads it) is not known"
        )
    _exact(f, base, f.base_cls, prefix.rstrip(".") or "the model")
    config = getattr(base, "config", None)
    if getattr(config, "add_cross_attention", False):
        raise _Unproven("the model has cross-attention, which adds to the residual stream in a branch not known")
    writers: List[RescaleWriter] = []
    readers: List[str] = []
    emb_cls = {OUTPUT: "Embedding", SCALED_EMBEDDING: f"{f.prefix}TextScaledWordEmbedding"}
    for attr, how in f.embeddings:
        m = getattr(base, attr, None)
        want = emb_cls[how]
        if want == "Embedding":
            if type(m) is not torch.nn.Embedding or "forward" in vars(m):
                raise _Unproven(f"{prefix}{attr} is {type(m).__name__}, not a plain Embedding")
        else:
            _exact(f, m, want, prefix + attr)
        writers.append(RescaleWriter(prefix + attr, how))
    layers = getattr(base, f.layers_attr, None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise _Unproven(f"{prefix}{f.layers_attr} is not a ModuleList of decoder layers")
    layer_names = []
    for i, layer in enumerate(layers):
        lname = f"{prefix}{f.layers_attr}.{i}"
        _exact(f, layer, f.layer_cls, lname)
        layer_names.append(lname)
        for path, cname in f.branches:
            _exact(f, layer.get_submodule(path), cname, f"{lname}.{path}")
        for path, cname, how in f.writers:
            _exact(f, _get(layer, path, lname), cname, f"{lname}.{path}")
            writers.append(RescaleWriter(f"{lname}.{path}", how))
        for path in f.readers:
            _exact(f, _get(layer, path, lname), f.norm_cls, f"{lname}.{path}")
            readers.append(f"{lname}.{path}")
    _exact(f, _get(base, f.final_norm, prefix.rstrip(".")), f.norm_cls, prefix + f.final_norm)
    readers.append(prefix + f.final_norm)
    return writers, readers, prefix.rstrip("."), layer_names


def _get(module: torch.nn.Module, path: str, where: str) -> torch.nn.Module:
    try:
        return module.get_submodule(path)
    except AttributeError:
        raise _Unproven(f"{where} has no {path}") from None


# ------------------------------------------------------------------ the rescaled forwards
# Bound methods (types.MethodType) on the instance: ``copy.deepcopy`` and pickle carry them to the copy's
# own module, and ``del module.forward`` restores the class's.
def _linear_input_forward(self, x):
    inv = self._lossscale_inv
    bias = None if self.bias is None else self.bias * inv
    return torch.nn.functional.linear(x * inv, self.weight, bias)


def _conv1d_input_forward(self, x):
    inv = self._lossscale_inv
    size_out = x.size()[:-1] + (self.nf,)
    out = torch.addmm(self.bias * inv, (x * inv).view(-1, x.size(-1)), self.weight)
    return out.view(size_out)


def _embedding_output_forward(self, ids):
    return type(self).forward(self, ids) * self._lossscale_inv


def _scaled_embedding_forward(self, ids):
    # Gemma's forward, ``embedding(ids) * embed_scale.to(weight.dtype)``, with the scale times 1/c, so the
    # product is formed small (in a float16 model it would overflow first).
    scale = (self.embed_scale * self._lossscale_inv).to(self.weight.dtype)
    return torch.nn.Embedding.forward(self, ids) * scale


def _norm_output_forward(self, x):
    # The norm's own forward on an FP32 input computes in FP32 and returns FP32 (Gemma's RMSNorm computes
    # in FP32 whatever its input); the 1/c goes on before the cast back, so the FP16 result is the small one.
    out = type(self).forward(self, x.float()) * self._lossscale_inv
    return out.to(x.dtype)


def _pre_hook_inputs_embeds(module, args, kwargs):
    # inputs_embeds given instead of ids: the stream's first value, divided by c like the embedding's.
    inv = module._lossscale_inv
    pos = module._lossscale_embeds_pos
    if kwargs.get("inputs_embeds") is not None:
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * inv
    elif pos is not None and len(args) > pos and args[pos] is not None:
        args = args[:pos] + (args[pos] * inv,) + args[pos + 1 :]
    return args, kwargs


def _forward_for(module: torch.nn.Module, how: str):
    if how == INPUT:
        if isinstance(module, torch.nn.Linear):
            return _linear_input_forward
        return _conv1d_input_forward
    if how == OUTPUT:
        return _embedding_output_forward
    if how == SCALED_EMBEDDING:
        return _scaled_embedding_forward
    return _norm_output_forward


def _eps_attr(module: torch.nn.Module) -> Optional[str]:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(module, attr, None)
        if isinstance(v, float) and not isinstance(v, bool):
            return attr
    return None


# ------------------------------------------------------------------ the handle
_IN_FORCE: "weakref.WeakKeyDictionary[torch.nn.Module, Rescaling]" = weakref.WeakKeyDictionary()


class Rescaling:
    """What ``rescale`` returns: the rescaling in force on a model, and the way to undo, record and export it.

    Attributes:
        factor: ``c``, the power of two the residual stream is divided by.
        family: the model family it was proven for (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``,
            ``"gemma2"``, ``"gemma3"``, ``"gpt2"``), or ``"named"`` when the caller named the writers and
            readers.
        writers: the modules that write the residual stream (``RescaleWriter``: name and where ``1/c``
            goes).
        readers: the norms that read it (their ``eps`` divided by ``c**2``).
        in_force: False once ``undo`` ran.

    The handle refers to the model's modules (weakly). ``copy.deepcopy(model)`` copies the rescaled
    forwards to the copy (which stays rescaled and computes the same function); this handle undoes only
    the model it was made for.
    """

    def __init__(self, model, factor, family, writers, readers, base_name, layers):
        self.factor: float = float(factor)
        self.family: str = family
        self.writers: Tuple[RescaleWriter, ...] = tuple(writers)
        self.readers: Tuple[str, ...] = tuple(readers)
        self.in_force: bool = False
        self._model = weakref.ref(model)
        self._base_name = base_name
        self._layers: Tuple[str, ...] = tuple(layers)
        self._saved_eps: List[Tuple[torch.nn.Module, str, float]] = []
        self._patched: List[torch.nn.Module] = []
        self._hook = None

    # -- applying and undoing
    def _apply(self, model: torch.nn.Module) -> None:
        inv = 1.0 / self.factor
        modules = dict(model.named_modules())
        for w in self.writers:
            m = modules[w.name]
            m._lossscale_inv = inv
            m.forward = types.MethodType(_forward_for(m, w.how), m)
            self._patched.append(m)
        for name in self.readers:
            m = modules[name]
            attr = _eps_attr(m)
            old = getattr(m, attr)
            self._saved_eps.append((m, attr, old))
            setattr(m, attr, old / (self.factor * self.factor))
        if self._base_name is not None:
            base = modules[self._base_name]
            base._lossscale_inv = inv
            params = list(inspect.signature(base.forward).parameters)
            base._lossscale_embeds_pos = params.index("inputs_embeds") if "inputs_embeds" in params else None
            self._hook = base.register_forward_pre_hook(_pre_hook_inputs_embeds, with_kwargs=True)
        self.in_force = True
        _IN_FORCE[model] = self

    def undo(self) -> None:
        """Restore the model exactly as it was: the class forwards, every ``eps`` (the very float it had), no
        hook. Raises ``RuntimeError`` when this rescaling was undone already."""
        if not self.in_force:
            raise RuntimeError("this Rescaling was undone already: call lossscale.rescale(model, ...) to apply one")
        for m in self._patched:
            del m.forward
            del m._lossscale_inv
        for m, attr, old in self._saved_eps:
            setattr(m, attr, old)
        if self._hook is not None:
            self._hook.remove()
            base = self._model().get_submodule(self._base_name) if self._model() is not None else None
            if base is not None:
                del base._lossscale_inv, base._lossscale_embeds_pos
        self._patched, self._saved_eps, self._hook = [], [], None
        self.in_force = False
        model = self._model()
        if model is not None and _IN_FORCE.get(model) is self:
            del _IN_FORCE[model]

    # -- records
    def state_dict(self) -> Dict[str, Any]:
        """The rescaling as plain data, to save beside the model's checkpoint (the model's own ``state_dict``
        is the original's: no parameter or persistent buffer changes). ``lossscale.rescale(model,
        **rescaling.state_dict())`` applies it again to a model loaded from that checkpoint."""
        d: Dict[str, Any] = {"factor": self.factor}
        if self.family == "named":
            d["writers"] = [w.name for w in self.writers]
            d["readers"] = list(self.readers)
        return d

    def describe(self) -> str:
        """One line: the factor, the family, how many writers and readers, whether it is in force."""
        state = "in force" if self.in_force else "undone"
        return (
            f"residual stream divided by {_pow2(self.factor)} ({self.family}: {len(self.writers)} writers "
            f"scaled, {len(self.readers)} norms' eps divided by {_pow2(self.factor * self.factor)}), {state}"
        )

    def __repr__(self) -> str:
        return f"Rescaling({self.describe()})"

    # -- inference export
    def export(self, directory: str) -> None:
        """Write the rescaled model as an ordinary transformers checkpoint (weights and config only), with
        ``c`` folded into them: loadable by ``AutoModelForCausalLM.from_pretrained(directory)`` with no
        lossscale, hence by FP16 inference engines.

        What is folded: the embeddings' weights divided by ``c`` (a tied ``lm_head`` is untied first, keeping
        the original weights); the residual writers' weights and biases divided by ``c``; the config's norm
        ``eps`` divided by ``c**2``. Where a norm that does *not* read the stream takes its ``eps`` from the
        same config field (Qwen3's and Gemma 3's ``q_norm``/``k_norm``; Gemma's post-norms), its input is
        divided by ``c`` too (``q_proj``, ``k_proj``, ``o_proj``, ``down_proj``), so it computes what it
        did. Exact (a power of two times a weight) except Gemma's post-norms: their ``1 + weight`` form
        cannot hold a ``1/c`` exactly, so their weight becomes ``(1 + w) / c - 1``, rounded to the weight's
        dtype (the difference it makes is measured in the how-to page). A model rescaled with named
        writers and readers cannot be exported (its config fields are not known): ``ValueError``; an undone
        rescaling: ``RuntimeError``.

        Host syncs: it copies the weights.
        """
        if self.family == "named":
            raise ValueError(
                "Rescaling.export: the rescaling was applied to named writers and readers, whose config fields "
                "are not known; export needs one of the known families"
            )
        if not self.in_force:
            raise RuntimeError("Rescaling.export: this rescaling was undone; export before undo()")
        model = self._model()
        if model is None:
            raise RuntimeError("Rescaling.export: the model was garbage-collected")
        out = _folded_copy(model, _family_of(model), self.factor)
        out.save_pretrained(directory)


def _pow2(s: float) -> str:
    m, e = math.frexp(s)
    return f"2^{e - 1}" if m == 0.5 else f"{s:g}"


def _folded_copy(model: torch.nn.Module, f: _Family, c: float) -> torch.nn.Module:
    """A fresh model of ``model``'s class and config with the original weights, ``c`` folded in."""
    config = copy.deepcopy(model.config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    config.tie_word_embeddings = False
    out = type(model)(config)
    # A tied head's weight is the embedding's: absent from the untied model's loaded keys, copied below.
    missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(
            f"Rescaling.export: the model's weights do not fit a fresh {type(model).__name__} of its config "
            f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})"
        )
    base = out if type(out).__name__ == f.base_cls else getattr(out, f.base_attr)
    emb = getattr(base, f.embeddings[0][0])
    head = getattr(out, "lm_head", None)
    inv = 1.0 / c
    with torch.no_grad():
        if head is not None and tied:
            head.weight.copy_(emb.weight)
        for attr, _how in f.embeddings:
            getattr(base, attr).weight.mul_(inv)
        for layer in getattr(base, f.layers_attr):
            paths = [p for p, _cls, _how in f.writers]
            if f.name.startswith("gemma"):
                paths = ["self_attn.o_proj", "mlp.down_proj"]  # the post-norms' inputs (their eps moves)
            if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_norm"):
                paths += ["self_attn.q_proj", "self_attn.k_proj"]  # q_norm/k_norm share the eps field
            for p in paths:
                lin = layer.get_submodule(p)
                lin.weight.mul_(inv)
                if getattr(lin, "bias", None) is not None:
                    lin.bias.mul_(inv)
            if f.name.startswith("gemma"):
                for p, _cls, _how in f.writers:
                    w = layer.get_submodule(p).weight
                    w.copy_(((1.0 + w.double()) * inv - 1.0).to(w.dtype))
    setattr(config, f.eps_field, getattr(config, f.eps_field) / (c * c))
    for m in out.modules():  # the modules built from the config hold the old eps
        attr = _eps_attr(m)
        if attr is not None and type(m).__name__ in (f.norm_cls, "LayerNorm"):
            setattr(m, attr, getattr(config, f.eps_field))
    return out


# ------------------------------------------------------------------ the entry point
def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"rescale: factor must be a power of two (an int or float), got {type(factor).__name__}")
    c = float(factor)
    m, _e = math.frexp(c) if math.isfinite(c) else (0.0, 0)
    if not (math.isfinite(c) and c >= 1.0 and m == 0.5):
        raise ValueError(
            f"rescale: factor must be a power of two >= 1 (2, 4, ..., 2**k), got {factor!r}: only a power of "
            "two leaves the function unchanged"
        )
    return c


def rescale(
    model: torch.nn.Module,
    factor: float,
    *,
    writers: Optional[Sequence[str]] = None,
    readers: Optional[Sequence[str]] = None,
) -> Rescaling:
    """Divide ``model``'s residual stream by ``factor`` (a power of two), leaving its function unchanged.

    Every module that writes the stream gets a ``1/factor`` before its output is formed, every norm that
    reads it ``eps / factor**2`` (see ``lossscale.rescaling``). No parameter or persistent buffer changes:
    the optimizer, the checkpoint and every parameter's gradient (bitwise, in FP32) are the original's.
    Host syncs: none.

    Args:
        model: a transformers Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 (text) or GPT-2 model (the
            ``*ForCausalLM`` / ``GPT2LMHeadModel`` or the base model), or any model whose writers and
            readers you name.
        factor: ``c``, a power of two ``>= 1`` (``choose_rescale`` picks the smallest that leaves the
            headroom asked for).
        writers: for another model: the names of *every* module whose output is added into the residual
            stream (a ``Linear`` or ``Conv1D``: its input and bias are scaled; an ``Embedding``: its rows;
            a norm: its FP32 result). You vouch that these are all: a writer left out breaks the function.
            ``inputs_embeds`` passed to such a model are not rescaled.
        readers: with ``writers``: the names of every norm that reads the stream (an ``eps`` float
            attribute, as ``LayerNorm``, ``RMSNorm`` with a given ``eps`` and the transformers RMSNorms
            have).

    Returns:
        a ``Rescaling``: ``undo()``, ``state_dict()``, ``export(directory)``.

    Raises:
        ValueError: the model is not one whose writers and readers are known and none were named (the
            message names what could not be proven), a named module is missing or of a kind that cannot
            be scaled exactly, the factor is not a power of two, or an ``eps`` would become subnormal.
        RuntimeError: the model is rescaled already (undo it first).
    """
    c = _check_factor(factor)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"rescale: model must be a torch.nn.Module, got {type(model).__name__}")
    if model in _IN_FORCE:
        raise RuntimeError(
            f"rescale: the model is rescaled already ({_IN_FORCE[model].describe()}): call .undo() on its "
            "Rescaling first"
        )
    if (writers is None) != (readers is None):
        raise ValueError("rescale: writers and readers go together: name both (or neither, for a known family)")
    if writers is None:
        f = _family_of(model)
        if f is None:
            raise ValueError(
                f"rescale: cannot prove that rescaling {type(model).__name__} preserves its function: which "
                "modules write its residual stream and which norms read it are known for transformers' Llama, "
                "Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 and GPT-2 only. If you know them, name every one: "
                "rescale(model, factor, writers=[...], readers=[...])"
            )
        try:
            ws, rs, base_name, layers = _plan(model, f)
        except _Unproven as e:
            raise ValueError(
                f"rescale: cannot prove that rescaling {type(model).__name__} preserves its function: {e}"
            ) from None
        family = f.name
    else:
        ws, rs = _named(model, writers, readers)
        base_name, layers, family = None, [], "named"
    modules = dict(model.named_modules())
    for name in rs:
        eps = getattr(modules[name], _eps_attr(modules[name]))
        if eps != 0.0 and abs(eps) / (c * c) < torch.finfo(torch.float32).tiny:
            raise ValueError(
                f"rescale: factor {_pow2(c)} makes {name}'s eps ({eps:g}) subnormal in float32, so the norm would "
                "no longer compute what it did: choose a smaller factor"
            )
    handle = Rescaling(model, c, family, ws, rs, base_name, layers)
    handle._apply(model)
    return handle


def _named(model, writers, readers) -> Tuple[List[RescaleWriter], List[str]]:
    modules = dict(model.named_modules())
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is optional
        Conv1D = ()
    ws: List[RescaleWriter] = []
    for name in writers:
        if not isinstance(name, str) or name not in modules:
            raise ValueError(f"rescale: writers: {name!r} is not a module name of the model")
        m = modules[name]
        if "forward" in vars(m):
            raise ValueError(f"rescale: writers: {name} has its forward replaced on the instance already")
        if type(m) is torch.nn.Linear or (Conv1D and type(m) is Conv1D):
            how = INPUT
        elif type(m) is torch.nn.Embedding:
            how = OUTPUT
        elif _eps_attr(m) is not None:
            how = NORM_OUTPUT
        else:
            raise ValueError(
                f"rescale: writers: {name} is {type(m).__name__}; a writer must be a Linear, Conv1D, Embedding or "
                "a norm (an eps attribute), whose 1/c can go in before its output is formed"
            )
        ws.append(RescaleWriter(name, how))
    rs: List[str] = []
    for name in readers:
        if not isinstance(name, str) or name not in modules:
            raise ValueError(f"rescale: readers: {name!r} is not a module name of the model")
        if _eps_attr(modules[name]) is None:
            raise ValueError(
                f"rescale: readers: {name} is {type(modules[name]).__name__}, with no float eps (variance_epsilon) "
                "attribute; only a norm with its eps moved reads x/c as it read x"
            )
        rs.append(name)
    if not ws:
        raise ValueError("rescale: writers is empty: name every module that writes the residual stream")
    return ws, rs


def in_force(model: torch.nn.Module) -> Optional[Rescaling]:
    """The ``Rescaling`` in force on ``model``, or None."""
    return _IN_FORCE.get(model)


def with_rescaling(report):
    """``report`` (a ``HealthReport``) saying which rescalings are in force in this process: its
    ``rescaling`` field (one line per rescaled model) and a sentence of its text; unchanged when none is."""
    import dataclasses

    lines = tuple(f"{type(m).__name__}: {r.describe()}" for m, r in list(_IN_FORCE.items()))
    if not lines:
        return report
    text = report.text + " Residual stream rescaled (lossscale.rescale): " + "; ".join(lines) + "."
    return dataclasses.replace(report, rescaling=lines, text=text)


# ------------------------------------------------------------------ choosing c
@dataclass(frozen=True)
class LayerNeed:
    """One row of ``RescaleChoice.layers``.

    Attributes:
        name: the embedding writers' names (joined by ``", "``) or a decoder layer's name.
        amax: the largest ``|value|`` of the residual stream and its writers' outputs there, in the
            audit's FP32 forward.
        factor: the smallest power of two ``c`` with ``amax / c * 2**headroom_bits <= 65504``.
    """

    name: str
    amax: float
    factor: float


@dataclass(frozen=True)
class RescaleChoice:
    """What ``choose_rescale`` found: the factor for the whole stream and each layer's own need.

    Attributes:
        factor: the largest of the layers' factors (one ``c`` for the whole stream).
        headroom_bits: the binades kept below 65504.
        layers: per place, in order (``LayerNeed``).
    """

    factor: float
    headroom_bits: int
    layers: Tuple[LayerNeed, ...]

    def __str__(self) -> str:
        rows = [f"{n.name}: amax {n.amax:.3g} -> {_pow2(n.factor)}" for n in self.layers]
        return f"rescale factor {_pow2(self.factor)} (headroom {self.headroom_bits} binade(s)):\n  " + "\n  ".join(rows)


def _need(amax: float, headroom_bits: int) -> float:
    """Smallest power of two ``c >= 1`` with ``amax / c * 2**headroom_bits <= FP16_MAX``."""
    if not math.isfinite(amax):
        raise ValueError(f"choose_rescale: a residual-stream magnitude is {amax} in FP32: no factor helps")
    c = 1.0
    while amax / c * 2.0**headroom_bits > FP16_MAX:
        c *= 2.0
    return c


def choose_rescale(model: torch.nn.Module, report: Any, *, headroom_bits: int = 1) -> RescaleChoice:
    """The smallest power of two to divide ``model``'s residual stream by, from an audit of it.

    Reads ``report`` (a ``lossscale.audit`` report of ``model``): per decoder layer, the largest FP32
    magnitude of the residual stream (the layer's output) and of its writers' outputs; for the embedding,
    its writers' (and GPT-2's summed stream). The factor of each is the smallest power of two that brings it
    ``headroom_bits`` binades below 65504. Host syncs: none (the audit synced).

    Args:
        model: a model ``rescale`` knows (the family sets which modules are the stream).
        report: its ``AuditReport``.
        headroom_bits: binades kept below FP16's largest value (``>= 0``): 1 leaves room for a batch twice
            as large.

    Raises:
        ValueError: a model ``rescale`` refuses (the same message), a report without the stream's modules
            (an audit of another model), or ``headroom_bits`` negative.
    """
    if isinstance(headroom_bits, bool) or not isinstance(headroom_bits, int) or headroom_bits < 0:
        raise ValueError(f"choose_rescale: headroom_bits must be an int >= 0, got {headroom_bits!r}")
    f = _family_of(model)
    if f is None:
        raise ValueError(
            f"choose_rescale: {type(model).__name__} is not a model rescale knows (Llama, Qwen2, Qwen3, Mistral, "
            "Gemma 2, Gemma 3, GPT-2)"
        )
    try:
        writers, _readers, base_name, layer_names = _plan(model, f)
    except _Unproven as e:
        raise ValueError(f"choose_rescale: {e}") from None
    modules = getattr(report, "modules", None)
    if not isinstance(modules, dict):
        raise TypeError(f"choose_rescale: report must be a lossscale AuditReport, got {type(report).__name__}")

    def amax(names: List[str]) -> float:
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"choose_rescale: the report has no row for {missing[0]}: is it an audit of this model?")
        return max(modules[n].fp32_amax for n in names)

    prefix = base_name + "." if base_name else ""
    rows: List[LayerNeed] = []
    emb = [w.name for w in writers if not w.name.startswith(prefix + f.layers_attr + ".")]
    emb += [prefix + s for s in f.stream]
    a = amax(emb)
    rows.append(LayerNeed(", ".join(emb), a, _need(a, headroom_bits)))
    for lname in layer_names:
        names = [w.name for w in writers if w.name.startswith(lname + ".")] + [lname]
        a = amax(names)
        rows.append(LayerNeed(lname, a, _need(a, headroom_bits)))
    return RescaleChoice(max(r.factor for r in rows), headroom_bits, tuple(rows))


def audit_advice(model: torch.nn.Module, report: Any) -> Optional[str]:
    """The audit's note naming this remedy, or None: when the FP16 forward overflows, the model is one
    ``rescale`` knows, every module the audit would keep in FP32 writes the residual stream (or is a layer,
    whose output is the stream), and a rescaling brings the stream within FP16 (one binade of headroom).
    On a rescaled model: the note says which rescaling is in force."""
    if in_force(model) is not None:
        return f"audited with a rescaling in force: {in_force(model).describe()}"
    f = _family_of(model)
    if not getattr(report, "keep_fp32", None) or f is None:
        return None
    try:
        choice = choose_rescale(model, report)
        writers, _readers, base_name, layers = _plan(model, f)
    except (ValueError, TypeError, _Unproven):
        return None
    stream = {w.name for w in writers} | set(layers) | {base_name}
    if choice.factor == 1.0 or not set(report.keep_fp32) <= stream:
        return None  # an overflow inside a branch: dividing the stream does not reach it
    return (
        f"the residual stream reaches {max(r.amax for r in choice.layers):.3g} in FP32: instead of keeping "
        f"modules in FP32, lossscale.rescale(model, {int(choice.factor)}) divides it by {_pow2(choice.factor)} "
        "and leaves the model's function unchanged (bitwise in FP32), every module in FP16 "
        "(see lossscale.choose_rescale for each layer's need)"
    )
