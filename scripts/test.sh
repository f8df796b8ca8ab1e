#!/usr/bin/env bash
# Sets everything up, then runs the lint, the type checker and the test suite. Extra arguments go to pytest.
# Beyond .venv (scripts/setup.sh), it installs what the tests of the remote paths need, each script saying on stderr
# what it installs, upgrades and why before it does: as root with apt-get, Debian's OpenSSH server
# (scripts/sshd-install.sh) and slurm-wlm with munge (scripts/slurm-install.sh), system-wide, with no daemon started
# or enabled at boot (the tests start their own, on loopback, with their own config); with npm, the MCP Inspector's
# CLI into .venv/mcp-inspector (scripts/inspector-install.sh). Where one cannot be installed its tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/sshd-install.sh
scripts/inspector-install.sh
scripts/slurm-install.sh
# Bytecode once, before the suite. It starts about 275 interpreters, and three workers that each rewrite every test
# module's asserts: where PYTHONDONTWRITEBYTECODE is set (pyc files are still read) each of them compiled the
# package and the tests again. The package and the tests compile in about 2 s; the rewritten test modules are
# written by one collection that runs beside the type checker.
.venv/bin/python -m compileall -q -j 0 mcp_server tests benchmarks skills
PYTHONDONTWRITEBYTECODE='' .venv/bin/python -m pytest --collect-only -q -p no:cacheprovider -p no:xdist >/dev/null 2>&1 &
collected=$!
.venv/bin/ruff check .
.venv/bin/pyright --pythonpath .venv/bin/python  # the library, as configured in pyproject.toml
wait "$collected" || true  # only a cache: a collection error shows again in the suite's own collection
# Three pytest-xdist workers: the suite waits on processes, sessions and timeouts of its own much of the time (two
# workers kept a 2-core machine's cores about half busy), so a third fills the waits (tests/conftest.py keeps the
# tests that share a costly fixture, or one process table, on one worker). A later -n wins: `-n 6` on a larger
# machine, `-n 0` for one process.
exec .venv/bin/python -m pytest -n 3 --dist loadgroup "$@"
