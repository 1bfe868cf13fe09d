"""A small MoE language model trained on the Python standard library's source.

* :mod:`.corpus` — the corpus: every ``.py`` file of this Python's standard library, in a
  fixed order, with a fixed set of files held out for validation;
* :mod:`.tokenizer` — a byte-level BPE tokenizer trained on the training files;
* :mod:`.train` — an OLMoE-architecture model from transformers' own model class, trained
  on one device (``moekit lm train``), saved with safetensors beside its tokenizer;
* :mod:`.bench` — the trained model generating on moekit against transformers' own experts
  (``moekit lm bench``).

Needs the ``hf`` extra (transformers, tokenizers, safetensors).
"""
