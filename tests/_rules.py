"""Drive a policy's tensor rule on CPU tensors, beside its pure rule (the tests compare the two)."""

from __future__ import annotations

import torch

from lossscale._state import TensorState


class TensorForm:
    """A policy's ``tensor_update`` run on CPU tensors, one iteration per :meth:`step`, both ways the
    scaler calls it:

    * ``t``: every flag a device tensor (the fused-optimizer path, where nothing is synced);
    * ``host``: the flags as the scaler passes them after its sync (optimizers without amp-scaling
      support): ``found_inf`` a host bool, and on a clean step ``found_nan`` and ``bad_loss`` too,
      so the rule folds them (``lossscale.policy.is_set``).

    :meth:`to_state` requires the two to hold the same state, bitwise, and returns it.
    """

    def __init__(self, policy, state=None):
        self.policy = policy
        start = policy.init_state() if state is None else state
        self.t = TensorState(start, torch.device("cpu"))
        self.host = TensorState(start, torch.device("cpu"))

    def step(self, found_inf, found_nan=False, amax=None, bad_loss=None) -> None:
        """One iteration with host flags (as float32 0-dim tensors, torch's convention), an amax, and
        the non-finite-loss flag (None: the scaler does not check the loss)."""
        amax_t = None if amax is None else torch.tensor(amax, dtype=torch.float32)
        inf_t, nan_t = torch.tensor(float(found_inf)), torch.tensor(float(found_nan))
        bad_t = None if bad_loss is None else torch.tensor(bool(bad_loss))
        self.policy.tensor_update(self.t, inf_t, nan_t, amax_t, bad_t)
        skipped = bool(found_inf) or bool(bad_loss)  # the scaler's found_inf includes a bad loss
        if skipped:
            self.policy.tensor_update(self.host, True, nan_t, amax_t, bad_t)
        else:
            self.policy.tensor_update(self.host, False, False, amax_t, None if bad_loss is None else False)

    def to_state(self):
        """The pure state the tensors hold (the same on both paths, or AssertionError)."""
        state = self.t.to_state()
        host = self.host.to_state()
        assert host == state, f"the host-flag path holds {host}, the device-flag path {state}"
        return state
