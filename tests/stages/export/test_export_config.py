"""`export:` config: defaults per variant, partial overrides merged over them, unknown names refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.config import load_config
from infra.config.export import ExportConfig


def test_tiny_config_has_export_section():
    cfg = load_config("configs/tiny.yaml")
    assert cfg.export.dtype == "bfloat16"
    assert set(cfg.export.variants) <= set(cfg.export.thresholds)


def test_partial_thresholds_merge_over_defaults():
    e = ExportConfig(thresholds={"int8": {"max_ppl_ratio": 1.5}})
    assert e.thresholds["int8"].max_ppl_ratio == 1.5
    assert e.thresholds["int8"].min_greedy_agreement == ExportConfig().thresholds["int8"].min_greedy_agreement
    assert e.thresholds["hf"].max_logit_diff == 1e-3


@pytest.mark.parametrize("bad,match", [
    (dict(thresholds={"int9": {}}), "unknown variant.*int9"),
    (dict(variants=["fp9"]), "fp9"),
    (dict(variants=["int8", "int8"]), "twice"),
])
def test_bad_export_config_is_named(bad, match):
    with pytest.raises(ValidationError, match=match):
        ExportConfig(**bad)
