"""services.common.env.secret: a secret from its variable or from the file its <NAME>_FILE variable names (compose
`secrets:`, docker-compose.cpu.yml), and k8s/base/redis-acl.sh reading the Redis passwords the same way."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from services.common.env import ENV_ADAPTER_TOKEN, secret

ROOT = Path(__file__).resolve().parents[2]


def test_a_secret_comes_from_its_variable_or_its_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("from-the-file\n")
    assert secret({}, ENV_ADAPTER_TOKEN) is None
    assert secret({ENV_ADAPTER_TOKEN: "from-env"}, ENV_ADAPTER_TOKEN) == "from-env"
    assert secret({ENV_ADAPTER_TOKEN + "_FILE": str(f)}, ENV_ADAPTER_TOKEN) == "from-the-file"
    # the variable wins over the file
    assert secret({ENV_ADAPTER_TOKEN: "from-env", ENV_ADAPTER_TOKEN + "_FILE": str(f)}, ENV_ADAPTER_TOKEN) == "from-env"
    with pytest.raises(ValueError, match="SOLRL_ADAPTER_TOKEN_FILE: cannot read"):
        secret({ENV_ADAPTER_TOKEN + "_FILE": str(tmp_path / "missing")}, ENV_ADAPTER_TOKEN)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):   # a file named and empty never means "no secret"
        secret({ENV_ADAPTER_TOKEN + "_FILE": str(tmp_path / "empty")}, ENV_ADAPTER_TOKEN)


def test_redis_acl_script_reads_password_files(tmp_path):
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum not installed")
    env = {"PATH": "/usr/bin:/bin"}
    for role in ("trainer", "explorer", "regenerator"):
        (tmp_path / role).write_text(f"{role}-password\n")
        env[f"SOLRL_REDIS_{role.upper()}_PASSWORD_FILE"] = str(tmp_path / role)
    acl = tmp_path / "users.acl"
    out = subprocess.run(["sh", str(ROOT / "k8s" / "base" / "redis-acl.sh"), str(acl), "sh", "-c", 'echo "$@"', "--"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["--aclfile", str(acl)]
    text = acl.read_text()
    for role in ("trainer", "explorer", "regenerator"):
        digest = hashlib.sha256(f"{role}-password".encode()).hexdigest()
        assert f"user {role} on #{digest} " in text
        assert f"{role}-password" not in text
    # a named file that cannot be read: no start
    env["SOLRL_REDIS_EXPLORER_PASSWORD_FILE"] = str(tmp_path / "missing")
    out = subprocess.run(["sh", str(ROOT / "k8s" / "base" / "redis-acl.sh"), str(acl), "true"], env=env,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "SOLRL_REDIS_EXPLORER_PASSWORD_FILE" in out.stderr
