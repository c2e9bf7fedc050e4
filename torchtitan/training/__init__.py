"""One training step and what guards it, shared by ``train.py``, ``estimation.py`` and the tests.

- ``step``: the model a job trains, one optimizer step (forward, loss, backward, clip, guard, update), the loop's
  position (``TrainState``).
- ``loss``: the cross-entropy, whole or over chunks of tokens.
- ``lr_scheduling``: warmup, stable phase and decay, as one ``LambdaLR`` per optimizer.
- ``guard``: the divergence guard (a non-finite step does not update; a run that keeps diverging stops).
- ``validate``: the held-out loss and its perplexity.
- ``preemption``: a scheduler's signal honoured (finish the step, save, exit with its own code).
- ``garbage_collection``: Python's collector at the same steps on every rank.

``torchtitan.training`` was one module before it became this package: a name it held fails with one line naming
its new home.
"""

from torchtitan.moved import lazy_names

__getattr__ = lazy_names(__name__, {}, former=f"{__name__}.step")
