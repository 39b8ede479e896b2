"""The Compose stack's secrets and etcd auth, run in the kvpool image (docker-compose.yml).

    python /init-stack.py secrets   # as root, once per start: make what /secrets lacks
    python /init-stack.py etcd      # once etcd answers: turn its auth on (if not yet)

``secrets`` writes each file only if it is missing, so the first start generates them and
later starts keep them (bring your own: put the files in a folder and point
KVPOOL_SECRETS at it; docs/deployment.md lists them). Files are 0640, owned by the kvpool
user (10001) and group 0, which the other containers' users read through. Nothing here
is printed: read a token with
``docker compose exec kvpool-1 cat /secrets/client-token``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import time
from pathlib import Path

SECRETS = Path(os.environ.get("SECRETS_DIR", "/secrets"))
KVPOOL_UID = 10001
ETCD = os.environ.get("ETCD_ENDPOINT", "http://127.0.0.1:2379")
ETCD_PREFIX = os.environ.get("KVPOOL_ETCD_PREFIX", "/kvpool/compose")


def _random() -> str:
    return secrets.token_urlsafe(24)  # 32 characters, 192 bits


def _own(path: Path) -> None:
    """The kvpool user's, group 0 (as root, in the stack; a test's files stay its own)."""
    if os.geteuid() == 0:
        os.chown(path, KVPOOL_UID, 0)


def _write(name: str, text: str) -> None:
    path = SECRETS / name
    if path.exists():
        return
    part = path.with_suffix(".part")
    part.write_text(text)
    _own(part)
    part.chmod(0o640)
    part.rename(path)


def make_secrets() -> None:
    SECRETS.mkdir(parents=True, exist_ok=True)
    _own(SECRETS)
    SECRETS.chmod(0o750)
    for name in ("admin-token", "client-token", "s3-root-password", "s3-node-secret",
                 "etcd-root-password", "etcd-password", "grafana-admin-password"):
        _write(name, _random() + "\n")
    _write("s3-root-user", "kvpool-root\n")
    _write("s3-node-key", "kvpool-node-" + secrets.token_hex(4) + "\n")
    key, secret = (_read(n) for n in ("s3-node-key", "s3-node-secret"))
    _write("aws-credentials", f"[default]\naws_access_key_id = {key}\n"
                              f"aws_secret_access_key = {secret}\n")
    # the tokens file holds digests only: a copy of it gives no one a token
    admin, client = (hashlib.sha256(_read(n).encode()).hexdigest()
                     for n in ("admin-token", "client-token"))
    _write("tokens.toml", "# made by deploy/init-stack.py; tokens in admin-token, "
                          "client-token\n"
                          f'[[token]]\nsha256 = "{admin}"\ntenant = "ops"\nrole = "admin"\n\n'
                          f'[[token]]\nsha256 = "{client}"\ntenant = "engines"\n'
                          'role = "write"\n')
    print(f"init-stack: secrets in {SECRETS}", flush=True)


def _read(name: str) -> str:
    return (SECRETS / name).read_text().strip()


def enable_etcd_auth() -> None:
    from kvpool.server.cluster.etcd_auth import enable_auth

    for _ in range(120):
        try:
            changed = enable_auth(ETCD, root_password=_read("etcd-root-password"),
                                  user="kvpool", password=_read("etcd-password"),
                                  prefix=ETCD_PREFIX)
            break
        except OSError as exc:
            print(f"init-stack: waiting for etcd at {ETCD}: {exc}", flush=True)
            time.sleep(1)
    else:
        raise SystemExit(f"init-stack: etcd at {ETCD} never answered")
    print(f"init-stack: etcd auth {'enabled' if changed else 'was already on'} "
          f"(user kvpool: {ETCD_PREFIX}/ only)", flush=True)


if __name__ == "__main__":
    steps = {"secrets": make_secrets, "etcd": enable_etcd_auth}
    if len(sys.argv) != 2 or sys.argv[1] not in steps:
        raise SystemExit(f"usage: init-stack.py {{{','.join(steps)}}}")
    steps[sys.argv[1]]()
