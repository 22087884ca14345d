"""Observations produced by a pass the engine runs after the prefill, not by the forward's recorders:
KVzip's context reconstruction (`reconstruction.Reconstruction`) and LookaheadKV's learned tokens
(`lookahead.LookaheadTokens`). Each is an `kvjax.observations.Observation` with `producer = True`; the
engine runs `produce` once per (observation, policy inputs) in one loop that names neither.

They run the model (`extend`), so they sit above `kvjax.models` (and `kvjax.lookahead`), while the
recorders of `kvjax.observations` sit below it; a policy imports the pass it asks for.
"""
