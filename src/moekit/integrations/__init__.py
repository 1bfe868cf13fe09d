"""Bridges between moekit and other libraries.

* :mod:`moekit.integrations.transformers` — run Hugging Face ``transformers`` MoE models on
  moekit's experts and dispatchers (``pip install 'moekit[hf]'``);
* :mod:`moekit.integrations.lm` — a small MoE language model trained on the Python standard
  library's source, with a tokenizer trained on the same text (the ``moekit lm`` commands);
* :mod:`moekit.integrations.recording` — routing traces of a transformers model, recorded
  through the integration (``moekit trace record``);
* :mod:`moekit.integrations.trace_report` — what moekit's planners make of any trace:
  per-layer skew, the Cap-and-Spill quantile table, EPLB against the padding-aware balancer
  (``moekit trace report``).

Nothing here is imported by ``import moekit``: the optional libraries load only when one of
these modules is imported.
"""
