"""RaMP: routing-aware choice of the fused MoE kernel's configuration.

* :mod:`~moekit.ramp.regions` -- what a configuration launches for an expert histogram (the
  CTA grid of Eq. 1), the four region variables and the predicted modes of a shape;
* :mod:`~moekit.ramp.costmodel` -- the wave cost model, its least-squares fit and regret;
* :mod:`~moekit.bench.ramp_profile` -- timing every configuration at 25 points and writing a model file;
* :mod:`~moekit.ramp.select` -- choosing the configuration from the live histogram at run time.

See docs/ramp.md.
"""
