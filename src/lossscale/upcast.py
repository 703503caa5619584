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

The modules kept are reported in ``health()`` (``upcast_modules``), in the overflow report of the step
that triggered one (``"upcast"``), counted as ``upcasts`` (``counters()``, ``metrics()``), and saved in
the scaler's checkpoint (``"upcast_modules"``, with the counts so far): loading it keeps those modules
of the scaler's model in FP32 again (a model restored by pickling has them kept already). The scaler
holds its model weakly: a copy of the scaler keeps the account, and upcasts again only once it traces a
model (``copy.deepcopy((model, scaler))``... its tracer rejoins the copied model, and so does this).
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from typing import Any, Dict, List, Optional

from ._features import Feature

__all__ = ["Upcast"]

MODES = ("skip", "upcast")
#: ``upcast_after``'s default: a module named first on this many skipped steps is kept in FP32.
AFTER = 2


class Upcast(Feature):
    """The upcast rule's account: how often each module was the first forward overflow, which were kept."""

    def __init__(self, model, after: int):
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ValueError(f"upcast_after={after!r} must be an int >= 1 (the steps a module must be the first "
                             "forward overflow on before it is kept in FP32).")
        self.after = after
        self._model = weakref.ref(model)
        self.seen: Counter = Counter()
        self.kept: List[str] = []  # in the order they were kept
        self.still = Counter()  # kept modules named first again (not an FP16 range problem)

    @classmethod
    def of(cls, mode: str, after: int, trace: bool, model) -> Optional["Upcast"]:
        """``GradScaler(on_forward_overflow=mode, upcast_after=after)``: None for "skip"; ValueError for
        an unknown mode, or "upcast" without ``trace=True`` (the trace names the module)."""
        if mode not in MODES:
            raise ValueError(f"on_forward_overflow={mode!r} must be one of {MODES}.")
        if mode == "skip":
            if after != AFTER:
                raise ValueError(f"upcast_after={after!r} applies only with on_forward_overflow='upcast'.")
            return None
        if not trace:
            raise ValueError("on_forward_overflow='upcast' needs trace=True (and model=): the trace names the "
                             "module whose forward overflowed.")
        return cls(model, after)

    def learn(self, state, evidence: Optional[Dict[str, Any]], tracer) -> None:
        """One landed state: on a skipped step, read the trace's first forward overflow (a sync) and keep
        the module in FP32 once it is named ``after`` times."""
        if not state.last_step_skipped or not evidence or evidence.get("trace") is None:
            return
        name = tracer.names_of(evidence["trace"])["forward"]
        if name is None:
            return
        if name in self.kept:
            self.still[name] += 1
            if self.still[name] == 1:
                warnings.warn(f"lossscale: `{name}` runs in FP32 (on_forward_overflow='upcast') and its forward "
                              "output was non-finite again: not an FP16 range problem (the data, or a bug). "
                              "lossscale.audit() on the batch tells more.", RuntimeWarning, stacklevel=5)
            return
        self.seen[name] += 1
        if self.seen[name] >= self.after and self._keep([name]):
            evidence["upcast"] = name
            warnings.warn(f"lossscale: `{name}` was the first forward overflow on {self.seen[name]} steps; it now "
                          "runs in FP32 (on_forward_overflow='upcast'). Its inputs are cast to float32 and its "
                          "output stays float32.", UserWarning, stacklevel=5)

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
        """``upcasts``: the modules kept in FP32 so far."""
        return {"upcasts": len(self.kept)}

    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entry: the modules kept, and how often each module was named."""
        return {"upcast_modules": list(self.kept), "upcast_seen": dict(self.seen)}

    def loadable(self, state_dict: Dict[str, Any]):
        """The checkpoint's modules and counts, validated against the model (None when absent)."""
        kept, seen = state_dict.get("upcast_modules"), state_dict.get("upcast_seen", {})
        if kept is None:
            return None
        if not isinstance(kept, list) or not all(isinstance(n, str) for n in kept):
            raise ValueError(f"state dict 'upcast_modules'={kept!r} must be a list of module names.")
        if not isinstance(seen, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                 and v >= 0 for k, v in seen.items()):
            raise ValueError(f"state dict 'upcast_seen'={seen!r} must map module names to counts >= 0.")
        model = self._model()
        if model is not None:
            from .fp32 import _resolve

            _resolve(model, kept)  # ValueError naming a module this model does not have
        return kept, seen

    def load(self, value) -> None:
        """Take what :meth:`loadable` returned: those modules of the model are kept in FP32 again."""
        if value is not None:
            kept, seen = value
            self.kept, self.seen, self.still = [], Counter(seen), Counter()
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
