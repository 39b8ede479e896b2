"""Node configuration: frozen dataclasses, loaded from TOML, then ``KVPOOL_*`` env, then flags.

Each knob is declared once, with its flag, environment variable and help
(:func:`~kvpool.server.knobs.knob`), and ``kvpool serve --help`` is generated from these
declarations. Sizes accept ``"8GiB"``, ``"512MiB"``, ``"64MB"`` or plain bytes;
components receive their own section (``DramConfig``, ``ServerConfig``), never the
whole tree.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.protocol.errors import ConfigError
from kvpool.server import knobs
from kvpool.server.knobs import format_size, knob, parse_size

__all__ = [
    "ClusterConfig",
    "DramConfig",
    "NodeConfig",
    "S3Config",
    "SecurityConfig",
    "ServerConfig",
    "SsdConfig",
    "add_arguments",
    "format_size",
    "knob_table",
    "unknown_env_vars",
    "load_config",
    "parse_size",
]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = knob("127.0.0.1", "address to bind the data and admin ports (0.0.0.0 for all)",
                     flag="--host", env="KVPOOL_HOST")
    data_port: int = knob(7700, "binary data-path port (0 = pick a free one)",
                          flag="--data-port", env="KVPOOL_DATA_PORT")
    admin_port: int = knob(7701, "HTTP admin port: /healthz, /v1/stats (0 = pick a free one)",
                           flag="--admin-port", env="KVPOOL_ADMIN_PORT")
    node_id: str = knob("", "node name in stats, logs and the cluster map (default: "
                        "host:data_port)", flag="--node-id", env="KVPOOL_NODE_ID")
    advertise_host: str = knob("", "host name or address clients and peers reach this node "
                               "by ('' = --host; a wildcard --host advertises the hostname)",
                               flag="--advertise-host", env="KVPOOL_ADVERTISE_HOST")
    host_id: str = knob("", "failure domain: the machine this node runs on; a key's copies go "
                        "to distinct hosts first ('' = this machine's hostname in an etcd "
                        "cluster; a static map's entry without host = its data address's host)",
                        flag="--host-id", env="KVPOOL_HOST_ID")
    rack: str = knob("", "failure domain: the node's rack; copies spread over racks where the "
                     "map has them ('' = none)", flag="--rack", env="KVPOOL_RACK")
    zone: str = knob("", "failure domain: the node's zone; copies spread over zones first "
                     "('' = none)", flag="--zone", env="KVPOOL_ZONE")
    data_dir: str = knob("./kvpool-data", "directory of the node's on-disk tiers (SSD under "
                         "ssd/); one node at a time (it holds data_dir/LOCK)",
                         flag="--data-dir", env="KVPOOL_DATA_DIR")
    max_value_bytes: int = knob(64 << 20, "largest value (envelope included) a PUT may carry",
                                flag="--max-value", env="KVPOOL_MAX_VALUE", kind="size")
    max_batch: int = knob(4096, "most keys/items in one frame",
                          flag="--max-batch", env="KVPOOL_MAX_BATCH")
    max_frame_bytes: int = knob(1 << 30, "largest frame body accepted",
                                flag="--max-frame", env="KVPOOL_MAX_FRAME", kind="size")
    expire_interval_s: float = knob(1.0, "seconds between TTL sweeps",
                                    flag="--expire-interval", env="KVPOOL_EXPIRE_INTERVAL")
    shutdown_grace_s: float = knob(5.0, "seconds to let open connections finish on SIGTERM",
                                   flag="--shutdown-grace", env="KVPOOL_SHUTDOWN_GRACE")
    log_level: str = knob("info", "debug, info, warning or error",
                          flag="--log-level", env="KVPOOL_LOG_LEVEL")
    admin_token: str = knob("", "bearer token the admin API's mutating routes (POST, DELETE) "
                            "require ('' = open; reads stay open)", flag="--admin-token",
                            env="KVPOOL_ADMIN_TOKEN")
    metrics: bool = knob(True, "OpenTelemetry metrics: GET /metrics (Prometheus), and OTLP when "
                         "OTEL_EXPORTER_OTLP_ENDPOINT is set", flag="--metrics",
                         env="KVPOOL_METRICS", kind="bool")
    shm: bool = knob(True, "same-host fast path: co-located clients read values straight from "
                     "the DRAM arena's shared memory (Linux)", flag="--shm", env="KVPOOL_SHM",
                     kind="bool")
    shm_write: bool = knob(True, "fast-path clients of the node's own user may also PUT by "
                           "writing into reserved arena slots", flag="--shm-write",
                           env="KVPOOL_SHM_WRITE", kind="bool")
    shm_lease_s: float = knob(5.0, "longest a fast-path client may hold values from eviction "
                              "(reads) or slots uncommitted (writes)",
                              flag="--shm-lease", env="KVPOOL_SHM_LEASE")
    shm_allow: str = knob("", "who may map the arena: uid:N,gid:N,... ('' = the node's own "
                          "user)", flag="--shm-allow", env="KVPOOL_SHM_ALLOW")
    max_connections: int = knob(4096, "most data connections open at once; more are closed "
                                "at accept", flag="--max-connections",
                                env="KVPOOL_MAX_CONNECTIONS")
    idle_timeout_s: float = knob(300.0, "close a data connection that sends nothing for this "
                                 "long, or stalls mid-frame or unread for this long (0 = "
                                 "never)", flag="--idle-timeout", env="KVPOOL_IDLE_TIMEOUT")
    hello_timeout_s: float = knob(10.0, "close a data connection that has not completed HELLO "
                                  "within this long", flag="--hello-timeout",
                                  env="KVPOOL_HELLO_TIMEOUT")
    admin_max_connections: int = knob(256, "most admin (HTTP) connections open at once; more "
                                      "are closed at accept, so the admin port can never take "
                                      "the descriptors the data port needs",
                                      flag="--admin-max-connections",
                                      env="KVPOOL_ADMIN_MAX_CONNECTIONS")
    admin_idle_timeout_s: float = knob(30.0, "close an admin connection that has no request "
                                       "for this long (a new one that never sends one too)",
                                       flag="--admin-idle-timeout",
                                       env="KVPOOL_ADMIN_IDLE_TIMEOUT")

    def __post_init__(self) -> None:
        for name in ("data_port", "admin_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} {port} is not a port number")
        if self.max_value_bytes < 128:
            raise ConfigError("max_value_bytes must be at least 128")
        if self.max_frame_bytes < self.max_value_bytes:
            raise ConfigError("max_frame_bytes must be >= max_value_bytes")
        if not 1 <= self.max_batch <= 1 << 20:
            raise ConfigError("max_batch must be in [1, 1048576]")
        if self.expire_interval_s <= 0 or self.shutdown_grace_s < 0:
            raise ConfigError("expire_interval_s must be > 0 and shutdown_grace_s >= 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"unknown log level {self.log_level!r}")
        if self.shm_lease_s <= 0:
            raise ConfigError("shm_lease_s must be > 0")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be >= 1")
        if self.idle_timeout_s < 0 or self.hello_timeout_s <= 0:
            raise ConfigError("idle_timeout_s must be >= 0 and hello_timeout_s > 0")
        if self.admin_max_connections < 1 or not self.admin_idle_timeout_s > 0:
            raise ConfigError("admin_max_connections must be >= 1 and admin_idle_timeout_s "
                              "> 0")


@dataclass(frozen=True, slots=True)
class DramConfig:
    capacity_bytes: int = knob(0, "DRAM tier capacity (0 = capacity_fraction of available memory)",
                               flag="--dram-capacity", env="KVPOOL_DRAM_CAPACITY", kind="size")
    capacity_fraction: float = knob(0.5, "share of available memory used when capacity is 0 "
                                    "(within a container's cgroup memory limit, where one is "
                                    "set)", flag="--dram-fraction", env="KVPOOL_DRAM_FRACTION")
    default_ttl_s: float = knob(0.0, "TTL for chunks stored without one (0 = no TTL)",
                                flag="--default-ttl", env="KVPOOL_DEFAULT_TTL")
    allocate_ahead_bytes: int = knob(256 << 20, "memory allocated in the background ahead "
                                     "of what is stored, so PUTs do not wait on page faults "
                                     "(0 = off; docs/tiers.md)",
                                     flag="--dram-allocate-ahead",
                                     env="KVPOOL_DRAM_ALLOCATE_AHEAD", kind="size")
    policy: str = knob("chain", "what the DRAM tier evicts first: chain (S3-FIFO fitted to "
                       "prefix chains: one-off chunks leave first) or lru (docs/tiers.md)",
                       flag="--dram-policy", env="KVPOOL_DRAM_POLICY")

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError("dram capacity must be >= 0")
        if self.policy not in POLICIES:
            raise ConfigError(f"dram policy must be one of {', '.join(POLICIES)}, "
                              f"not {self.policy!r}")
        if self.allocate_ahead_bytes < 0:
            raise ConfigError("dram allocate_ahead_bytes must be >= 0")
        if not 0 < self.capacity_fraction <= 0.95:
            raise ConfigError("dram capacity_fraction must be in (0, 0.95]")
        if self.default_ttl_s < 0:
            raise ConfigError("default_ttl_s must be >= 0")


SSD_CODECS = ("none", "lz4", "shuffle-lz4")
#: what the tiers below DRAM take (TieringPolicy.admit)
ADMIT = ("all", "reused")
#: the DRAM tier's eviction policies (kvpool.tiers.eviction.POLICIES, named here: the CLI
#: reads this module without the node's dependencies)
POLICIES = ("chain", "lru")


@dataclass(frozen=True, slots=True)
class SsdConfig:
    enabled: bool = knob(True, "run the SSD tier (RocksDB in data_dir/ssd) below DRAM (off with "
                         "--s3-bucket: S3 right below DRAM, nothing on local disk)",
                         flag="--ssd", env="KVPOOL_SSD", kind="bool")
    capacity_bytes: int = knob(0, "SSD tier capacity (0 = capacity_fraction of free disk space)",
                               flag="--ssd-capacity", env="KVPOOL_SSD_CAPACITY", kind="size")
    capacity_fraction: float = knob(0.5, "share of free disk space used when capacity is 0",
                                    flag="--ssd-fraction", env="KVPOOL_SSD_FRACTION")
    codec: str = knob("none", "how chunks are stored on SSD: none, lz4 or shuffle-lz4 "
                      "(docs/tiers.md has the numbers behind the default)",
                      flag="--ssd-codec", env="KVPOOL_SSD_CODEC")
    max_pending_bytes: int = knob(256 << 20, "write-behind budget (at most 1/4 of DRAM); past "
                                  "it, writes below DRAM (to the SSD, or to S3 alone) are "
                                  "shed",
                                  flag="--ssd-max-pending", env="KVPOOL_SSD_MAX_PENDING",
                                  kind="size")
    full_retry_s: float = knob(10.0, "once the disk is full (the tier serves its chunks and "
                               "refuses writes), try to take writes again this often",
                               flag="--ssd-full-retry", env="KVPOOL_SSD_FULL_RETRY")

    admit: str = knob("all", "which chunks the tiers below DRAM take: all (each written behind "
                      "at its PUT) or reused (once read, looked up or stored again after "
                      "eviction: fewer flash writes; docs/tiers.md)",
                      flag="--ssd-admit", env="KVPOOL_SSD_ADMIT")

    def __post_init__(self) -> None:
        if self.admit not in ADMIT:
            raise ConfigError(f"ssd admit must be one of {', '.join(ADMIT)}, not {self.admit!r}")
        if self.capacity_bytes < 0:
            raise ConfigError("ssd capacity must be >= 0")
        if not self.full_retry_s > 0:
            raise ConfigError("ssd full_retry_s must be > 0 seconds")
        if not 0 < self.capacity_fraction <= 0.95:
            raise ConfigError("ssd capacity_fraction must be in (0, 0.95]")
        if self.codec not in SSD_CODECS:
            raise ConfigError(f"ssd codec must be one of {', '.join(SSD_CODECS)}, "
                              f"not {self.codec!r}")
        if self.max_pending_bytes < 1 << 20:
            raise ConfigError("ssd max_pending_bytes must be at least 1 MiB")


@dataclass(frozen=True, slots=True)
class S3Config:
    bucket: str = knob("", "S3 bucket shared by the cluster ('' = no S3 tier); credentials come "
                       "from the standard AWS chain", flag="--s3-bucket", env="KVPOOL_S3_BUCKET")
    prefix: str = knob("kvpool", "object name prefix: <prefix>/<2 hex>/<32 hex key>",
                       flag="--s3-prefix", env="KVPOOL_S3_PREFIX")
    endpoint_url: str = knob("", "S3 endpoint for MinIO, SeaweedFS, Ceph ('' = AWS)",
                             flag="--s3-endpoint", env="KVPOOL_S3_ENDPOINT")
    region: str = knob("", "S3 region ('' = from the AWS config chain)",
                       flag="--s3-region", env="KVPOOL_S3_REGION")
    codec: str = knob("none", "how chunks are stored in S3: none, lz4 or shuffle-lz4 "
                      "(docs/tiers.md has the numbers behind the default)",
                      flag="--s3-codec", env="KVPOOL_S3_CODEC")
    max_pending_bytes: int = knob(256 << 20, "upload budget; past it, S3 write-behind is shed",
                                  flag="--s3-max-pending", env="KVPOOL_S3_MAX_PENDING",
                                  kind="size")
    relist_interval_s: float = knob(60.0, "seconds between LISTs that find other nodes' chunks "
                                    "(and drop deleted ones)",
                                    flag="--s3-relist", env="KVPOOL_S3_RELIST")
    write_through: bool = knob(False, "acknowledge a PUT only once S3 has the chunk (else "
                               "NotDurableError); chunks with a TTL are never written to S3",
                               flag="--s3-write-through", env="KVPOOL_S3_WRITE_THROUGH",
                               kind="bool")

    def __post_init__(self) -> None:
        if self.codec not in SSD_CODECS:
            raise ConfigError(f"s3 codec must be one of {', '.join(SSD_CODECS)}, "
                              f"not {self.codec!r}")
        if self.max_pending_bytes < 1 << 20:
            raise ConfigError("s3 max_pending_bytes must be at least 1 MiB")
        if self.relist_interval_s <= 0:
            raise ConfigError("s3 relist_interval_s must be > 0")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    file: str = knob("", "static cluster map (TOML: epoch, replication, [[nodes]]); re-read on "
                     "SIGHUP ('' = standalone unless --peers)",
                     flag="--cluster-file", env="KVPOOL_CLUSTER_FILE")
    peers: str = knob("", "static cluster as host:port,host:port,... of every node's data port "
                      "(this one included; admin port = data port + 1)",
                      flag="--peers", env="KVPOOL_PEERS")
    replication: int = knob(1, "copies of each chunk for a cluster from --peers, or for a new "
                            "etcd cluster (a cluster file, or etcd once set up, has its own)",
                            flag="--replication", env="KVPOOL_REPLICATION")
    etcd: str = knob("", "etcd endpoints (http://host:2379,...): the cluster map lives in etcd "
                     "and changes through POST /v1/cluster/join, /drain, /remove",
                     flag="--etcd", env="KVPOOL_ETCD")
    etcd_prefix: str = knob("/kvpool/default", "etcd key prefix of this cluster",
                            flag="--etcd-prefix", env="KVPOOL_ETCD_PREFIX")
    lease_ttl_s: float = knob(5.0, "seconds without keep-alive before etcd marks a node down",
                              flag="--etcd-lease-ttl", env="KVPOOL_ETCD_LEASE_TTL")
    etcd_user: str = knob("", "etcd user the node authenticates as ('' = etcd without auth: "
                          "anyone who reaches etcd can rewrite the cluster map)",
                          flag="--etcd-user", env="KVPOOL_ETCD_USER")
    etcd_password: str = knob("", "--etcd-user's password (give it as a file: "
                              "KVPOOL_ETCD_PASSWORD_FILE)",
                              flag="--etcd-password", env="KVPOOL_ETCD_PASSWORD")
    auto_join: bool = knob(True, "with etcd: a node not yet in the map adds itself (up) when it "
                           "first registers", flag="--auto-join", env="KVPOOL_AUTO_JOIN",
                           kind="bool")

    drain_rate_bytes: int = knob(256 << 20, "bytes per second a draining node hands to the new "
                                 "owners", flag="--drain-rate", env="KVPOOL_DRAIN_RATE",
                                 kind="size")

    def __post_init__(self) -> None:
        if self.drain_rate_bytes < 1 << 20:
            raise ConfigError("drain_rate_bytes must be at least 1 MiB/s")
        if sum(map(bool, (self.file, self.peers, self.etcd))) > 1:
            raise ConfigError("set one of --cluster-file, --peers or --etcd, not both")
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise ConfigError("give both --etcd-user and its password "
                              "(KVPOOL_ETCD_PASSWORD_FILE), or neither")
        if self.lease_ttl_s < 1:
            raise ConfigError("etcd lease_ttl_s must be >= 1 second")
        if self.replication < 1:
            raise ConfigError("replication must be >= 1")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    auth_tokens: str = knob("", "tokens file (TOML: [[token]] token or sha256, tenant, role; "
                            "[tenant.NAME] dram_quota); re-read on SIGHUP ('' = open mode: no "
                            "auth, no tenants)", flag="--auth-tokens", env="KVPOOL_AUTH_TOKENS")
    peer_token: str = knob("", "token this node presents to the other nodes (hand-off, "
                           "cluster lookups): an admin token of their tokens files",
                           flag="--peer-token", env="KVPOOL_PEER_TOKEN")
    tls_cert: str = knob("", "PEM certificate (chain) of this node: TLS on the data and admin "
                         "ports ('' = plain TCP)", flag="--tls-cert", env="KVPOOL_TLS_CERT")
    tls_key: str = knob("", "PEM private key of --tls-cert", flag="--tls-key",
                        env="KVPOOL_TLS_KEY")
    tls_client_ca: str = knob("", "PEM CA bundle: clients must present a certificate it signed "
                              "('' = no client certificates)", flag="--tls-client-ca",
                              env="KVPOOL_TLS_CLIENT_CA")
    tls_ca: str = knob("", "PEM CA bundle this node trusts when it connects to other nodes "
                       "over TLS ('' = the system's)", flag="--tls-ca", env="KVPOOL_TLS_CA")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("give both --tls-cert and --tls-key, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs TLS on (--tls-cert and --tls-key)")
        for name in ("auth_tokens", "tls_cert", "tls_key", "tls_client_ca", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"security.{name}: no such file {path}")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    s3: S3Config = field(default_factory=S3Config)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


_SECTIONS: dict[str, type[Any]] = {"server": ServerConfig, "dram": DramConfig, "ssd": SsdConfig,
                                   "s3": S3Config, "cluster": ClusterConfig,
                                   "security": SecurityConfig}


def knob_table() -> str:
    """Every knob as Markdown table rows (docs/configuration.md's table)."""
    return knobs.knob_table(_SECTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per knob; its help names the default and the environment variable."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with [server], [dram], "
                        "[ssd], [s3], [cluster] and [security] sections (env: KVPOOL_CONFIG)")
    knobs.add_arguments(parser, _SECTIONS)


#: KVPOOL_* names that are not node knobs: the SDK's (URL, TOKEN), the CLI's (ADMIN), files
OTHER_ENV = frozenset({"KVPOOL_CONFIG", "KVPOOL_CACHE_DIR", "KVPOOL_URL", "KVPOOL_TOKEN",
                       "KVPOOL_ADMIN"})


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """``KVPOOL_*`` names in ``env`` that no knob reads (typos, mostly)."""
    known = knobs.known_env(_SECTIONS) | OTHER_ENV
    return sorted(k for k in env if k.startswith("KVPOOL_") and k not in known)


def load_config(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Defaults, then the TOML file, then ``KVPOOL_*`` variables, then flags."""
    env = os.environ if env is None else env
    path = getattr(args, "config", None) or env.get("KVPOOL_CONFIG")
    values = knobs.read_values(_SECTIONS, path, env, args)
    return NodeConfig(**{name: cls(**values[name]) for name, cls in _SECTIONS.items()})
