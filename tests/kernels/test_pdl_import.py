"""A lost programmatic-dependent-launch import is logged once, not silent."""

from __future__ import annotations

import logging

from disagg.kernels import paged_tile


def test_missing_pdl_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(paged_tile, "HAS_PDL", False)
    monkeypatch.setattr(paged_tile, "_PDL_IMPORT_ERROR", "ImportError('no gdc_wait')")
    paged_tile.note_missing_pdl.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="disagg.kernels.paged_tile"):
            assert paged_tile.note_missing_pdl() is True
            assert paged_tile.note_missing_pdl() is True
        records = [r for r in caplog.records if "programmatic dependent launch unavailable" in r.message]
        assert len(records) == 1 and "no gdc_wait" in records[0].message
    finally:
        paged_tile.note_missing_pdl.cache_clear()
