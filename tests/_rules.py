"""Drive a policy's tensor rule on CPU tensors, beside its pure rule (the tests compare the two)."""

from __future__ import annotations

import torch

from lossscale._state import TensorState


class TensorForm:
    """A policy's ``tensor_update`` run on a :class:`TensorState` on CPU, one iteration per :meth:`step`."""

    def __init__(self, policy, state=None):
        self.policy = policy
        self.t = TensorState(policy.init_state() if state is None else state, torch.device("cpu"))

    def step(self, found_inf, found_nan=False, amax=None, bad_loss=None) -> None:
        """One iteration with host flags (as float32 0-dim tensors, torch's convention), an amax, and
        the non-finite-loss flag (None: the scaler does not check the loss)."""
        self.policy.tensor_update(self.t, torch.tensor(float(found_inf)), torch.tensor(float(found_nan)),
                                  None if amax is None else torch.tensor(amax, dtype=torch.float32),
                                  None if bad_loss is None else torch.tensor(bool(bad_loss)))

    def to_state(self):
        """The pure state the tensors hold."""
        return self.t.to_state()
