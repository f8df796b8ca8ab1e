"""scripts/apt-install.sh, as test.sh's SSH and Slurm set-up runs it: it says why, what it installs and what it
upgrades in place before apt-get installs anything, starts no daemon, and leaves none of the packages' daemons
enabled at boot (the tests start their own), while what was enabled before stays as it was.

apt-get, deb-systemd-helper and update-rc.d are replaced by recorders on PATH (a real install changes the machine and
needs the network); what they would do to the boot configuration (the links a package's scripts create) is done for
real in a temporary /etc."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "apt-install.sh"

PLAN = """\
NOTE: This is only a simulation!
Inst openssh-client [1:9.2p1-2+deb12u3] (1:9.2p1-2+deb12u5 Debian-Security:12/stable-security [amd64])
Inst openssh-sftp-server (1:9.2p1-2+deb12u5 Debian-Security:12/stable-security [amd64])
Inst openssh-server (1:9.2p1-2+deb12u5 Debian-Security:12/stable-security [amd64])
Conf openssh-client (1:9.2p1-2+deb12u5 Debian-Security:12/stable-security [amd64])
"""


def _fakes(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """PATH with the recorders first; the temporary /etc/systemd/system and /etc."""
    bin_dir, units, etc = tmp_path / "bin", tmp_path / "etc" / "systemd" / "system", tmp_path / "etc"
    bin_dir.mkdir()
    (units / "multi-user.target.wants").mkdir(parents=True)
    (etc / "rc2.d").mkdir()
    (etc / "init.d").mkdir()
    # enabled before: stays enabled
    (units / "multi-user.target.wants" / "postgresql.service").symlink_to("/lib/systemd/system/postgresql.service")
    (etc / "rc2.d" / "S01postgresql").symlink_to("../init.d/postgresql")
    (tmp_path / "plan.txt").write_text(PLAN)
    policy = tmp_path / "policy-rc.d"
    scripts = {
        "apt-get": f"""
case "$1" in
  update) exit 0 ;;
  install)
    if [ "$2" = -s ]; then cat {tmp_path / "plan.txt"}; exit 0; fi
    echo "RECORDER: apt-get $* (policy-rc.d says: $({policy}; echo $?))" >&2
    # what openssh-server's postinst does on Debian: enable the unit and the SysV script at boot
    ln -s /lib/systemd/system/ssh.service {units}/multi-user.target.wants/ssh.service
    ln -s ../init.d/ssh {etc}/rc2.d/S01ssh ;;
esac""",
        "deb-systemd-helper": f'[ "$1" = disable ] && rm {units}/multi-user.target.wants/"$2" && echo "$*" >> '
        f"{tmp_path / 'calls.txt'}",
        "update-rc.d": f'[ "$2" = disable ] && mv {etc}/rc2.d/S01"$1" {etc}/rc2.d/K01"$1" && echo "update-rc.d $*" >> '
        f"{tmp_path / 'calls.txt'}",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\nset -e\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "AXRL_SYSTEMD_DIR": str(units),
        "AXRL_RC_DIR": str(etc),
        "AXRL_POLICY_RC": str(policy),
    }
    return env, units, etc


def test_it_says_what_it_installs_and_upgrades_first_and_enables_nothing_at_boot(tmp_path: Path) -> None:
    env, units, etc = _fakes(tmp_path)
    run = subprocess.run(
        ["bash", str(SCRIPT), "the SSH tests run sshd", "openssh-server", "openssh-client"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    installed = next(i for i, line in enumerate(lines) if line.startswith("RECORDER: apt-get install -y"))
    said = lines[:installed]
    assert "apt-install: the SSH tests run sshd" in said
    assert "apt-install: installing with apt-get, system-wide: openssh-sftp-server openssh-server" in said
    assert (
        "apt-install: upgrading in place: openssh-client 1:9.2p1-2+deb12u3 -> 1:9.2p1-2+deb12u5 (the packages above "
        "depend on these versions)"
    ) in said
    assert "policy-rc.d says: 101" in lines[installed]  # no daemon started by the packages' scripts
    assert not (tmp_path / "policy-rc.d").exists()  # and the policy is gone again
    assert lines[-1] == "apt-install: not enabled at boot (the packages' scripts had enabled them): ssh ssh.service"
    wants = sorted(p.name for p in (units / "multi-user.target.wants").iterdir())
    assert wants == ["postgresql.service"]  # enabled before: left alone
    assert sorted(p.name for p in (etc / "rc2.d").iterdir()) == ["K01ssh", "S01postgresql"]
    calls = sorted((tmp_path / "calls.txt").read_text().splitlines())
    assert calls == ["disable ssh.service", "update-rc.d ssh disable"]


def test_an_existing_policy_is_kept(tmp_path: Path) -> None:
    env, _, _ = _fakes(tmp_path)
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    run = subprocess.run(["bash", str(SCRIPT), "why", "openssh-server"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert policy.read_text() == "#!/bin/sh\nexit 101\n"


def test_a_machine_without_systemd_or_rc_dirs_installs_all_the_same(tmp_path: Path) -> None:
    env, _, _ = _fakes(tmp_path)
    env["AXRL_SYSTEMD_DIR"], env["AXRL_RC_DIR"] = str(tmp_path / "none"), str(tmp_path / "none")
    run = subprocess.run(["bash", str(SCRIPT), "why", "openssh-server"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "RECORDER: apt-get install -y" in run.stderr and "not enabled at boot" not in run.stderr
