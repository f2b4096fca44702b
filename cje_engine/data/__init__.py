"""Inputs: the canonical frame (`frame`), readers for every format (`io`), off-policy logs (`offpolicy`)."""
