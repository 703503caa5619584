"""``GradScaler(trace=True, on_forward_overflow="upcast")``: a module whose FP16 forward keeps overflowing
is kept in FP32 by the scaler itself.

A forward overflow is the one failure no loss scale can fix: the scale only touches the backward. With
``trace=True`` the scaler already knows, on a skipped step, the first module whose forward output was
non-finite. The rule, run on each step's state as it reaches the host (``update()``; no sync on a
clean step)::

    the step was skipped (the state says so: no read)
        -> name = the trace's first forward overflow (one host read, on skipped steps only);
           none (a backward overflow, the scale's business) -> nothing
        name already kept in FP32   -> counted as "still overflows": not an FP16 range problem
                                       (a NaN in the data, a bug); the module stays kept, said once
        else seen[name] += 1
             seen[name] == upcast_after (default 2)
                -> lossscale.keep_fp32(model, [name]): from the next forward on it runs in FP32
                   (its inputs cast to float32, its output float32); a UserWarning says so once

Why two steps, by default: one bad batch names whatever module its bad values reached first, and
upcasting on it would slow a healthy model for nothing; a module named first on two steps is the
systematic overflow unsloth-zoo PR #600 and #866 found by hand. ``upcast_after=1`` acts at once.

``on_backward_overflow="upcast"``: the backward that overflows at any scale. A module whose backward
overflows FP16 while its forward stays finite (an internal gradient past 65504) is the scale's business
until the scale reaches 1, or its floor (``min_scale``) where that is higher. Below 1 the scale only
shrinks every gradient, flushing the small ones, to fit the large one: the backoff may go on there (as
torch's does, down to the default floor 2**-24), but the overflow is the module's::

    the step was skipped at a scale <= max(1, min_scale), its forward clean
        -> name = the trace's first backward overflow: the first module, in backward order, whose input
           gradient was non-finite (one host read, on such steps only); none -> nothing (a weight
           gradient that overflows names no module: the backoff goes on down to min_scale, and the
           stuck warning says what to do there)
        name not kept: seen_backward[name] += 1; at upcast_after -> keep_fp32(model, [name]), warned
        name kept already (for its backward) -> its FP32 backward did not end it: the gradient overflows
           again where it is cast back to FP16 at the module's edge (its input is FP16). Widen at once
           to the enclosing module (keep_fp32 on the parent), warned; the whole model -> said, nothing kept

With ``min_scale=None`` (torch's unbounded backoff, asked for by name) nothing is upcast for the
backward: the scale backs off below 1 as torch's does, step for step.

The modules kept are reported in ``health()`` (``upcast_modules``), in the overflow report of the step
that triggered one (``"upcast"``), counted as ``upcasts`` (``counters()``, ``metrics()``), and saved in
the scaler's checkpoint (``"upcast_modules"``, with the counts so far): loading it keeps those modules
of the scaler's model in FP32 again (a model restored by pickling has them kept already). The scaler
holds its model weakly: a copy of the scaler keeps the account, and upcasts again only once it traces a
model (``copy.deepcopy((model, scaler))``... its tracer rejoins the copied model, and so does this).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Dict, List, Optional

from ._features import Feature
from ._warnings import warn

__all__ = ["Upcast"]

MODES = ("skip", "upcast")
#: ``upcast_after``'s default: a module named first on this many skipped steps is kept in FP32.
AFTER = 2


class Upcast(Feature):
    """The upcast rules' account: how often each module was the first forward (or, at a scale of 1 or
    below, backward) overflow, which were kept, and which of them for their backward."""

    def __init__(self, model, after: int, forward: bool = True, backward: bool = False):
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ValueError(
                f"upcast_after={after!r} must be an int >= 1 (the steps a module must be the first "
                "forward overflow on before it is kept in FP32)."
            )
        self.after = after
        self.forward, self.backward = forward, backward  # which rules are on
        self._model = weakref.ref(model)
        self.seen: Counter = Counter()
        self.kept: List[str] = []  # in the order they were kept
        self.still = Counter()  # kept modules named first again (not an FP16 range problem)
        self.seen_backward: Counter = Counter()  # first backward overflow at a scale <= max(1, floor)
        self.kept_backward: List[str] = []  # the kept modules kept for their backward (also in kept)
        self.widest = False  # the backward rule reached the whole model: said once, nothing more to widen

    @classmethod
    def of(cls, mode: str, after: int, trace: bool, model, backward: str = "skip") -> Optional["Upcast"]:
        """``GradScaler(on_forward_overflow=mode, upcast_after=after, on_backward_overflow=backward)``:
        None when both are "skip"; ValueError for an unknown mode, or "upcast" without ``trace=True``
        (the trace names the module)."""
        for key, value in (("on_forward_overflow", mode), ("on_backward_overflow", backward)):
            if value not in MODES:
                raise ValueError(f"{key}={value!r} must be one of {MODES}.")
        if mode == backward == "skip":
            if after != AFTER:
                raise ValueError(
                    f"upcast_after={after!r} applies only with on_forward_overflow='upcast' or "
                    "on_backward_overflow='upcast'."
                )
            return None
        if not trace:
            key = "on_forward_overflow" if mode == "upcast" else "on_backward_overflow"
            raise ValueError(
                f"{key}='upcast' needs trace=True (and model=): the trace names the module whose "
                f"{key.split('_')[1]} overflowed."
            )
        return cls(model, after, forward=mode == "upcast", backward=backward == "upcast")

    def learn(self, state, evidence: Optional[Dict[str, Any]], tracer, past_scale: bool = False) -> None:
        """One landed state: on a skipped step, read the trace's first forward overflow (a sync) and keep
        the module in FP32 once it is named ``after`` times; with the backward rule and ``past_scale`` (the
        step ran at a scale of 1 or below, or at the floor where that is higher: no scale fixes its
        backward), the same for the first backward overflow, widening to the enclosing module when a
        module kept for its backward is named again."""
        if not state.last_step_skipped or not evidence or evidence.get("trace") is None:
            return
        names = tracer.names_of(evidence["trace"])
        name = names["forward"]
        if name is None:
            if self.backward and past_scale and names["backward"] is not None:
                self._learn_backward(names["backward"], evidence)
            return
        if not self.forward:
            return
        if name in self.kept:
            self.still[name] += 1
            if self.still[name] == 1:
                warn(
                    f"lossscale: `{name}` runs in FP32 (on_forward_overflow='upcast') and its forward "
                    "output was non-finite again: not an FP16 range problem (the data, or a bug). "
                    "lossscale.audit() on the batch tells more.",
                    RuntimeWarning,
                )
            return
        self.seen[name] += 1
        if self.seen[name] >= self.after and self._keep([name]):
            evidence["upcast"] = name
            warn(
                f"lossscale: `{name}` was the first forward overflow on {self.seen[name]} steps; it now "
                "runs in FP32 (on_forward_overflow='upcast'). Its inputs are cast to float32 and its "
                "output stays float32.",
                UserWarning,
            )

    def _learn_backward(self, name: str, evidence: Dict[str, Any]) -> None:
        """The backward rule for a step skipped past the scale (see :meth:`learn`) whose first backward
        overflow was ``name``."""
        kept_as = self._kept_ancestor(name)
        if kept_as is not None:  # it, or a module around it, runs in FP32 already: not enough
            self._widen(kept_as, evidence)
            return
        self.seen_backward[name] += 1
        if self.seen_backward[name] >= self.after and self._keep([name]):
            self.kept_backward.append(name)
            evidence["upcast"] = name
            warn(
                f"lossscale: the backward of `{name}` overflowed FP16 with the scale at 1 or below (or at "
                f"its floor) on {self.seen_backward[name]} steps (its forward finite); it now runs in FP32 "
                "(on_backward_overflow='upcast').",
                UserWarning,
            )

    def _kept_ancestor(self, name: str) -> Optional[str]:
        """The outermost kept module that is ``name`` or encloses it (the trace names leaves: the first
        leaf of a kept module is named when the overflow is at that module's edge), or None."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) in self.kept:
                return ".".join(parts[:i])
        return None

    def _widen(self, name: str, evidence: Dict[str, Any]) -> None:
        """``name`` runs in FP32 and its backward still overflows: the gradient is cast back to FP16 at
        its edge. Keep its enclosing module in FP32 (at once: the evidence is the module's own)."""
        parent = name.rpartition(".")[0]
        if not parent:  # a top-level module: the next one out is the whole model, FP32 training
            if not self.widest:
                self.widest = True
                warn(
                    f"lossscale: `{name}` runs in FP32 (on_backward_overflow='upcast') and its backward "
                    "still overflows FP16 where its input gradient is cast back; no enclosing module "
                    "is left to keep in FP32 but the whole model. The scale backs off below 1 down to "
                    "its floor, min_scale: keep that at the default, GradScaler(min_scale=2**-24), or "
                    "None for torch's unbounded backoff, so it can reach a scale where the backward fits.",
                    RuntimeWarning,
                )
            return
        if self._keep([parent]):
            self.kept_backward.append(parent)
            evidence["upcast"] = parent
            warn(
                f"lossscale: `{name}` runs in FP32 (on_backward_overflow='upcast') and its backward still "
                f"overflowed FP16 where its gradient is cast back at its edge; its enclosing module "
                f"`{parent}` now runs in FP32.",
                UserWarning,
            )

    def _keep(self, names: List[str]) -> bool:
        """Keep ``names`` of the model in FP32 (those not kept yet); False without a model."""
        from .fp32 import keep_fp32, kept_modules

        model = self._model()
        if model is None:
            return False
        already = set(kept_modules(model))
        keep_fp32(model, [n for n in names if n not in already])
        self.kept.extend(n for n in names if n not in self.kept)
        return True

    # The scaler's opt-in feature protocol (lossscale._features.Feature).
    def counts(self) -> Dict[str, int]:
        """``upcasts``: the modules kept in FP32 so far (for their forward or their backward)."""
        return {"upcasts": len(self.kept)}

    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entries: the modules kept, and how often each module was named; with the
        backward rule, which of them were kept for their backward and its counts."""
        out = {"upcast_modules": list(self.kept), "upcast_seen": dict(self.seen)}
        if self.backward:
            out.update(upcast_backward=list(self.kept_backward), upcast_backward_seen=dict(self.seen_backward))
        return out

    def loadable(self, state_dict: Dict[str, Any]):
        """The checkpoint's modules and counts, validated against the model (None when absent)."""
        kept, seen = state_dict.get("upcast_modules"), state_dict.get("upcast_seen", {})
        if kept is None:
            return None
        backward = state_dict.get("upcast_backward", [])
        backward_seen = state_dict.get("upcast_backward_seen", {})
        for key, names in (("upcast_modules", kept), ("upcast_backward", backward)):
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"state dict '{key}'={names!r} must be a list of module names.")
        if not set(backward) <= set(kept):
            raise ValueError(f"state dict 'upcast_backward'={backward!r} must be among 'upcast_modules'={kept!r}.")
        for key, counts in (("upcast_seen", seen), ("upcast_backward_seen", backward_seen)):
            if not isinstance(counts, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in counts.items()
            ):
                raise ValueError(f"state dict '{key}'={counts!r} must map module names to counts >= 0.")
        model = self._model()
        if model is not None:
            from .fp32 import _resolve

            _resolve(model, kept)  # ValueError naming a module this model does not have
        return kept, seen, backward, backward_seen

    def load(self, value) -> None:
        """Take what :meth:`loadable` returned: those modules of the model are kept in FP32 again."""
        if value is not None:
            kept, seen, backward, backward_seen = value
            self.kept, self.seen, self.still = [], Counter(seen), Counter()
            self.kept_backward, self.seen_backward, self.widest = list(backward), Counter(backward_seen), False
            if kept and not self._keep(kept):
                self.kept = list(kept)

    def __getstate__(self):  # the model is held weakly: a copy keeps the account, not the model
        state = self.__dict__.copy()
        state["_model"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if self._model is None:
            self._model = lambda: None
