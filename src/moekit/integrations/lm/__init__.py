"""A small MoE language model trained on the Python standard library's source.

* :mod:`.corpus` — the corpus: every ``.py`` file of this Python's standard library, in a
  fixed order, with a fixed set of files held out for validation;
* :mod:`.tokenizer` — a byte-level BPE tokenizer trained on the training files;
* :mod:`.train` — an OLMoE-architecture model from transformers' own model class, trained
  on one device (``moekit lm train``), saved with safetensors beside its tokenizer;
* :mod:`.bench` — the trained model generating on moekit against transformers' own experts
  (``moekit lm bench``);
* :mod:`.seeded` / :mod:`.parallel` — models at real dimensions with per-tensor random weights,
  built for one rank of several with only that rank's experts (:func:`build_expert_parallel`);
* :mod:`.serve` — serving on several GPUs, moekit's expert parallelism against transformers'
  own multi-GPU options (``moekit lm serve-bench``).

Needs the ``hf`` extra (transformers, tokenizers, safetensors).
"""

from moekit.integrations.lm.parallel import build_expert_parallel, generate_tokens, local_expert_count  # noqa: E402
from moekit.integrations.lm.seeded import ExpertShard, seeded_model  # noqa: E402

__all__ = ["ExpertShard", "build_expert_parallel", "generate_tokens", "local_expert_count", "seeded_model"]
