"""The category contract and the public surface."""

from __future__ import annotations

import re

from attr_data import LOGS

from trainguard import attribution
from trainguard.attribution import CATEGORIES, load_registry


def test_categories_match_the_contract():
    readme = (LOGS / "README.md").read_text()
    section = readme.split("## Categories", 1)[1].split("##", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert sorted(documented) == sorted(CATEGORIES)
    reg = load_registry()
    assert sorted(reg.categories) == sorted(CATEGORIES)
    used = {p.category for p in reg.patterns if p.category}
    assert used <= set(CATEGORIES)


def test_decision_policy_of_categories():
    cats = load_registry().categories
    assert {c for c, v in cats.items() if v.decision == "STOP"} >= {
        "code_exception", "config_error", "missing_path", "permission_denied", "nan_or_inf",
        "storage_full", "cuda_oom", "host_oom", "user_cancelled", "completed"}
    assert cats["in_progress"].decision == "CONTINUE"
    assert cats["gpu_hardware"].decision == "RESTART_EXCLUDE_NODES"
    assert cats["collective_timeout"].domain == "unknown"


def test_exports():
    for name in attribution.__all__:
        assert getattr(attribution, name) is not None, name
    assert len(set(attribution.__all__)) == len(attribution.__all__)
