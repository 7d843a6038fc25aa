#!/usr/bin/env bash
# A Debian bookworm base image from Debian's packages alone, for a machine that reaches no image registry
# (`make base-images`; docs/deploy.md): debootstrap's minbase with the packages of KIND, brought up to date from
# bookworm-updates and bookworm-security, imported into the local engine as TAG.
#   bash services/images/bootstrap-base.sh python solrl/base:bookworm   # python3 + venv: services/Dockerfile's BASE
#   bash services/images/bootstrap-base.sh redis solrl/redis:bookworm   # redis-server: docker-compose*.yml's redis
# Runs as root (debootstrap, chroot). The root filesystem's tarball is kept in CACHE (build/base) and imported
# again from there when the image is gone; delete it to bootstrap afresh. MIRROR: the Debian mirror (default: the
# host's first `deb.debian.org`-style URI in /etc/apt, else deb.debian.org).
set -euo pipefail
kind=${1:?usage: bootstrap-base.sh python|redis TAG}
tag=${2:?usage: bootstrap-base.sh python|redis TAG}
cache=${CACHE:-build/base}
case "$kind" in
  # python3-venv brings ensurepip (pip, setuptools): the images' /opt/venv
  python) include=python3,python3-venv,ca-certificates; user=root ;;
  # Debian's redis-server creates the redis user (uid 100 or so: the image records it by name)
  redis) include=redis-server,redis-tools; user=redis ;;
  *) echo "bootstrap-base.sh: KIND is python or redis, got '$kind'" >&2; exit 2 ;;
esac
if [ -z "${MIRROR:-}" ]; then
  MIRROR=$(sed -n 's/^\(URIs:\|deb\) *\(http[^ ]*debian\)\/\?\( .*\)\?$/\2/p' /etc/apt/sources.list \
             /etc/apt/sources.list.d/* 2>/dev/null | head -n 1 || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
tarball=$cache/$kind-bookworm.tar
if [ ! -s "$tarball" ]; then
  t0=$SECONDS
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include="$include" bookworm "$root" "$MIRROR" >/dev/null
  security=${MIRROR%/debian}/debian-security
  cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $security bookworm-security main
SOURCES
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  chroot "$root" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get -y -qq upgrade >/dev/null \
    && apt-get clean' </dev/null
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/* \
    "$root"/usr/share/info/* "$root"/var/log/*.log "$root"/etc/resolv.conf
  : > "$root/etc/resolv.conf"   # the engine mounts its own
  if [ "$kind" = redis ]; then
    # the data directory as the official image has it: /data, the redis user's (a named volume starts as its copy)
    chroot "$root" sh -c 'mkdir -p /data && chown redis:redis /data'
  fi
  mkdir -p "$cache"
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  echo "bootstrap-base.sh: $kind root filesystem in $((SECONDS - t0)) s: $tarball" >&2
fi
changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'ENV LANG=C.UTF-8'
         --change "USER $user")
if [ "$kind" = redis ]; then
  changes+=(--change 'WORKDIR /data' --change 'VOLUME /data' --change 'EXPOSE 6379' --change 'CMD ["redis-server"]')
else
  changes+=(--change 'CMD ["python3"]')
fi
docker import "${changes[@]}" --message "debootstrap --variant=minbase bookworm + $include" "$tarball" "$tag" >/dev/null
echo "bootstrap-base.sh: imported $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)" >&2
