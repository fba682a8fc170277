"""The settings name each policy; the policy modules hold what each name does. Both lists
agree, so every name a setting accepts resolves, and the settings import no policy code."""

from __future__ import annotations

import subprocess
import sys

from kvd.config import ADMISSION_POLICY_NAMES, EVICTION_POLICY_NAMES, Overflow
from kvd.store.admission import ADMISSION_POLICIES
from kvd.store.eviction import EVICTION_POLICIES
from kvd.store.writeback import OVERFLOW_RULES


def test_every_eviction_name_is_a_policy_and_every_policy_a_name() -> None:
    assert list(EVICTION_POLICIES) == list(EVICTION_POLICY_NAMES)


def test_every_admission_name_is_a_policy_and_every_policy_a_name() -> None:
    assert list(ADMISSION_POLICIES) == list(ADMISSION_POLICY_NAMES)


def test_every_overflow_name_has_its_rule() -> None:
    assert list(OVERFLOW_RULES) == list(Overflow)


def test_the_settings_import_no_policy_module() -> None:
    policies = ("kvd.store.admission", "kvd.store.eviction", "kvd.store.writeback")
    script = (
        "import sys, kvd.config\n"
        f"loaded = [name for name in {policies!r} if name in sys.modules]\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
