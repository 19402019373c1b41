"""Values that must not slip past the up-front config check.

Owns: booleans accepted only as real booleans (``rollout.overlap.enable=ture|1|maybe``, ``dry_run=1``), non-finite
and zero values of positive settings (``model.lora.alpha=inf``, ``memory_plan.device_gib=inf``,
``rollout.overlap.timeout_s=0|nan``), ``rollout.overlap.staleness=1000``, and ``model.lora.rank`` above the
adapted layers' smaller side (refused naming the rank, before the memory plan suggests other keys). Each is one
line naming the key and a valid value. Leaves out: the rule table's other keys (test_config_check.py).
"""
from __future__ import annotations

import pytest

from conftest import SMALL, compose_config
from fspo.models.lora import check_lora_targets
from fspo.runtime.checks.config_check import check_config
from fspo.runtime.checks.config_rules import ConfigError


@pytest.mark.parametrize("override, key", [
    ("rollout.overlap.enable=ture", "rollout.overlap.enable=ture"),
    ("rollout.overlap.enable=1", "rollout.overlap.enable=1"),
    ("rollout.overlap.enable=maybe", "rollout.overlap.enable=maybe"),
    ("dry_run=1", "dry_run=1"),
    ("model.lora.alpha=inf", "model.lora.alpha=inf: must be a finite number"),
    ("memory_plan.device_gib=inf", "memory_plan.device_gib=inf: must be a finite number"),
    ("rollout.overlap.timeout_s=0", "rollout.overlap.timeout_s=0"),
    ("rollout.overlap.timeout_s=nan", "rollout.overlap.timeout_s=nan"),
    ("rollout.overlap.staleness=1000", "rollout.overlap.staleness=1000"),
])
def test_a_value_outside_its_rule_is_refused_up_front(override, key):
    with pytest.raises(ConfigError) as e:
        check_config(compose_config(SMALL + [override]))
    msg = str(e.value)
    assert msg.startswith(key) and "; set " in msg and "\n" not in msg, msg


def test_real_booleans_still_pass():
    for v in ("true", "false", "True"):
        check_config(compose_config(SMALL + [f"dry_run={v}"]))


def test_a_lora_rank_above_the_layers_is_refused_naming_the_rank():
    cfg = compose_config(SMALL + ["model.lora.rank=100000"])
    with pytest.raises(ValueError, match=r"^model.lora.rank=100000: above the smaller side of the adapted layer .*"
                                         r"set model.lora.rank to at most \d+"):
        check_lora_targets(cfg.model)
    check_lora_targets(compose_config(SMALL + ["model.lora.rank=8"]).model)
