"""The README's test command finds what CI finds and nothing else: without
``HYPOTHESIS_PROFILE`` the property tests draw the examples CI draws (issue 44: a fresh
clone's run drew a spec CI never had and failed); ``HYPOTHESIS_PROFILE=explore`` draws
new ones. Checked in a fresh interpreter, as a new user's ``python -m pytest`` loads
tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
REPORT = "from hypothesis import settings; s = settings(); print(s.derandomize, s.database is None)"


def loaded_profile(profile: Optional[str]) -> str:
    """What the settings are once tests/conftest.py is imported with ``HYPOTHESIS_PROFILE=profile``
    (unset: None): "derandomize database-is-None"."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    if profile is not None:
        env["HYPOTHESIS_PROFILE"] = profile
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", f"import conftest; {REPORT}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("profile, expected", [
    (None, "True True"),  # the README's command: CI's draws, no example database
    ("ci", "True True"),  # .ci/run
    ("explore", "False False"),  # new draws; a failure found is kept and tried first next time
])
def test_the_default_profile_draws_what_ci_draws_and_explore_draws_new_examples(profile, expected):
    assert loaded_profile(profile) == expected
