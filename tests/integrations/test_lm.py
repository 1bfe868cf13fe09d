"""The LM recipe on the CPU at its tiny size: corpus split, tokenizer, a few training steps,
the saved model and tokenizer, and `moekit trace record` / `trace report` on the result."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from moekit.cli import main  # noqa: E402
from moekit.integrations.lm import corpus  # noqa: E402
from moekit.integrations.lm.bench import agreement  # noqa: E402
from moekit.integrations.lm.tokenizer import END_OF_TEXT, encode_files, train_tokenizer  # noqa: E402
from moekit.integrations.lm.train import PRESETS, config_with, lr_at  # noqa: E402
from moekit.routing import RoutingTrace  # noqa: E402


def _fake_stdlib(root):
    for rel in ["a.py", "pkg/b.py", "pkg/sub/c.py", "site-packages/x/y.py", "notes.txt", "z.py"]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {rel}\ndef f_{len(rel)}(x):\n    return x + {len(rel)}\n")
    (root / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # invalid UTF-8 is read with replacement
    return root


def test_corpus_files_order_and_split(tmp_path):
    root = _fake_stdlib(tmp_path)
    files = corpus.list_files(root)
    assert files == ["a.py", "bad.py", "pkg/b.py", "pkg/sub/c.py", "z.py"]  # sorted, no site-packages, .py only
    train, held = corpus.split(root, holdout_every=2)
    assert set(train.files) | set(held.files) == set(files) and not set(train.files) & set(held.files)
    import zlib

    assert [f for f in files if zlib.crc32(f.encode()) % 2 == 0] == list(held.files)
    assert "\ufffd" in "".join(corpus.Corpus(root, ("bad.py",)).texts())
    info = corpus.describe(train, held)
    assert info["train_files"] + info["held_out_files"] == 5 and len(info["file_list_sha256"]) == 64


def test_corpus_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="holdout_every must be an int >= 2"):
        corpus.split(tmp_path, holdout_every=1)
    with pytest.raises(ValueError, match="holds no .py files"):
        corpus.list_files(tmp_path)


def test_stdlib_split_is_stable():
    train, held = corpus.split()
    assert len(held.files) > 5 and len(train.files) > 20 * len(held.files)
    assert corpus.split() == (train, held)


def test_tokenizer_round_trip():
    texts = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n"] * 50
    tok = train_tokenizer(iter(texts), 300)
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(END_OF_TEXT) is not None
    source = "def add_up(values):  # ünïcode\n    return sum(values)\n"
    assert tok.decode(tok.encode(source).ids) == source  # byte-level: any text survives
    stream = encode_files(tok, texts[:2])
    assert stream.dtype == np.uint16 and (stream == tok.token_to_id(END_OF_TEXT)).sum() == 2
    with pytest.raises(ValueError, match="vocab_size must be an int in"):
        train_tokenizer(iter(texts), 100)


def test_learning_rate_schedule():
    cfg = config_with("tiny", lr=1e-3)
    assert lr_at(0, 10, cfg) == pytest.approx(5e-4)  # warm-up over 2 steps
    assert lr_at(1, 10, cfg) == pytest.approx(1e-3)
    assert lr_at(2, 10, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(10, 10, cfg) == pytest.approx(1e-4)  # and ends at min_lr_ratio * lr
    with pytest.raises(ValueError, match="top_k must be in"):
        config_with("tiny", top_k=9)
    with pytest.raises(ValueError, match="preset must be one of"):
        config_with("huge")


def test_agreement():
    want = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    got = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    a = agreement(got, want)
    assert a["prefix_share"] == pytest.approx((2 / 4 + 1) / 2)
    assert a["identical_sequences"] == 0.5 and a["position_share"] == pytest.approx(7 / 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    assert main(["lm", "train", "--preset", "tiny", "--steps", "6", "--out", str(out), "--device", "cpu"]) == 0
    return out


def test_train_tiny_learns_and_saves(trained):
    record = json.loads((trained / "train.json").read_text())
    assert record["steps"] == 6 and record["config"]["experts"] == PRESETS["tiny"].experts
    assert math.isfinite(record["held_out_loss"])
    assert record["held_out_loss"] < record["held_out_loss_initial"] - 0.05  # six steps already learn something
    assert (trained / "model.safetensors").is_file() and (trained / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    assert type(model).__name__ == "OlmoeForCausalLM" and model.config.num_experts == 8
    assert tok.decode(tok("import os\n")["input_ids"]) == "import os\n"
    prompts = (trained / "heldout_prompts.jsonl").read_text().splitlines()
    assert len(prompts) == record["prompts_written"] > 0


def test_trace_record_and_report(trained, tmp_path, capsys):
    out = tmp_path / "trace.npz"
    args = ["trace", "record", "--model", str(trained), "--prompts", str(trained / "heldout_prompts.jsonl"),
            "--out", str(out), "--batch-size", "2", "--prompt-tokens", "16", "--decode-steps", "3",
            "--world-size", "2", "--max-batches", "3", "--weights"]
    assert main(args) == 0
    prefill, decode = RoutingTrace.load(out), RoutingTrace.load(tmp_path / "trace.decode.npz")
    assert prefill.topk_ids.shape == (3, 2, 32, 2) and decode.topk_ids.shape == (9, 2, 2, 2)
    assert (prefill.topk_ids >= 0).all() and (decode.topk_ids >= 0).all()  # no padding at these sizes
    assert prefill.topk_ids.dtype == np.int16 and prefill.topk_weights is not None
    assert prefill.metadata["phase"] == "prefill" and decode.metadata["tokens_per_step"] == 2
    assert not np.allclose(prefill.topk_weights.sum(-1), 1.0, atol=1e-5)  # OLMoE: no renormalization
    capsys.readouterr()
    assert main(["trace", "report", str(out), "--world-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "Cap-and-Spill on P = 2 ranks" in text and "padding-aware" in text
    assert main(["trace", "stats", str(tmp_path / "trace.decode.npz"), "--world-size", "2"]) == 0


def test_trace_record_errors(tmp_path, capsys):
    assert main(["trace", "record", "--model", str(tmp_path), "--prompts", "p.txt", "--out", "t.npz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a saved transformers model folder" in err[0]


def test_bf16_model_trains_on_float32_masters():
    """The GPU path's optimizer (bf16 model, float32 masters), run on the CPU: one step moves the
    masters by AdamW's first step (lr * sign(grad)) and the model holds their bf16 rounding."""
    from moekit.integrations.lm.train import _MixedPrecisionAdamW, model_config
    from transformers import OlmoeForCausalLM

    cfg = config_with("tiny", lr=1e-2)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(model_config(cfg, 400, 0)).to(torch.bfloat16).train()
    opt = _MixedPrecisionAdamW(model, cfg, fused=False)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    before = [m.clone() for m in opt.masters]
    x = torch.randint(1, 400, (2, 16))
    model(input_ids=x, labels=x, output_router_logits=True).loss.backward()
    grads = [None if p.grad is None else p.grad.float().clone() for p in opt.params]
    norm = opt.step(1e-2)
    assert torch.isfinite(norm)
    clip = min(1.0, 1.0 / (float(norm) + 1e-6))
    for p, m, b, g, in zip(opt.params, opt.masters, before, grads):
        assert p.grad is None and torch.equal(p.data, m.to(torch.bfloat16))
        if g is not None and p.dim() >= 2:
            big = g.abs() * clip > 1e-5  # where Adam's eps (1e-8) does not bend g / |g|
            moved = (m - b * (1 - 1e-2 * cfg.weight_decay))[big]
            torch.testing.assert_close(moved, -1e-2 * torch.sign(g[big]), rtol=2e-3, atol=1e-6)
