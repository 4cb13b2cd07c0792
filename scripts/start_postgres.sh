#!/usr/bin/env bash
# Start a throwaway PostgreSQL 15 cluster on a loopback port, as the postgres user.
# Installs Debian's postgresql-15 if it is missing. Prints the SQLAlchemy URL on stdout.
# Usage: scripts/start_postgres.sh [DIR] [PORT]
set -euo pipefail
dir=${1:-/tmp/kvrelay-pg}
port=${2:-54329}
bin=/usr/lib/postgresql/15/bin
if [ ! -x "$bin/initdb" ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15) >&2
fi
id postgres >/dev/null 2>&1 || useradd --system --home /var/lib/postgresql postgres
if [ ! -f "$dir/PG_VERSION" ]; then
  rm -rf "$dir"; mkdir -p "$dir"; chown postgres "$dir"
  su postgres -c "$bin/initdb -D $dir -A trust -U postgres" >&2
fi
if ! su postgres -c "$bin/pg_ctl -D $dir status" >/dev/null 2>&1; then
  su postgres -c "$bin/pg_ctl -D $dir -l $dir/log -w -o '-k /tmp -h 127.0.0.1 -p $port' start" >&2
fi
su postgres -c "psql -h 127.0.0.1 -p $port -U postgres -tc \"select 1 from pg_database where datname='kvrelay_test'\"" | grep -q 1 \
  || su postgres -c "psql -h 127.0.0.1 -p $port -U postgres -c 'create database kvrelay_test'" >&2
echo "postgresql+psycopg://postgres@127.0.0.1:$port/kvrelay_test"
