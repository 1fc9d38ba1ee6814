"""Sensitivity runs that share the layers before the one they change (``kvq tune``).

A sensitivity run stores one tensor of one layer in a candidate format and every other layer in
the model dtype, exactly as the baseline run does; the layers before the changed one therefore
compute, call for call, what the baseline computed.  :class:`LayerTap` records the input of every
layer (hidden state and residual) in each forward call of the baseline run, and a run that
changes layer ``i`` starts each call at layer ``i`` from the recorded input instead of running
the embedding and layers ``0 .. i-1`` again: the same numbers (the layers before ``i`` write
only their own caches, which no later layer reads), at about half the work on average over the
layers.  Each call checks that it feeds the recorded call's tokens and positions, so a run whose
steps differ from the baseline's fails loudly instead of mixing inputs.

The recording lives on the CPU: a layer's input is ``2 x tokens x hidden`` values a call (the
default model at 288 tokens in bfloat16: 0.6 MB a layer; Llama-3-8B at 4096 tokens: 64 MB a layer,
twice that in float32, ``kvq tune``'s default).  Past :data:`MAX_BYTES` a recording is dropped
(:attr:`LayerTap.dropped`) and the runs go through every layer, as before the tap.
"""

from __future__ import annotations

import torch

#: The most bytes a recording may hold (host memory); past it the tap records nothing.
MAX_BYTES = 16 << 30


class LayerTap:
    """Records layer inputs (:meth:`record`) or starts calls at a recorded layer (:meth:`resume`); set it
    as the model's ``tap`` for the run (kvq.models.llama.LlamaForCausalLM.forward calls it)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # (ids, positions, {layer: (x, res)})
        self.at: int | None = None  # None: recording
        self._next = 0
        self.max_bytes, self.nbytes, self.dropped = MAX_BYTES if max_bytes is None else max_bytes, 0, False

    def record(self) -> None:
        """Record the next run's calls (the baseline), forgetting any earlier recording."""
        self.calls, self.at, self._next, self.nbytes, self.dropped = [], None, 0, 0, False

    def resume(self, layer: int) -> None:
        """Start each call of the next run at ``layer``, from the recording's call of the same index."""
        if not self.calls:
            raise RuntimeError("nothing recorded: run the baseline with record() first")
        self.at, self._next = layer, 0

    def enter(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """-> (first layer to run, its hidden state, its residual); (0, None, None): from the embedding."""
        ids, pos = input_ids.detach().cpu(), positions.detach().cpu()
        if self.at is None:
            if self.dropped:
                return 0, None, None
            self.calls.append((ids.clone(), pos.clone(), {}))
            return 0, None, None
        if self._next >= len(self.calls):
            raise RuntimeError(f"call {self._next} of a resumed run: the recorded run made {len(self.calls)}")
        want_ids, want_pos, saved = self.calls[self._next]
        if not (torch.equal(ids, want_ids) and torch.equal(pos, want_pos)):
            raise RuntimeError(f"call {self._next} of a resumed run feeds other tokens or positions than the "
                               "recorded run's: its steps differ")
        self._next += 1
        if self.at == 0:
            return 0, None, None
        x, residual = saved[self.at]
        dev = input_ids.device
        return self.at, x.to(dev, copy=True), None if residual is None else residual.to(dev, copy=True)

    def pending(self) -> int:
        """Recorded calls a resumed run has not made yet."""
        return 0 if self.at is None else len(self.calls) - self._next

    def layer_input(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        if self.at is None and layer > 0 and not self.dropped:  # (layer 0's input: the embedding, recomputed)
            self.nbytes += x.numel() * x.element_size() * (1 if residual is None else 2)
            if self.nbytes > self.max_bytes:  # too large to keep: every run goes through every layer
                self.calls, self.dropped = [], True
                return
            self.calls[-1][2][layer] = (x.detach().to("cpu", copy=True),
                                        None if residual is None else residual.detach().to("cpu", copy=True))
