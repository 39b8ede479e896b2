"""Config: defaults, then TOML, then KVPOOL_* env, then flags; bad values are clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpool.protocol.errors import ConfigError
from kvpool.server.config import add_arguments, load_config, parse_size, unknown_env_vars


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults() -> None:
    cfg = load_config(parse(), env={})
    assert (cfg.server.host, cfg.server.data_port, cfg.server.admin_port) == ("127.0.0.1", 7700,
                                                                             7701)
    assert cfg.dram.capacity_bytes == 0 and cfg.dram.capacity_fraction == 0.5
    assert cfg.dram.policy == "chain" and cfg.ssd.admit == "all"
    chosen = load_config(parse("--dram-policy", "lru", "--ssd-admit", "reused"), env={})
    assert chosen.dram.policy == "lru" and chosen.ssd.admit == "reused"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "kvpool.toml"
    toml.write_text('[server]\ndata_port = 8000\nadmin_port = 8001\nmax_batch = 10\n'
                    '[dram]\ncapacity_bytes = "2GiB"\n')
    env = {"KVPOOL_DATA_PORT": "9000", "KVPOOL_DRAM_CAPACITY": "3GiB"}
    cfg = load_config(parse("--config", str(toml), "--data-port", "9500"), env=env)
    assert cfg.server.data_port == 9500  # flag beats env
    assert cfg.dram.capacity_bytes == 3 << 30  # env beats file
    assert cfg.server.admin_port == 8001 and cfg.server.max_batch == 10  # file beats default


def test_config_file_from_env(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text("[dram]\ndefault_ttl_s = 30\n")
    assert load_config(parse(), env={"KVPOOL_CONFIG": str(toml)}).dram.default_ttl_s == 30


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("1.5G", 1_500_000_000), ("4096", 4096),
    ("64 kb", 64_000),
])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("argv", "env", "match"), [
    (["--data-port", "70000"], {}, "not a port"),
    (["--data-port", "abc"], {}, "bad value"),
    ([], {"KVPOOL_DRAM_CAPACITY": "lots"}, "not a size"),
    (["--dram-fraction", "2"], {}, "capacity_fraction"),
    (["--log-level", "loud"], {}, "log level"),
    (["--max-value", "2GiB"], {}, "max_frame_bytes"),
    (["--peers", "h:1"], {"KVPOOL_CLUSTER_FILE": "c.toml"}, "not both"),
    (["--replication", "0"], {}, "replication"),
    (["--dram-policy", "mru"], {}, "dram policy must be one of chain, lru"),
    ([], {"KVPOOL_SSD_ADMIT": "some"}, "ssd admit must be one of all, reused"),
])
def test_bad_values(argv: list[str], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(parse(*argv), env=env)


def test_a_knob_from_a_file_with_the_FILE_form(tmp_path: Path) -> None:
    """Docker's secrets convention: KVPOOL_X_FILE names a file holding KVPOOL_X."""
    secret = tmp_path / "peer-token"
    secret.write_text("peer-token-from-a-file\n")
    env = {"KVPOOL_PEER_TOKEN_FILE": str(secret), "KVPOOL_DATA_PORT_FILE": str(secret)}
    with pytest.raises(ConfigError, match="KVPOOL_DATA_PORT_FILE"):  # converted as the knob
        load_config(parse(), env=env)
    del env["KVPOOL_DATA_PORT_FILE"]
    assert load_config(parse(), env=env).security.peer_token == "peer-token-from-a-file"
    assert unknown_env_vars(env) == []
    with pytest.raises(ConfigError, match="not both"):
        load_config(parse(), env={**env, "KVPOOL_PEER_TOKEN": "another"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(parse(), env={"KVPOOL_PEER_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="etcd-user"):
        load_config(parse("--etcd-user", "kvpool"), env={})


def test_bad_file(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text("[server]\nport = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key server\.port"):
        load_config(parse("--config", str(toml)), env={})
    toml.write_text("[clusters]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(parse("--config", str(toml)), env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(parse("--config", str(tmp_path / "missing.toml")), env={})
