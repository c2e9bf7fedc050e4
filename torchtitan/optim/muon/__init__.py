"""The Muon family: orthogonalised momentum for the hidden matrices, AdamW for every other weight.

- ``optimizer``: ``Muon`` (the update, Newton–Schulz, which weights are hidden matrices, the AdamW part).
- ``distributed``: Newton–Schulz for sharded matrices, each made whole on one rank; all of Muon's communication.
"""

from torchtitan.optim import lazy_names

__getattr__ = lazy_names(__name__, {"Muon": f"{__name__}.optimizer"}, former=f"{__name__}.optimizer")
