"""Skip-aware LR schedulers: advance only on optimizer steps that were taken.

A skipped step did not train, so a schedule that advanced anyway drifts ahead of the weights (a
warmup that ends early, a decay that starts early). ``scaler.step_scheduler(scheduler)`` fixes this
where you call the scheduler yourself. :func:`skip_aware` fixes it where something else calls
``scheduler.step()`` (a framework, a callback, a library's loop)::

    scheduler = lossscale.schedulers.skip_aware(torch.optim.lr_scheduler.OneCycleLR(...), scaler)
    ...
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()          # a no-op when scaler skipped this iteration's step

How: the scheduler object keeps its identity, attributes and ``state_dict()``; only its class
becomes a subclass of its own class whose ``step()`` asks the scaler first. Torch's
``LRScheduler.state_dict()`` dumps the instance's ``__dict__``, so nothing is stored on the instance
(a method patched onto it would land in every checkpoint and break ``torch.load(weights_only=True)``):
the scaler lives on the per-scheduler subclass. The state dict is the plain scheduler's, loadable
into a plain scheduler and back.

Host syncs: reading whether the step was skipped is free when the host decided it (optimizers
without amp-scaling support: the scaler synced once already to decide). For fused optimizers, which
skip on device, each ``step()`` of a skip-aware scheduler reads ``scaler.last_step_skipped``: one host
sync per step with one scheduler (the usual case). The accelerate, Trainer and Lightning
integrations read it once per step.

Call ``step()`` once per optimizer step, after ``scaler.step(optimizer)``: before or after
``scaler.update()``, it follows this iteration's decision for its own optimizer
(:meth:`lossscale.GradScaler.step_was_skipped`). A scheduler stepped per epoch
should not be wrapped: it would skip a whole epoch's step when the epoch's last batch was skipped.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["skip_aware", "is_skip_aware"]

S = TypeVar("S")


def _check_scaler(scaler) -> None:
    from .scaler import GradScaler

    if not isinstance(scaler, GradScaler):
        raise ValueError(
            f"scaler={scaler!r} must be a lossscale.GradScaler: it knows whether the last step was skipped "
            "(torch's GradScaler does not say; it would cost a scale comparison and a host sync per step)."
        )


def _rebuild(base: type, scaler, state: dict):
    """Unpickle a skip-aware scheduler: a ``base`` instance with ``state``, made skip-aware again."""
    obj = base.__new__(base)
    obj.__dict__.update(state)
    return skip_aware(obj, scaler)


def _step(self, *args: Any, **kwargs: Any):
    scaler = type(self)._lossscale_scaler
    # This iteration's decision for the scheduler's optimizer, before or after scaler.update(); free
    # when the host decided the step, one sync when a fused optimizer skipped on device.
    if scaler.is_enabled() and scaler.step_was_skipped(getattr(self, "optimizer", None)):
        return None
    return super(type(self), self).step(*args, **kwargs)


def _reduce_ex(self, protocol):
    # The per-scheduler class is not importable by name: pickle as (base class, scaler, state).
    cls = type(self)
    return _rebuild, (cls._lossscale_base, cls._lossscale_scaler, self.__dict__.copy())


def skip_aware(scheduler: S, scaler) -> S:
    """Make ``scheduler.step()`` do nothing on iterations whose optimizer step ``scaler`` skipped.

    Returns the same object (its class becomes a subclass of its own class; every attribute and
    ``isinstance`` check stays as it was). Works for any ``torch.optim.lr_scheduler`` scheduler,
    ``ReduceLROnPlateau`` included (its ``step(metrics)`` arguments pass through), and any object
    with a ``step()`` method. ``scheduler.state_dict()`` is unchanged and loads into a plain
    scheduler. Calling it again re-links the scheduler to another scaler.

    Reading the skip flag is free when the host decided the step, and one host sync per ``step()``
    for fused optimizers (which skip on device). A disabled scaler never skips.

    Args:
        scheduler: the LR scheduler, stepped once per optimizer step.
        scaler: the ``lossscale.GradScaler`` that steps the scheduler's optimizer.
    """
    _check_scaler(scaler)
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ValueError(f"scheduler={scheduler!r} has no step() method; pass an LR scheduler.")
    if not hasattr(scheduler, "__dict__"):
        raise ValueError(f"scheduler={scheduler!r} has no instance __dict__ (__slots__ only); use "
                         "scaler.step_scheduler(scheduler) in the training loop instead.")
    base = getattr(type(scheduler), "_lossscale_base", type(scheduler))
    skip_cls = type(f"SkipAware{base.__name__}", (base,), {
        "__module__": __name__,
        "__doc__": f"{base.__name__} that does not step on iterations the lossscale.GradScaler skipped.",
        "_lossscale_base": base,
        "_lossscale_scaler": scaler,
        "step": _step,
        "__reduce_ex__": _reduce_ex,
    })
    scheduler.__class__ = skip_cls
    return scheduler


def is_skip_aware(scheduler) -> bool:
    """Whether :func:`skip_aware` was applied to ``scheduler``."""
    return "_lossscale_scaler" in type(scheduler).__dict__
