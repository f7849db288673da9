"""Generative reward models (GenRM): an LM reads each response and its verdict becomes the reward.

Words: **GenRM** is the kind of reward (`reward.kind: genrm | genrm_with_rule`) and the device role that
serves it (`genrm` in the placement, its engines `genrm-<judge>`, metrics `genrm/...`); a **judge** is one
configured GenRM model (`reward.judges[]`, `Judge`): its template, verdict parser and engine.
"""
