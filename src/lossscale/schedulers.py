"""Skip-aware LR schedulers and averaged models: advance only on optimizer steps that were taken.

A skipped step did not train, so a schedule that advanced anyway drifts ahead of the weights (a
warmup that ends early, a decay that starts early), and an EMA or SWA average that updated anyway
counts the same weights twice (lerobot gated its EMA by hand). ``scaler.step_scheduler(scheduler)``
fixes the schedule where you call the scheduler yourself. :func:`skip_aware` fixes both where
something else calls ``scheduler.step()`` or ``averaged.update_parameters(model)`` (a framework, a
callback, a library's loop)::

    scheduler = lossscale.schedulers.skip_aware(torch.optim.lr_scheduler.OneCycleLR(...), scaler)
    ema = lossscale.schedulers.skip_aware(torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999), use_buffers=True), scaler)
    ...
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()              # a no-op when scaler skipped this iteration's step
    ema.update_parameters(model)  # likewise: the average, its buffers and n_averaged stay bitwise

``torch.optim.swa_utils.SWALR`` is an LR scheduler like any other. EMAs of the ``update(model)``
kind (timm's ``ModelEmaV2``/``ModelEmaV3``, ultralytics' ``ModelEMA``, any object with an
``update(model, ...)`` method and no ``step()``) work the same way: ``ema.update(model)`` right
after ``scaler.step(optimizer)`` takes effect only on steps that were taken::

    ema = lossscale.schedulers.skip_aware(timm.utils.ModelEmaV3(model, decay=0.999), scaler)
    ...
    scaler.step(optimizer)
    ema.update(model, step=num_updates)   # the EMA's tensors and counters stay bitwise on skips

How: the object keeps its identity, attributes and ``state_dict()``; only its class becomes a
subclass of its own class whose ``step()`` (``update_parameters()``) asks the scaler first. Torch's
``LRScheduler.state_dict()`` dumps the instance's ``__dict__``, so nothing is stored on the instance
(a method patched onto it would land in every checkpoint and break ``torch.load(weights_only=True)``):
the scaler lives on the per-object subclass. The state dict is the plain object's, loadable into a
plain scheduler or ``AveragedModel`` and back; pickling, ``copy.deepcopy`` and ``torch.save`` of the
whole object keep it skip-aware. A pickle carries a copy of the scaler; a deep copy follows the live
scaler (or the scaler's copy, where the same ``copy.deepcopy`` call copied the scaler before it).

Host syncs. Where the host decided the step (optimizers without amp-scaling support: the scaler
synced once already to decide), reading the decision is free: a skipped update returns at once, a
taken one is torch's own ``update_parameters`` (with its own host reads of ``n_averaged``). Fused
optimizers skip on device:

* a skip-aware scheduler's ``step()`` reads ``scaler.last_step_skipped``: one host sync per step with
  one scheduler (the usual case). The accelerate, Trainer and Lightning integrations read it once per
  step.
* a skip-aware ``AveragedModel`` syncs nowhere: ``update_parameters`` gates the update on the device
  flag (:meth:`lossscale.GradScaler.skip_flag`) with ``torch.where``, so the averaged tensors and
  ``n_averaged`` are bitwise what they were when the step was skipped, and the first-update copy that
  torch decides by reading ``n_averaged`` on the host is a device-side choice too. It costs two
  ``where`` per tensor on top of torch's update (measured in docs/integrations.md; the host-decided
  path costs nothing). ``n_averaged`` moves to the averaged parameters' device when wrapped (torch
  keeps it on the default device when ``AveragedModel(device=None)``). Syncs that remain are torch's:
  its default SWA averaging on CUDA (``get_swa_multi_avg_fn`` reads its weight ``1/(n+1)`` on the
  host; the EMA functions and ``get_swa_avg_fn`` do not), and copying the model to an averaged model
  kept on another device. A subclass that overrides ``update_parameters`` gets its own update after
  one sync that reads the flag.
* a skip-aware ``update(model)`` EMA syncs nowhere either, unless it counts its updates on the host:
  its update runs, and one ``where`` per tensor of the EMA's modules (every ``nn.Module`` it is or
  holds: timm's ``module``, ultralytics' ``ema``) keeps a copy taken before it where the step was
  skipped: one copy and one ``where`` per tensor. An EMA whose update moves a host integer (ultralytics'
  ``updates``, which its decay reads on the host) cannot be gated on device: the first update that moves
  one reads the flag (and puts the integer back on a skip), and every later update reads the flag
  first: one host sync per update, the price of a counter that stays right. An EMA that holds no
  module is handled the same way.

Call ``step()`` / ``update_parameters()`` once per optimizer step, after ``scaler.step(optimizer)``:
before or after ``scaler.update()``, it follows this iteration's decision
(:meth:`lossscale.GradScaler.step_was_skipped`) for the scheduler's optimizer, or for the optimizer
given to :func:`skip_aware` with an averaged model (default: the iteration as a whole, skipped when
any optimizer skipped). A scheduler stepped per epoch, or an average updated per epoch, should not
be wrapped: it would skip a whole epoch's update when the epoch's last batch was skipped.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, TypeVar

__all__ = ["skip_aware", "is_skip_aware"]

S = TypeVar("S")


def _check_scaler(scaler) -> None:
    from .scaler import GradScaler

    if not isinstance(scaler, GradScaler):
        raise ValueError(
            f"scaler={scaler!r} must be a lossscale.GradScaler: it knows whether the last step was skipped "
            "(torch's GradScaler does not say; it would cost a scale comparison and a host sync per step)."
        )


def _rebuild(base: type, scaler, state: dict, optimizer=None):
    """Unpickle a skip-aware object: a ``base`` instance with ``state``, made skip-aware again."""
    obj = base.__new__(base)
    _set_state(obj, state)
    return skip_aware(obj, scaler, optimizer=optimizer)


def _set_state(obj, state: dict) -> None:
    setstate = getattr(obj, "__setstate__", None)  # nn.Module's restores its hook dicts
    if setstate is not None:
        setstate(state)
    else:
        obj.__dict__.update(state)


def _step(self, *args: Any, **kwargs: Any):
    """The scheduler's ``step()``, unless this iteration's step of its optimizer was skipped (free
    where the host decided the step, one host sync where a fused optimizer skipped on device)."""
    scaler = type(self)._lossscale_scaler
    # This iteration's decision for the scheduler's optimizer, before or after scaler.update(); free
    # when the host decided the step, one sync when a fused optimizer skipped on device.
    if scaler.is_enabled() and scaler.step_was_skipped(getattr(self, "optimizer", None)):
        return None
    return super(type(self), self).step(*args, **kwargs)


def _update_parameters(self, model) -> None:
    """``AveragedModel.update_parameters(model)`` on steps that were taken; bitwise nothing on skipped
    ones. No host sync of its own: torch's update where the host decided the step, else gated on the
    device flag. A subclass's own update on a device flag costs one sync (the flag's read)."""
    cls = type(self)
    skipped = cls._lossscale_scaler.skip_flag(cls._lossscale_optimizer)  # never syncs
    base_update = cls._lossscale_base.update_parameters
    if isinstance(skipped, bool):  # the host decided the step: torch's own update, or none
        if not skipped:
            base_update(self, model)
        return
    from torch.optim.swa_utils import AveragedModel

    if base_update is not AveragedModel.update_parameters:
        # A subclass's own update cannot be gated on device: read the flag (one sync).
        if not bool(skipped):
            base_update(self, model)
        return
    _gated_update(self, model, skipped)


def _update(self, model, *args: Any, **kwargs: Any):
    """The EMA's ``update(model, ...)`` on steps that were taken; bitwise nothing on skipped ones (its
    tensors and host counters as they were). No host sync where the host decided the step, nor on a
    device flag for an EMA that counts nothing on the host (module docstring)."""
    cls = type(self)
    skipped = cls._lossscale_scaler.skip_flag(cls._lossscale_optimizer)  # never syncs
    base_update = cls._lossscale_base.update
    if not isinstance(skipped, bool):
        tensors = None if cls._lossscale_host_counted else _ema_tensors(self)
        if not tensors:  # counts on the host (or holds no module): read the flag, one sync
            skipped = bool(skipped)
        else:
            return _gated_ema_update(self, base_update, tensors, skipped, model, args, kwargs)
    if not skipped:
        return base_update(self, model, *args, **kwargs)
    return None


def _host_ints(obj) -> Dict[str, int]:
    return {k: v for k, v in vars(obj).items() if type(v) is int}


def _gated_ema_update(ema, base_update, tensors, skipped, model, args, kwargs):
    """``base_update`` run always, its tensors put back on device where ``skipped``; an update that
    moved a host integer (a counter the decay reads) makes the EMA host-counted (module docstring)."""
    import torch

    ints = _host_ints(ema)
    with torch.no_grad():
        kept = [t.detach().clone() for t in tensors]
        out = base_update(ema, model, *args, **kwargs)
        for t, k in zip(tensors, kept):
            t = t.detach()
            torch.where(skipped.to(t.device), k, t, out=t)
    moved = {k: v for k, v in ints.items() if _host_ints(ema).get(k) != v}
    if moved:
        type(ema)._lossscale_host_counted = True
        if bool(skipped):  # one sync, once: this update's counter must not count a skipped step
            vars(ema).update(moved)
    return out


def _ema_tensors(ema):
    """Every parameter and buffer of the modules an ``update(model)`` EMA is or holds (timm's EMAs are
    modules holding ``module``; ultralytics' holds ``ema``), each once."""
    import torch

    modules = (
        [ema] if isinstance(ema, torch.nn.Module) else [v for v in vars(ema).values() if isinstance(v, torch.nn.Module)]
    )
    seen, out = set(), []
    for module in modules:
        for t in module.state_dict(keep_vars=True).values():
            if torch.is_tensor(t) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _deepcopy(self, memo):
    # copy.deepcopy copies the object, not the scaler it asks: the copy follows the live scaler (a frozen
    # copy would never see another skip), or the scaler's copy where the same deepcopy copied the scaler
    # first (copy.deepcopy((scaler, scheduler))). The optimizer of an AveragedModel or an EMA likewise.
    cls = type(self)
    base = cls._lossscale_base
    obj = base.__new__(base)
    memo[id(self)] = obj  # before the state: a state that refers back to the object gets the copy
    _set_state(obj, copy.deepcopy(dict(self.__getstate__()), memo))
    scaler, optimizer = cls._lossscale_scaler, cls._lossscale_optimizer
    return skip_aware(obj, memo.get(id(scaler), scaler), optimizer=memo.get(id(optimizer), optimizer))


def _reduce_ex(self, protocol):
    # The per-object class is not importable by name: pickle as (base class, scaler, state, optimizer).
    cls = type(self)
    return _rebuild, (cls._lossscale_base, cls._lossscale_scaler, dict(self.__getstate__()), cls._lossscale_optimizer)


def skip_aware(obj: S, scaler, *, optimizer=None) -> S:
    """Make ``obj`` hold still on iterations whose optimizer step ``scaler`` skipped.

    ``obj`` is an LR scheduler (its ``step()`` does nothing then), a
    ``torch.optim.swa_utils.AveragedModel`` (its ``update_parameters(model)`` leaves the averaged
    parameters, buffers and ``n_averaged`` bitwise as they were), or an EMA of the ``update(model)``
    kind without a ``step()`` (timm's ``ModelEmaV2``/``ModelEmaV3``, ultralytics' ``ModelEMA``: its
    ``update(model, ...)`` leaves its tensors and host counters bitwise as they were). Returns the same
    object (its class becomes a subclass of its own class; every attribute and ``isinstance`` check stays as it was).
    Works for any ``torch.optim.lr_scheduler`` scheduler, ``ReduceLROnPlateau`` (its ``step(metrics)``
    arguments pass through) and ``SWALR`` included, any object with a ``step()`` method, and any
    ``AveragedModel`` (SWA or EMA; ``avg_fn``, ``multi_avg_fn`` or the default). ``state_dict()`` is
    unchanged and loads into a plain object. Calling it again re-links the object to another scaler.

    Host syncs: none where the host decided the step. With fused optimizers (which skip on device)
    a scheduler's ``step()`` syncs once to read the flag; an ``AveragedModel`` and an ``update(model)``
    EMA do not sync (the update is gated on the device flag), except inside torch's default SWA
    averaging on CUDA, for a subclass that overrides ``update_parameters``, and for an EMA that counts
    its updates on the host (ultralytics' ``updates``: one sync per update; see the module docstring). Wrapping an
    ``AveragedModel`` whose ``n_averaged`` is not on its parameters' device moves it there (a copy,
    once). A disabled scaler never skips.

    Args:
        obj: the LR scheduler, stepped once per optimizer step, or the ``AveragedModel``, updated
            at most once per optimizer step.
        scaler: the ``lossscale.GradScaler`` that steps the optimizer.
        optimizer: with an ``AveragedModel`` or an EMA only: the optimizer whose steps it follows when
            ``scaler`` steps several (a GAN's generator). None: the iteration as a whole (held
            when any optimizer skipped). A scheduler follows its own ``scheduler.optimizer``.
    """
    from torch.optim.swa_utils import AveragedModel

    _check_scaler(scaler)
    averaged = isinstance(obj, AveragedModel)
    ema = not averaged and not callable(getattr(obj, "step", None)) and callable(getattr(obj, "update", None))
    if not averaged and not ema:
        if optimizer is not None:
            raise ValueError(
                f"optimizer={type(optimizer).__name__}(...) is for an AveragedModel or an EMA; a scheduler follows "
                "its own optimizer (scheduler.optimizer): drop the argument."
            )
        if not callable(getattr(obj, "step", None)):
            raise ValueError(
                f"obj={type(obj).__name__}(...) has no step() or update(model) method and is not a "
                "torch.optim.swa_utils.AveragedModel; pass an LR scheduler, an AveragedModel or an EMA."
            )
    if not hasattr(obj, "__dict__"):
        raise ValueError(
            f"obj={obj!r} has no instance __dict__ (__slots__ only); use "
            "scaler.step_scheduler(scheduler) in the training loop instead."
        )
    if averaged:
        _keep_count_with_parameters(obj)
    base = getattr(type(obj), "_lossscale_base", type(obj))
    verb = "update" if averaged or ema else "step"
    method = (
        {"update_parameters": _update_parameters}
        if averaged
        else {"update": _update, "_lossscale_host_counted": getattr(type(obj), "_lossscale_host_counted", False)}
        if ema
        else {"step": _step}
    )
    skip_cls = type(
        f"SkipAware{base.__name__}",
        (base,),
        {
            "__module__": __name__,
            "__doc__": f"{base.__name__} that does not {verb} on iterations the lossscale.GradScaler skipped.",
            "_lossscale_base": base,
            "_lossscale_scaler": scaler,
            "_lossscale_optimizer": optimizer,
            "__reduce_ex__": _reduce_ex,
            "__deepcopy__": _deepcopy,
            **method,
        },
    )
    obj.__class__ = skip_cls
    return obj


def is_skip_aware(obj) -> bool:
    """Whether :func:`skip_aware` was applied to ``obj`` (a scheduler, an ``AveragedModel`` or an EMA)."""
    return "_lossscale_scaler" in type(obj).__dict__


def _keep_count_with_parameters(averaged) -> None:
    """Move ``n_averaged`` to the averaged parameters' device: a gated update on a device flag then
    never copies it to or from the host. ``AveragedModel(model_on_cuda)`` leaves it on the CPU."""
    first = next(iter(averaged.module.parameters()), None)
    if first is not None and averaged.n_averaged.device != first.device:
        averaged.n_averaged = averaged.n_averaged.to(first.device)


def _gated_update(averaged, model, skipped) -> None:
    """``AveragedModel.update_parameters(model)`` without a host read, held where ``skipped``.

    torch (swa_utils.py:294-368) reads ``n_averaged`` on the host twice, to copy the model on the
    first update and to average on the others. Here the averaging always runs, and two where()s per
    tensor decide on device what each tensor ends with: what it was (skipped), the model (a taken
    first update), or the average.
    """
    import itertools

    import torch

    with torch.no_grad():
        count = averaged.n_averaged
        skipped = skipped.to(count.device)  # no-op on one device; device to device otherwise
        taken, first = ~skipped, count == 0
        copy_model = first & taken  # torch copies the model on the first update
        drop_average = first | skipped
        if averaged.use_buffers:
            mine = itertools.chain(averaged.module.parameters(), averaged.module.buffers())
            theirs = itertools.chain(model.parameters(), model.buffers())
        else:
            mine, theirs = averaged.parameters(), model.parameters()
        pairs = [(a.detach(), c.detach().to(a.device)) for a, c in zip(mine, theirs)]
        instead = [torch.where(copy_model.to(a.device), c.to(a.dtype), a) for a, c in pairs]
        _average(averaged, pairs)
        for (a, _), kept in zip(pairs, instead):
            torch.where(drop_average.to(a.device), kept, a, out=a)
        if not averaged.use_buffers:
            # torch keeps unaveraged buffers equal to the model's (swa_utils.py:361-367): on taken steps.
            for b, m in zip(averaged.module.buffers(), model.buffers()):
                torch.where(skipped.to(b.device), b, m.detach().to(b.device, b.dtype), out=b)
        count.add_(taken)


def _average(averaged, pairs) -> None:
    """The averaging branch of ``AveragedModel.update_parameters`` (swa_utils.py:319-358), as torch
    dispatches it: the same functions on the same groups give the same bits."""
    from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _group_tensors_by_device_and_dtype

    count = averaged.n_averaged
    if averaged.avg_fn is not None and averaged.multi_avg_fn is None:
        for a, c in pairs:
            a.copy_(averaged.avg_fn(a, c, count.to(a.device)))
        return
    groups = _group_tensors_by_device_and_dtype([[a for a, _ in pairs], [c for _, c in pairs]])
    for (device, _), ([mine, theirs], _) in groups.items():
        if averaged.multi_avg_fn is not None:
            averaged.multi_avg_fn(mine, theirs, count.to(device))
        elif device is not None and device.type in _get_foreach_kernels_supported_devices():
            get_swa_multi_avg_fn()(mine, theirs, count.to(device))
        else:
            swa = get_swa_avg_fn()
            for a, c in zip(mine, theirs):
                a.copy_(swa(a, c, count.to(device)))
