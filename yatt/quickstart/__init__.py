"""Tooling of the quickstarts, not of the library: the 3-digit addition data, the tiny judge's training rows,
and the SFT that builds the tiny policy and judge (`launch/sft.py`)."""
