"""``mm-balance timeline``: one global batch of a run's per-pack timings, rank by rank.

:mod:`.records` reads a timing directory into :mod:`.layout`'s arrays (pure numpy: the
phases of every rank's micro-steps, the waiting, the rows drawn); :mod:`.draw` draws
them (PNG and SVG); :mod:`.cli` is the command.
"""
