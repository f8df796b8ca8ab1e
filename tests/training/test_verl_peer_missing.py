"""Without verl or tensordict (a machine set up without scripts/setup.sh) the cross-checks against verl's own code
are skipped with the reason, never reported as errors: the rest of the suite still says something."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = ["tests/training/test_verl_crosscheck.py", "tests/training/test_verl_response_width.py"]


@pytest.mark.slow  # two pytest runs in subprocesses
@pytest.mark.parametrize("package", ["tensordict", "verl"])
def test_the_verl_cross_checks_skip_naming_the_missing_package(package: str) -> None:
    # sys.modules[name] = None: `import name` fails and find_spec says "not installed", as on a machine without it
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', *{CHECKS!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report  # passed and skipped only: no error, no failure
    assert " error" not in report and "skipped" in report
    assert f"{package} is not installed (scripts/setup.sh installs" in report
