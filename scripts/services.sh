#!/usr/bin/env bash
# Checks the local services the tests use and starts any that is installed but stopped.
# Only services that are installed are started; the tests decide what a missing one means
# (a failure when CI=true, a skip with a reason otherwise).
set -u

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # name port seconds
  local i
  for ((i = 0; i < $3 * 10; i++)); do port_open "$2" && return 0; sleep 0.1; done
  echo "services: $1 did not come up on port $2 within $3 s" >&2
  return 1
}

ensure() { # name port seconds binary start-function
  local name=$1 port=$2 seconds=$3 binary=$4 start=$5
  if port_open "$port"; then echo "services: $name is up (:$port)"; return 0; fi
  if ! command -v "$binary" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$binary" ]; then
    echo "services: $name is not installed ($binary not found); its tests will skip (or fail under CI=true)" >&2
    return 0
  fi
  echo "services: starting $name"
  "$start" >/dev/null 2>&1 || true
  wait_port "$name" "$port" "$seconds" || true
}

pg_start() { pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start; }
redis_start() {
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
}
nats_start() {
  mkdir -p /var/lib/nats-server
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
}
mariadb_start() { start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd; }
rabbitmq_start() { rabbitmq-server -detached; }
mosquitto_start() { mosquitto -d -c /etc/mosquitto/mosquitto.conf; }

ensure postgresql 5432 30 pg_ctlcluster pg_start
# The WAL outbox and the Debezium layout need wal_level=logical, which takes a restart.
# Opt-in (OUTBOXER_SET_WAL_LEVEL=1): restarting the shared server under other running tests
# breaks them. Their own tests do not need it (tests/pgmodes starts a private server).
pg_wal_level_logical() {
  local level cluster
  level=$(runuser -u postgres -- psql -h 127.0.0.1 -p 5432 -U postgres -tAc "SHOW wal_level" 2>/dev/null) || return 0
  [ "$level" = logical ] && { echo "services: postgresql wal_level is logical"; return 0; }
  echo "services: postgresql wal_level is '$level': setting it to logical and restarting"
  runuser -u postgres -- psql -h 127.0.0.1 -p 5432 -U postgres -qc "ALTER SYSTEM SET wal_level = logical" || return 1
  cluster=$(ls /etc/postgresql | head -n1)
  pg_ctlcluster --skip-systemctl-redirect "$cluster" main restart && wait_port postgresql 5432 30
}
if [ "${OUTBOXER_SET_WAL_LEVEL:-0}" = 1 ] && port_open 5432; then pg_wal_level_logical; fi
ensure redis 6379 15 redis-server redis_start
ensure rabbitmq 5672 90 rabbitmq-server rabbitmq_start
ensure mosquitto 1883 15 mosquitto mosquitto_start
ensure nats 4222 15 nats-server nats_start
ensure mariadb 3306 30 mariadbd mariadb_start
exit 0
