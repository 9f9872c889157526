#!/usr/bin/env bash
# Build the brain's image with whatever engine this machine has: docker, podman, or buildah.
#   deploy/image.sh [TAG]         BASE=<image> to build on a given base
# Without BASE, where no registry image can be pulled, a Debian bookworm base is made from the Debian
# mirror with mmdebstrap and imported (localhost/warmroute-base:bookworm), once.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/warmroute:latest}
BASE_TAG=localhost/warmroute-base:bookworm

engine=""
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
elif command -v buildah >/dev/null; then engine=buildah
elif command -v podman >/dev/null; then engine=podman
fi
[ -n "$engine" ] || { echo "image: no docker, podman or buildah on this machine (apt-get install buildah)" >&2; exit 3; }

have_image() {
  case $engine in
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
    *) "$engine" image inspect "$1" >/dev/null 2>&1 ;;
  esac
}

if [ -z "${BASE:-}" ] && [ "$engine" != docker ]; then
  # podman and buildah here cannot pull from Docker Hub; build the base from the Debian mirror instead
  if ! have_image "$BASE_TAG"; then
    command -v mmdebstrap >/dev/null || { echo "image: set BASE=<image>, or apt-get install mmdebstrap" >&2; exit 3; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$tmp/rootfs.tar"
    if [ "$engine" = podman ]; then podman import --quiet "$tmp/rootfs.tar" "$BASE_TAG" >/dev/null
    else
      ctr=$(buildah from scratch)
      buildah add --quiet "$ctr" "$tmp/rootfs.tar" / >/dev/null
      buildah commit --quiet "$ctr" "$BASE_TAG" >/dev/null
      buildah rm "$ctr" >/dev/null
    fi
  fi
  BASE=$BASE_TAG
fi

# the wheels, built here with this machine's pip settings (index, mirror, CA); the build then needs no network
PIP=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip" )}
# setuptools builds in build/lib and never empties it: a file moved or deleted since the last build would ship
rm -rf build/wheels build/lib build/bdist.*
$PIP wheel --quiet --disable-pip-version-check --wheel-dir build/wheels '.[kubernetes]'
# what a dependency needs only on the image's Python (Debian's 3.11.2: redis wants async-timeout below 3.11.3),
# which this machine's Python did not ask for
$PIP wheel --quiet --disable-pip-version-check --wheel-dir build/wheels 'async-timeout>=4.0.3'

args=()
[ -n "${BASE:-}" ] && args+=(--build-arg "BASE=$BASE")
case $engine in
  docker) docker build "${args[@]}" -t "$TAG" . ;;
  podman) podman build --isolation chroot --format docker "${args[@]}" -t "$TAG" . ;;
  buildah) buildah bud --isolation chroot --format docker "${args[@]}" -t "$TAG" . ;;
esac
echo "image: built $TAG with $engine"
