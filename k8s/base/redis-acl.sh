#!/bin/sh
# Start Redis with one ACL user per solrl role, from the environment (Kubernetes: the solrl-redis Secret;
# compose: the user's environment, or files: SOLRL_REDIS_<ROLE>_PASSWORD_FILE names one). Used by k8s/base/redis.yaml and every docker-compose file:
#   sh redis-acl.sh ACL_FILE redis-server [OPTION ...]
# writes ACL_FILE (mode 600, SHA-256 hashes only, no password in it or on any command line) and execs the
# command with `--aclfile ACL_FILE`, the passwords gone from its environment.
#
# Users, on the queue namespace NS (SOLRL_QUEUE_NAMESPACE, default solrl:default; keys NS:<stream>,
# NS:<stream>:dead, NS:<stream>:done:<group>:<job>, solrl/queue/redis_streams.py):
#   trainer      publishes NS:explore, consumes NS:rollouts          SOLRL_REDIS_TRAINER_PASSWORD
#   explorer     consumes NS:explore, publishes NS:regenerate        SOLRL_REDIS_EXPLORER_PASSWORD
#   regenerator  consumes NS:regenerate, publishes NS:rollouts       SOLRL_REDIS_REGENERATOR_PASSWORD
#   keda         reads NS:explore's length and pending entries       SOLRL_REDIS_KEDA_PASSWORD (optional)
# Each may also create the pipeline's consumer groups and read every stream's length; nothing else: no
# other key, no admin command, no writes to another role's stream (NOPERM). `default` (no password) may
# only PING, for the health checks.
set -eu

if [ "$#" -lt 2 ]; then
  echo "usage: redis-acl.sh ACL_FILE redis-server [OPTION ...]" >&2
  exit 2
fi
acl=$1
shift

ns=${SOLRL_QUEUE_NAMESPACE:-solrl:default}
case "$ns" in
  "" | *[!A-Za-z0-9:_.-]*)
    echo "redis-acl.sh: SOLRL_QUEUE_NAMESPACE must be letters, digits and : _ . - (it becomes ACL key patterns)" >&2
    exit 2 ;;
esac

hash() {
  printf '%s' "$1" | sha256sum | cut -d ' ' -f 1
}

need() {  # refuses to start without variable $1, or the file variable $1_FILE names (compose `secrets:`)
  eval "value=\${$1:-}"
  eval "file=\${$1_FILE:-}"
  if [ -z "$value" ] && [ -n "$file" ]; then
    value=$(cat "$file") || { echo "redis-acl.sh: $1_FILE: cannot read $file" >&2; exit 2; }
    eval "$1=\$value"
  fi
  if [ -z "$value" ]; then
    echo "redis-acl.sh: $1 is not set (the $2 role's Redis password, e.g. openssl rand -hex 32)" >&2
    exit 2
  fi
}

base='resetkeys resetchannels -@all +ping +hello +client|setname +script|load'

consumer() {  # the stream $1 a role consumes in group $2 (reclaim, read, ack, dead letters, processed jobs)
  printf '%s' " (~$ns:$1 ~$ns:$1:dead +evalsha)"
  printf '%s' " (~$ns:$1 +xreadgroup +xautoclaim +xpending +xack +xdel +xinfo|groups +exists +xlen +xgroup|create)"
  printf '%s' " (~$ns:$1:dead +xadd +xrange)"
  if [ -n "$2" ]; then
    printf '%s' " (~$ns:$1:done:$2:* +set +exists)"
  fi
}

producer() {  # the stream $1 a role publishes to (the publish script: XLEN, XADD)
  printf '%s' " (~$ns:$1 +evalsha +xadd +xlen +xinfo|groups +xgroup|create)"
}

other() {  # a stream a role only creates the groups of and measures
  printf '%s' " (~$ns:$1 +xgroup|create +xlen)"
}

need SOLRL_REDIS_TRAINER_PASSWORD trainer
need SOLRL_REDIS_EXPLORER_PASSWORD explorer
need SOLRL_REDIS_REGENERATOR_PASSWORD regenerator
umask 077
trainer=$(hash "$SOLRL_REDIS_TRAINER_PASSWORD")
explorer=$(hash "$SOLRL_REDIS_EXPLORER_PASSWORD")
regenerator=$(hash "$SOLRL_REDIS_REGENERATOR_PASSWORD")
{
  echo "user default on nopass resetkeys resetchannels -@all +ping"
  echo "user trainer on #$trainer $base$(consumer rollouts '')$(producer explore)$(other regenerate)"
  echo "user explorer on #$explorer $base$(consumer explore explorers)$(producer regenerate)$(other rollouts)"
  echo "user regenerator on #$regenerator $base$(consumer regenerate regenerators)$(producer rollouts)$(other explore)"
  if [ -n "${SOLRL_REDIS_KEDA_PASSWORD:-}" ]; then
    echo "user keda on #$(hash "$SOLRL_REDIS_KEDA_PASSWORD") $base (%R~$ns:explore +xpending +xinfo|groups +xinfo|stream +xlen)"
  fi
} > "$acl"
unset SOLRL_REDIS_TRAINER_PASSWORD SOLRL_REDIS_EXPLORER_PASSWORD SOLRL_REDIS_REGENERATOR_PASSWORD \
  SOLRL_REDIS_KEDA_PASSWORD value
exec "$@" --aclfile "$acl"
