"""The refusal to store NaN/inf keys or values (fp16 overflow), without a host read at every decode step.

A multi-token step (a prompt) is checked at once; a decode step only folds its check into a flag on the device,
read every `FINITE_CHECK_EVERY` steps and when the cache is saved: reading a value on the host at every step of
every layer stalls a GPU's launch queue, and a non-finite decode step shows in that step's logits anyway.
"""

from __future__ import annotations

import torch

NON_FINITE = (
    "the model produced NaN or inf keys/values (fp16 overflow?); the cache refuses to store them, and its earlier "
    "layers already hold this step (and, for a decode step, up to {every} steps before it: decode steps are checked "
    "in batches): call cache.reset() before reusing it"
)
# Decode steps between two host reads of the deferred NaN/inf check (see FiniteCheck.check).
FINITE_CHECK_EVERY = 64
NON_FINITE = NON_FINITE.format(every=FINITE_CHECK_EVERY)


def all_finite(*states: torch.Tensor) -> torch.Tensor:
    """Whether every element of `states` is finite, as a device bool: the extremes are finite exactly when every
    element is (aminmax propagates NaN, and an inf is an extreme). One pass per tensor, about a tenth of
    `isfinite().all()` on CPU, and five ops for a decode step's keys and values together."""
    extremes = [extreme for s in states if s.numel() for extreme in torch.aminmax(s)]
    if not extremes:
        return torch.ones((), dtype=torch.bool, device=states[0].device)
    return torch.stack(extremes).isfinite().all()


class FiniteCheck:
    """A layer's NaN/inf check: `finite`, the device flag of the decode steps since the last read, and
    `unchecked_steps`, their number."""

    def __init__(self) -> None:
        self.finite: torch.Tensor | None = None
        self.unchecked_steps = 0

    def check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse NaN/inf states: a prompt at once, decode steps every `FINITE_CHECK_EVERY` steps (see above)."""
        if key_states.element_size() == 1:  # float8 states: no inf, and NaN checks are not implemented for them
            return
        finite = all_finite(key_states, value_states)
        if key_states.shape[-2] == 1:
            self.finite = finite if self.finite is None else self.finite & finite
            self.unchecked_steps += 1
            if self.unchecked_steps < FINITE_CHECK_EVERY:
                return
            finite, self.finite = self.finite, None
        self.unchecked_steps = 0
        if not bool(finite):
            raise ValueError(NON_FINITE)

    def flush(self) -> None:
        """Read the deferred decode-step check now."""
        if self.finite is not None:
            finite, self.finite, self.unchecked_steps = self.finite, None, 0
            if not bool(finite):
                raise ValueError(NON_FINITE)

    def nbytes(self) -> int:
        """The device flag's bytes (it lives on the layer's device, so it counts as the layer's)."""
        return 0 if self.finite is None else self.finite.numel() * self.finite.element_size()
