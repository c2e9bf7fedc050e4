"""The Muon family: orthogonalised momentum for the hidden matrices, AdamW for every other weight.

- ``optimizer``: ``Muon`` (the update, Newton–Schulz, which weights are hidden matrices, the AdamW part).
- ``normuon``: ``NorMuon``, Muon's update with each output row normalised by a running second moment of its own.
- ``distributed``: Newton–Schulz for sharded matrices, each made whole on one rank; all of the family's
  communication but NorMuon's row statistics.
"""

from torchtitan.moved import lazy_names

__getattr__ = lazy_names(
    __name__, {"Muon": f"{__name__}.optimizer", "NorMuon": f"{__name__}.normuon"}, former=f"{__name__}.optimizer"
)
