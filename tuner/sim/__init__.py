"""The simulator: an SGLang 0.5.23 look-alike with speculative decoding on a virtual clock.

Modules: :mod:`~tuner.sim.profiles` (cost profiles), :mod:`~tuner.sim.workloads` (acceptance and
lengths), :mod:`~tuner.sim.load` (traffic), :mod:`~tuner.sim.engine` (the scheduler),
:mod:`~tuner.sim.oracle` (exact expected goodput), :mod:`~tuner.sim.server` (HTTP),
:mod:`~tuner.sim.worlds` (generated servers and traffic for the bench) with
:mod:`~tuner.sim.acceptance` (non-chain and drifting acceptance).
Import the submodules directly; this package stays import-light.
"""
