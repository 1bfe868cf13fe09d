"""``moekit bench experts`` off the GPU: its help, and one clear error instead of a traceback."""

from __future__ import annotations

import pytest
import torch

from moekit.cli import main


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "experts", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--presets" in out and "--ms" in out and "--out-dir" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_needs_a_gpu(capsys, tmp_path):
    assert main(["bench", "experts", "--presets", "tiny-olmoe", "--out-dir", str(tmp_path)]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_bad_token_counts(capsys, tmp_path):
    assert main(["bench", "experts", "--ms", "0,4", "--out-dir", str(tmp_path)]) == 2
    assert "--ms" in capsys.readouterr().err
