"""Shared fixtures of the tax-model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_shipped_calibrations(tmp_path_factory, monkeypatch, request):
    """The tests choose their calibrations themselves: the files shipped in
    moekit/tax/calibrations (measured on real GPUs) stay out unless a test asks for them."""
    if "shipped_calibrations" in request.keywords:
        return
    from moekit.tax import report

    empty = tmp_path_factory.mktemp("no-shipped-calibrations")
    monkeypatch.setattr(report, "SHIPPED_CALIBRATIONS", empty)
