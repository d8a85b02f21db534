"""pivotrl: resource-shiftable RL post-training of LLMs with generative reward models, on Dask.

Importing the package is cheap and needs no GPU package: torch, dask and friends are imported by the
sub-packages that use them, never here.
"""

__version__ = "0.1.0"
