"""When is a gradient bucket complete? (seed: "overlap starts all-reducing the last layers' bucket while
backward is still computing earlier layers"; Megatron's overlap_grad_reduce.)

Autograd's post-accumulate-grad hook fires once per backward pass for each parameter, after that pass's
gradient has been added into `.grad`. Only the step's last pass(es) produce the final sum, so the
counting is armed for them: `arm(backwards)` says the next `backwards` passes finish this step (1 for
the loop's last micro-batch; m under pipeline parallel, whose schedule runs each stage's backward once
per micro-batch). A parameter is ready at its `backwards`-th arrival, a bucket when all of its parameters
are, and then `launch(bucket index)` starts that bucket's collective while backward goes on.

Buckets no hook completed (a parameter that got no gradient, a zero-bubble schedule's weight pass,
which assigns `.grad` without autograd's hook) stay with the caller, which launches them after the
backward as before. Every data-parallel rank runs the same graph, so the buckets complete in the same
order on all of them, which is what keeps their collectives matched (DDP's assumption too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class GradReadiness:
    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]], launch: Callable[[int], None]):
        self.launch = launch
        self.bucket_of = {id(p): i for i, params in enumerate(buckets) for p in params}
        self.sizes = [len(params) for params in buckets]
        self.expected = 0  # 0: not armed, gradients only accumulate
        self.arrivals: dict[int, int] = {}
        self.ready = [0] * len(buckets)
        self.launched: set[int] = set()
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for params in buckets for p in params]

    def arm(self, backwards: int) -> None:
        """The next `backwards` backward passes are this step's last for every parameter."""
        if backwards < 1:
            raise ValueError(f"arm: backwards={backwards}, need at least 1")
        self.reset()
        self.expected = backwards

    def reset(self) -> None:
        self.expected = 0
        self.arrivals.clear()
        self.ready = [0] * len(self.sizes)
        self.launched = set()

    def unlaunched(self) -> list[int]:
        return [i for i in range(len(self.sizes)) if i not in self.launched]

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.expected:
            return
        n = self.arrivals.get(id(p), 0) + 1
        self.arrivals[id(p)] = n
        if n > self.expected:  # its bucket already left with the sum of fewer passes
            raise RuntimeError(f"a gradient arrived {n} times after arm({self.expected}): its bucket was already sent")
        if n < self.expected:
            return
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.ready[i] == self.sizes[i]:
            self.launched.add(i)
            self.launch(i)
