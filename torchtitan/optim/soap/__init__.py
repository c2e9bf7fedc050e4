"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner for the hidden matrices, AdamW for every other weight.

- ``update``: the math of one whole matrix, as functions (statistics, eigenbases, projections, the step).
- ``optimizer``: ``SOAP``, the optimizer; sharded matrices go whole to one owning rank through Muon's owner rounds
  (``muon.distributed``), which keeps their state.
"""

from torchtitan.moved import lazy_names

__getattr__ = lazy_names(__name__, {"SOAP": f"{__name__}.optimizer"})
